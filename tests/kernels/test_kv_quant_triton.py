"""The Triton kernels on quantized (int8 / fp8 e4m3) KV caches against the torch path, the oracle.

Both backends start from the same poisoned pool (0xFF bytes: NaN scales and
NaN fp8 codes wherever nothing was written) holding the same earlier context,
and run the same step: the stored rows (codes and scales) must come out
byte-identical, the outputs within float rounding of each other.

On the CPU these run under the Triton interpreter (the kernels' maths, not
their lowering); the ``gpu`` tests run the compiled kernels and are part of
``load_tests/gpu_check.sh``. Until a GPU run is recorded, the compiled
quantized path is untested.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from streamkv.attention.torch_paged import TorchPagedAttention  # noqa: E402
from streamkv.attention.triton_paged import TritonPagedAttention  # noqa: E402
from tests.test_kv_quant import run_step  # noqa: E402

STEPS = {
    "decode": ([1, 1, 1, 1], [1, 16, 17, 150]),
    "mixed": ([1, 40, 1, 9], [70, 40, 1, 41]),  # decodes, a fresh prefill, a chunk over cached context
}


def compare(name: str, dtype: torch.dtype, step: str, device: str, head_dim: int = 64) -> None:
    query_lens, seq_lens = STEPS[step]
    shape = dict(num_heads=8, num_kv_heads=2, head_dim=head_dim, dtype=dtype, device=device)
    ref, ref_cache = run_step(name, TorchPagedAttention(), query_lens, seq_lens, **shape)  # type: ignore[arg-type]
    out, cache = run_step(name, TritonPagedAttention(), query_lens, seq_lens, **shape)  # type: ignore[arg-type]
    assert out.dtype == dtype and not out.isnan().any()
    assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8))
    # 16-bit outputs: a few units in the last place apart (SDPA in bf16 vs the kernels' fp32 accumulators)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=0 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("step", sorted(STEPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_kernels_match_torch_path(name: str, step: str, dtype: torch.dtype) -> None:
    compare(name, dtype, step, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantized_kernels_match_torch_path_cuda(name: str, dtype: torch.dtype) -> None:
    for step in sorted(STEPS):
        compare(name, dtype, step, "cuda", head_dim=128)
