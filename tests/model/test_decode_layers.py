"""The decode-layer op (one C++ call per decoder layer in pure-decode steps) against the layer-by-layer path.

The op runs the same kernels in the same order, so greedy tokens and their
logprobs must be equal to the bit, over many decode steps, whatever the
weights (fp32, bf16, int8), the KV cache (the model's dtype, bf16 for fp32, int8) or the
head dim (the tiny model's 16 takes the portable attention kernel, SmolLM2's
64 the vectorised ones).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch

from streamkv.config import ModelConfig
from streamkv.llm import LLM
from streamkv.model.decode_layers import DecodeLayers
from streamkv.model.loader import HFCheckpoint, LoadedModel, from_hf, load_model
from streamkv.model.precision import onednn_has_bf16
from streamkv.ops.cpu_ops import load_linear_ops, set_amx
from streamkv.sampling_params import SamplingParams

PROMPTS = [[(7 * i + j) % 900 + 10 for j in range(n)] for i, n in enumerate((5, 40, 17))]


@pytest.fixture
def fast_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Rows of every step that ran on the op."""
    calls: list[int] = []
    original = DecodeLayers.forward

    def counted(self: DecodeLayers, h: torch.Tensor, *args: object) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(h.shape[0])
        return original(self, h, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(DecodeLayers, "forward", counted)
    yield calls


def require_op(loaded: LoadedModel) -> None:
    if loaded.model.model.decode_layers is None:
        pytest.skip("the decode-layer op is not in use here (no small-batch kernel for the dtype, or no build)")


def generate(
    loaded: LoadedModel, *, fast: bool, kv_cache_dtype: str = "auto", prompts: list[list[int]] = PROMPTS
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens of PROMPTS and the logits of every step, with the op in use or not."""
    model = loaded.model
    saved = model.model.decode_layers
    assert saved is not None, "the decode-layer op is not in use for this model"
    logits: list[torch.Tensor] = []
    compute_logits = model.compute_logits

    def recorded(hidden: torch.Tensor, *, widen: bool = True) -> torch.Tensor:
        out = compute_logits(hidden, widen=widen)
        logits.append(out.clone())
        return out

    model.compute_logits = recorded  # type: ignore[method-assign]
    if not fast:
        model.model.decode_layers = None
    try:
        llm = LLM(
            loaded=loaded, device="cpu", num_blocks=256, kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False
        )
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        llm.core.check_invariants()
    finally:
        model.model.decode_layers = saved
        del model.compute_logits
    return [o.outputs[0].token_ids for o in outs], logits


def check_same(
    loaded: LoadedModel, fast_calls: list[int], kv_cache_dtype: str = "auto", prompts: list[list[int]] = PROMPTS
) -> None:
    require_op(loaded)
    slow_tokens, slow_logits = generate(loaded, fast=False, kv_cache_dtype=kv_cache_dtype, prompts=prompts)
    assert not fast_calls
    fast_tokens, fast_logits = generate(loaded, fast=True, kv_cache_dtype=kv_cache_dtype, prompts=prompts)
    assert fast_tokens == slow_tokens and all(len(t) == 12 for t in fast_tokens)
    assert len(fast_logits) == len(slow_logits)
    assert all(torch.equal(a, b) for a, b in zip(fast_logits, slow_logits, strict=True))
    # decode steps took the op, prefill did not
    assert len(fast_calls) >= 10 and set(fast_calls) <= set(range(1, len(prompts) + 1))


def test_smollm2_fp32_decodes_40_rows_the_same_on_the_op(smollm2: LoadedModel, fast_calls: list[int]) -> None:
    # 40 decode rows: the small-batch kernel's passes of 10 rows (four per panel, the next panel prefetched).
    require_op(smollm2)
    prompts = [[(13 * i + j) % 900 + 10 for j in range(3 + i % 7)] for i in range(40)]
    check_same(smollm2, fast_calls, prompts=prompts)
    assert max(fast_calls) == 40


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16", "int8"])
def test_tiny_llama_decodes_the_same_on_the_op(tiny: LoadedModel, fast_calls: list[int], kv_cache_dtype: str) -> None:
    check_same(tiny, fast_calls, kv_cache_dtype)


def test_tiny_qwen2_with_qkv_bias_in_bf16(tiny_model_dirs: dict[str, str], fast_calls: list[int]) -> None:
    loaded = load_model(
        ModelConfig(model=tiny_model_dirs["qwen2"], dtype="bfloat16", device="cpu"), torch.device("cpu")
    )
    check_same(loaded, fast_calls)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16", "int8"])
def test_smollm2_fp32_decodes_the_same_on_the_op(
    smollm2: LoadedModel, fast_calls: list[int], kv_cache_dtype: str
) -> None:
    check_same(smollm2, fast_calls, kv_cache_dtype)


def test_smollm2_bf16_with_int8_weights(smollm2_checkpoint: HFCheckpoint, fast_calls: list[int]) -> None:
    if not onednn_has_bf16():
        pytest.skip("the decode-layer op is not in use here (int8 with bf16 activations needs oneDNN's bf16 matmuls)")
    loaded = from_hf(smollm2_checkpoint, torch.bfloat16, torch.device("cpu"), quantization="int8")
    check_same(loaded, fast_calls)


def test_smollm2_bf16_gate_up_with_silu_in_one_op_keeps_the_unfused_bits(
    smollm2_checkpoint: HFCheckpoint, fast_calls: list[int]
) -> None:
    # On AVX512-BF16 a bf16 layer's gate_up and SiLU-and-mul run as one small_linear_silu_mul on the GGUF's codes, in
    # the op and in the layer path alike; the op's unfused form (gate_up, then silu_and_mul) must give the same bits.
    ops = load_linear_ops()
    if ops is None or not ops.small_linear_silu_mul_supported():
        pytest.skip("the fused gate_up needs AVX512-BF16")
    loaded = from_hf(smollm2_checkpoint, torch.bfloat16, torch.device("cpu"))
    require_op(loaded)
    check_same(loaded, fast_calls)
    fast = loaded.model.model.decode_layers
    assert fast is not None and all(args[-2] is not None for args in fast.layers)  # the interleaved packs
    fused_tokens, fused_logits = generate(loaded, fast=True)
    unfused = tuple((*args[:-2], None, None) for args in fast.layers)
    loaded.model.model.decode_layers = dataclasses.replace(fast, layers=unfused)
    try:
        tokens, logits = generate(loaded, fast=True)
    finally:
        loaded.model.model.decode_layers = fast
    assert tokens == fused_tokens
    assert all(torch.equal(a, b) for a, b in zip(logits, fused_logits, strict=True))
    fast_calls.clear()
    before = set_amx(False)  # switched off: the packs run on vdpbf16ps, in the op and the layers alike
    try:
        check_same(loaded, fast_calls)
    finally:
        set_amx(before)


def test_steps_the_op_cannot_run_keep_the_layer_path(smollm2: LoadedModel, fast_calls: list[int]) -> None:
    require_op(smollm2)
    assert smollm2.model.model.decode_layers is not None
    llm = LLM(loaded=smollm2, device="cpu", num_blocks=256, kv_cache_dtype="fp8_e4m3", enable_prefix_caching=False)
    llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert not fast_calls  # an fp8 cache: the op would not write that cache itself
    assert DecodeLayers.build(list(smollm2.model.model.layers), None) is None
