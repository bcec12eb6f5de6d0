"""store_kv writes each token's K/V to exactly its slot and nowhere else."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from streamkv.kernels import store_kv  # noqa: E402


def _check_store(num_tokens: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                 device: str, strided: bool) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    num_blocks = -(-num_tokens // block_size) + 2
    cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype, device=device)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].to(device)
    if strided:
        # Key and value as views into a fused [T, 3 * Hkv, D] projection.
        fused = torch.randn((num_tokens, 3 * num_kv_heads, head_dim), generator=gen).to(dtype).to(device)
        key, value = fused[:, num_kv_heads : 2 * num_kv_heads], fused[:, 2 * num_kv_heads :]
    else:
        key = torch.randn((num_tokens, num_kv_heads, head_dim), generator=gen).to(dtype).to(device)
        value = torch.randn((num_tokens, num_kv_heads, head_dim), generator=gen).to(dtype).to(device)

    store_kv(key, value, cache, slots)

    flat = cache.view(2, -1, num_kv_heads, head_dim)
    assert torch.equal(flat[0, slots], key)
    assert torch.equal(flat[1, slots], value)
    untouched = torch.ones(flat.shape[1], dtype=torch.bool, device=device)
    untouched[slots] = False
    assert flat[:, untouched].isnan().all()


@pytest.mark.parametrize(
    ("num_tokens", "num_kv_heads", "head_dim", "block_size", "dtype", "strided"),
    [
        (13, 8, 64, 16, torch.float16, False),
        (40, 1, 128, 8, torch.bfloat16, True),
        (130, 4, 64, 128, torch.float32, False),
        (1, 3, 128, 32, torch.float32, True),
    ],
)
def test_store_kv_writes_exact_slots(num_tokens: int, num_kv_heads: int, head_dim: int, block_size: int,
                                     dtype: torch.dtype, strided: bool) -> None:
    _check_store(num_tokens, num_kv_heads, head_dim, block_size, dtype, "cpu", strided)


def test_store_kv_rejects_mismatched_shapes() -> None:
    cache = torch.zeros((2, 4, 16, 2, 64))
    key = torch.zeros((3, 2, 64))
    with pytest.raises(ValueError):
        store_kv(key, torch.zeros((3, 2, 32)), cache, torch.arange(3))
    with pytest.raises(ValueError):
        store_kv(key, key, cache, torch.arange(4))
    with pytest.raises(ValueError):
        store_kv(torch.zeros((3, 4, 64)), torch.zeros((3, 4, 64)), cache, torch.arange(3))


def test_store_kv_empty_step_is_a_no_op() -> None:
    cache = torch.zeros((2, 4, 16, 2, 64))
    store_kv(torch.zeros((0, 2, 64)), torch.zeros((0, 2, 64)), cache, torch.zeros(0, dtype=torch.int64))
    assert not cache.any()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_store_kv_cuda(dtype: torch.dtype) -> None:
    _check_store(4000, 8, 128, 16, dtype, "cuda", strided=True)
