"""Our Llama-family forward pass against transformers' own model, through the paged cache."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from streamkv.attention.backend import AttentionBackend
from streamkv.attention.metadata import AttentionMetadata
from streamkv.attention.torch_paged import TorchPagedAttention
from streamkv.config import ModelConfig
from streamkv.model import llama
from streamkv.model.linear import Linear, has_gguf_kernel
from streamkv.model.llama import LlamaConfig, LlamaForCausalLM, RopeScaling, rope_inv_freq
from streamkv.model.loader import HFCheckpoint, LoadedModel, from_hf, load_model
from tests.model.built import built_tensors

ATOL = 1e-4
BLOCK_SIZE = 4

# Per step, new tokens of each sequence (0: not scheduled this step).
SCHEDULES = {
    "full_prefill": [[15]],
    "prefill_then_decode": [[10], [1], [1], [1], [1], [1]],
    "three_chunks": [[5], [6], [4]],
    # decodes + chunks + a late full prefill in the same steps (the mixed path).
    "mixed_batch": [[10, 5, 0], [1, 6, 0], [1, 4, 15], [1, 0, 0], [1, 0, 0], [1, 0, 0]],
}


def scattered_pool(
    model: LlamaForCausalLM, seqs: list[list[int]], seed: int
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Block tables of ``seqs`` drawn from a shuffled pool, and one KV cache per layer with NaN in every slot.

    Reading a slot not yet written poisons the logits.
    """
    rng = random.Random(seed)
    needed = [-(-len(s) // BLOCK_SIZE) for s in seqs]
    num_blocks = sum(needed) + 3
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    tables = []
    for n in needed:
        tables.append(pool[:n])
        pool = pool[n:]
    cfg = model.config
    kv_caches = [
        torch.full((2, num_blocks, BLOCK_SIZE, cfg.num_key_value_heads, cfg.head_dim), float("nan"))
        for _ in range(model.num_layers)
    ]
    return tables, kv_caches


def paged_steps(
    seqs: list[list[int]], schedule: list[list[int]], tables: list[list[int]]
) -> Iterator[tuple[list[int], list[int], AttentionMetadata, list[int]]]:
    """Per step of ``schedule``: ``(token ids, positions, metadata, indices of the scheduled sequences)``."""
    computed = [0] * len(seqs)
    for step in schedule:
        ids: list[int] = []
        positions: list[int] = []
        query_lens, seq_lens, step_tables, members = [], [], [], []
        for i, n in enumerate(step):
            if n == 0:
                continue
            start = computed[i]
            ids += seqs[i][start : start + n]
            positions += range(start, start + n)
            query_lens.append(n)
            seq_lens.append(start + n)
            step_tables.append(tables[i])
            members.append(i)
            computed[i] += n
        yield ids, positions, AttentionMetadata.build(query_lens, seq_lens, step_tables, BLOCK_SIZE), members
    assert computed == [len(s) for s in seqs]


def run_paged(
    model: LlamaForCausalLM,
    seqs: list[list[int]],
    schedule: list[list[int]],
    seed: int,
    backend: AttentionBackend | None = None,
    caches_out: list[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """Feed ``seqs`` through the paged cache step by step, scattered block tables.

    Args:
        caches_out: when given, receives the KV caches of every layer after the last step.

    Returns:
        Per sequence, float32 logits ``[len, vocab]`` of every token it computed.
    """
    tables, kv_caches = scattered_pool(model, seqs, seed)
    backend = backend or TorchPagedAttention()
    logits: list[list[torch.Tensor]] = [[] for _ in seqs]
    for ids, positions, meta, members in paged_steps(seqs, schedule, tables):
        with torch.inference_mode():
            hidden = model(torch.tensor(ids), torch.tensor(positions), kv_caches, meta, backend)
            step_logits = model.compute_logits(hidden)
        query_lens = [b - a for a, b in itertools.pairwise(meta.query_start_loc_cpu)]
        for i, rows in zip(members, step_logits.split(query_lens), strict=True):
            logits[i].append(rows)
    if caches_out is not None:
        caches_out.extend(kv_caches)
    return [torch.cat(parts) for parts in logits]


def run_paged_last_rows(
    model: LlamaForCausalLM, seqs: list[list[int]], schedule: list[list[int]], seed: int, backend: AttentionBackend
) -> tuple[dict[tuple[int, int], torch.Tensor], list[torch.Tensor]]:
    """:func:`run_paged`'s steps as the runner runs them: hidden states of sampling rows only (``output_rows``).

    Every other scheduled sequence of a step samples (the first, the third ...), so steps have rows that do
    not sample and steps where none does.

    Returns:
        ``{(sequence, position): float32 logits [vocab]}`` of the sampled rows, and the KV caches at the end.
    """
    tables, kv_caches = scattered_pool(model, seqs, seed)
    sampled: dict[tuple[int, int], torch.Tensor] = {}
    for step_no, (ids, positions, meta, members) in enumerate(paged_steps(seqs, schedule, tables)):
        sampling = [j for j in range(len(members)) if (j + step_no) % 2 == 0]
        rows = meta.last_rows(sampling)
        with torch.inference_mode():
            hidden = model(torch.tensor(ids), torch.tensor(positions), kv_caches, meta, backend, rows)
        assert hidden.shape == (len(sampling), model.config.hidden_size)
        if sampling:
            for j, row_logits in zip(sampling, model.compute_logits(hidden), strict=True):
                sampled[(members[j], meta.seq_lens_cpu[j] - 1)] = row_logits
    return sampled, kv_caches


def hf_logits(hf_model: Any, ids: list[int]) -> torch.Tensor:
    """transformers' logits ``[len, vocab]`` for one sequence, memoised on the model object."""
    memo = hf_model.__dict__.setdefault("_streamkv_test_logits", {})
    if tuple(ids) not in memo:
        with torch.inference_mode():
            memo[tuple(ids)] = hf_model(torch.tensor([ids])).logits[0].float()
    return memo[tuple(ids)]


def assert_matches_hf(
    ours: LoadedModel,
    hf_model: Any,
    seqs: list[list[int]],
    schedule_name: str,
    atol: float = ATOL,
    backend: AttentionBackend | None = None,
) -> None:
    schedule = SCHEDULES[schedule_name]
    seqs = seqs[: len(schedule[0])]
    for i, got in enumerate(run_paged(ours.model, seqs, schedule, seed=len(schedule_name), backend=backend)):
        expected = hf_logits(hf_model, seqs[i])
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, expected, atol=atol, rtol=0, msg=lambda m, i=i: f"seq {i}: {m}")


# --- tiny random models -------------------------------------------------------


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral"])
def tiny(request: pytest.FixtureRequest, tiny_model_dirs: dict[str, str]) -> tuple[LoadedModel, Any]:
    folder = tiny_model_dirs[request.param]
    ours = load_model(ModelConfig(model=folder, dtype="float32"), torch.device("cpu"))
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return ours, hf_model


def random_seqs(vocab_size: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (15,), generator=gen).tolist() for _ in range(3)]


@pytest.mark.parametrize("schedule_name", SCHEDULES)
@pytest.mark.parametrize("backend_name", ["torch", "cpu"])
def test_tiny_last_layer_on_the_sampling_rows_alone(
    tiny: tuple[LoadedModel, Any], schedule_name: str, backend_name: str
) -> None:
    # The runner's path for steps with prefill rows: the last layer writes every row's K/V but runs attention,
    # o_proj and the MLP on the sampling rows only. Their logits must still be transformers', and the KV pool
    # must hold the same bytes as after the full forward (later steps read every row's K/V).
    ours, hf_model = tiny
    if backend_name == "cpu":
        cpu_paged = pytest.importorskip("streamkv.attention.cpu_paged")
        if not cpu_paged.cpu_ops_available():
            pytest.skip("the streamkv C++ CPU ops cannot be built here")
        backend: AttentionBackend = cpu_paged.CpuPagedAttention()
    else:
        backend = TorchPagedAttention()
    schedule = SCHEDULES[schedule_name]
    seqs = random_seqs(ours.model.config.vocab_size, seed=2)[: len(schedule[0])]
    full_caches: list[torch.Tensor] = []
    run_paged(ours.model, seqs, schedule, seed=5, backend=backend, caches_out=full_caches)
    sampled, caches = run_paged_last_rows(ours.model, seqs, schedule, seed=5, backend=backend)
    assert sampled, "no row sampled: the test checks nothing"
    for (i, pos), got in sampled.items():
        torch.testing.assert_close(got, hf_logits(hf_model, seqs[i])[pos], atol=ATOL, rtol=0)
    for layer, (a, b) in enumerate(zip(caches, full_caches, strict=True)):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), f"layer {layer}: the KV pools differ"


@pytest.mark.parametrize("schedule_name", SCHEDULES)
def test_tiny_logits_match_transformers(tiny: tuple[LoadedModel, Any], schedule_name: str) -> None:
    ours, hf_model = tiny
    assert_matches_hf(ours, hf_model, random_seqs(ours.model.config.vocab_size, seed=7), schedule_name)


@pytest.mark.parametrize("schedule_name", ["prefill_then_decode", "mixed_batch"])
def test_tiny_cpu_attention_backend_matches_transformers(tiny: tuple[LoadedModel, Any], schedule_name: str) -> None:
    cpu_paged = pytest.importorskip("streamkv.attention.cpu_paged")
    if not cpu_paged.cpu_ops_available():
        pytest.skip("the streamkv C++ CPU ops cannot be built here")
    ours, hf_model = tiny
    seqs = random_seqs(ours.model.config.vocab_size, seed=9)
    assert_matches_hf(ours, hf_model, seqs, schedule_name, backend=cpu_paged.CpuPagedAttention())


@pytest.mark.parametrize("schedule_name", ["prefill_then_decode", "mixed_batch"])
def test_tiny_mlp_in_row_slices_matches_transformers(
    tiny: tuple[LoadedModel, Any], schedule_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Long CPU steps run the MLP in slices of MLP_SLICE_ROWS rows (MLP_SLICE_ROWS_WIDE where the fp32 gate_up is
    # fused); 4 here, so every prefill is cut, a partial slice included, and each slice's rows must land where they
    # belong.
    monkeypatch.setattr(llama, "MLP_SLICE_ROWS", 4)
    monkeypatch.setattr(llama, "MLP_SLICE_ROWS_WIDE", 4)
    ours, hf_model = tiny
    steps: list[tuple[int, list[int]]] = []  # (rows of a step, the slices its MLP ran)
    mlp = ours.model.model.layers[0].mlp
    outer, inner = mlp.forward, mlp._forward
    monkeypatch.setattr(mlp, "forward", lambda x: steps.append((x.shape[0], [])) or outer(x))
    monkeypatch.setattr(mlp, "_forward", lambda x: steps[-1][1].append(x.shape[0]) or inner(x))
    assert_matches_hf(ours, hf_model, random_seqs(ours.model.config.vocab_size, seed=10), schedule_name)
    sliced = [(rows, slices) for rows, slices in steps if rows > 4]
    assert sliced and all(sum(s) == rows and max(s) == 4 for rows, s in sliced)
    assert any(rows % 4 for rows, _ in sliced)  # a partial last slice


def test_tiny_plain_matmul_path_matches_too(tiny: tuple[LoadedModel, Any]) -> None:
    ours, hf_model = tiny
    checkpoint = HFCheckpoint(model=hf_model, tokenizer=ours.tokenizer, name=ours.name)
    plain = from_hf(checkpoint, torch.float32, torch.device("cpu"), prepack=False)
    assert plain.model.packed_lm_head is None and plain.model.small_lm_head is None
    assert ours.model.packed_lm_head is not None or ours.model.small_lm_head is not None  # ours is prepacked
    assert_matches_hf(plain, hf_model, random_seqs(ours.model.config.vocab_size, seed=8), "mixed_batch")


def test_tiny_architectures_are_what_they_claim(tiny: tuple[LoadedModel, Any]) -> None:
    ours, _ = tiny
    cfg = ours.model.config
    assert (ours.model.num_layers, ours.model.num_kv_heads, ours.model.head_dim) == (2, 2, 16)
    assert cfg.qkv_bias == (cfg.model_type == "qwen2")
    assert cfg.tie_word_embeddings == (cfg.model_type == "qwen2")
    assert (cfg.rope_scaling is not None) == (cfg.model_type == "llama")


# --- the real SmolLM2 ------------------------------------------------------------


def smollm2_seqs(tok: Any) -> list[list[int]]:
    texts = [
        "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm afternoon sun.",
        "Paged attention stores keys and values in fixed-size blocks of memory, like virtual memory pages.",
        "<|im_start|>user\nWhat is the capital of France, and why?<|im_end|>\n<|im_start|>assistant\nThe capital",
    ]
    seqs = [tok(t, add_special_tokens=False)["input_ids"][:15] for t in texts]
    assert all(len(s) == 15 for s in seqs)
    return seqs


@pytest.mark.parametrize("schedule_name", ["full_prefill", "mixed_batch"])
def test_smollm2_logits_match_transformers(
    smollm2_plain: LoadedModel, smollm2_checkpoint: Any, schedule_name: str
) -> None:
    seqs = smollm2_seqs(smollm2_plain.tokenizer)
    assert_matches_hf(smollm2_plain, smollm2_checkpoint.model, seqs, schedule_name)


# oneDNN sums each dot product in another order than MKL: over 30 layers the logits
# (|logit| up to ~35) drift ~1.1e-4 from transformers' (its own float32 drift from a
# float64 run is ~4e-5, ours on oneDNN ~1.2e-4), so this path gets twice the tolerance. On an AVX2 build the
# small-batch kernel (k ascending, one FMA chain per output) runs every fp32 matmul, within the same tolerance.
ONEDNN_ATOL = 2e-4


def differences_from_a_fresh_load(ours: LoadedModel, checkpoint: HFCheckpoint) -> list[str]:
    """The names of ``ours``' built tensors that differ, bitwise, from those of a fresh load of ``checkpoint``."""
    fresh = built_tensors(from_hf(checkpoint, torch.float32, torch.device("cpu")).model)
    return [
        name
        for name, tensor in built_tensors(ours.model).items()
        if name not in fresh or fresh[name].shape != tensor.shape or not torch.equal(fresh[name], tensor)
    ]


@pytest.mark.parametrize("schedule_name", SCHEDULES)
def test_smollm2_prepacked_logits_match_transformers(
    smollm2: LoadedModel, smollm2_checkpoint: HFCheckpoint, schedule_name: str
) -> None:
    assert smollm2.model.packed_lm_head is not None or smollm2.model.small_lm_head is not None
    seqs = smollm2_seqs(smollm2.tokenizer)
    try:
        assert_matches_hf(smollm2, smollm2_checkpoint.model, seqs, schedule_name, atol=ONEDNN_ATOL)
    except AssertionError as exc:
        # Round 23's flake (oneMKL's dispatch race, streamkv.model.mkl_vml) showed here: say which tensors are off.
        differ = differences_from_a_fresh_load(smollm2, smollm2_checkpoint) or "none"
        raise AssertionError(f"{exc}\ntensors that differ from a fresh load in this process: {differ}") from exc


def test_a_load_builds_the_same_tensors_every_time(smollm2: LoadedModel, smollm2_checkpoint: HFCheckpoint) -> None:
    assert len(built_tensors(smollm2.model)) > 4 * smollm2.model.num_layers
    assert differences_from_a_fresh_load(smollm2, smollm2_checkpoint) == []


def test_smollm2_matmuls_run_on_the_ggufs_codes_bitwise(smollm2: LoadedModel, smollm2_checkpoint: HFCheckpoint) -> None:
    """Every projection's Q4_1 codes and the LM head's Q8_0 codes give the loaded weights (the loader checks that),
    and the kernel on them gives the float32 kernel's bits, at decode rows (one pass) and past them (the
    dequantized panel)."""
    from streamkv.ops.cpu_ops import load_linear_ops

    if not has_gguf_kernel(load_linear_ops()):
        pytest.skip("the GGUF kernel needs an AVX-512 build")
    floats = from_hf(smollm2_checkpoint, torch.float32, torch.device("cpu"), gguf_codes=False)
    pairs = [
        (m.small, floats.model.get_submodule(name).small)
        for name, m in smollm2.model.named_modules()
        if isinstance(m, Linear)
    ]
    assert len(pairs) == 4 * smollm2.model.config.num_hidden_layers
    pairs.append((smollm2.model.small_lm_head, floats.model.small_lm_head))
    for ours, reference in pairs:
        assert ours is not None and ours.packed.dtype == torch.uint8
        assert reference is not None and reference.packed.dtype == torch.float32
        block_bytes = 1088 if ours is pairs[-1][0] else 640  # Q8_0 head, Q4_1 projections
        assert ours.packed.shape[2] == block_bytes
        for rows in (1, 13):
            x = torch.randn(rows, reference.packed.shape[1])
            assert torch.equal(ours(x), reference(x))


def test_smollm2_shape(smollm2: LoadedModel) -> None:
    m = smollm2.model
    assert (m.num_layers, m.num_kv_heads, m.head_dim) == (30, 3, 64)
    assert m.config.tie_word_embeddings
    assert smollm2.max_model_len == 8192


# --- RoPE scaling ------------------------------------------------------------------


def test_llama3_rope_matches_transformers() -> None:
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    hf = HFLlamaConfig(
        hidden_size=2048,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=131072,
        rope_parameters=rope,
    )
    ours = LlamaConfig.from_hf(hf)
    assert ours.rope_scaling == RopeScaling("llama3", 32.0, 1.0, 4.0, 8192)
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, torch.device("cpu"))
    torch.testing.assert_close(rope_inv_freq(ours), expected, atol=0, rtol=0)


@pytest.mark.parametrize("rope_type", ["yarn", "dynamic", "longrope"])
def test_unsupported_rope_scaling_raises(rope_type: str) -> None:
    from transformers import LlamaConfig as HFLlamaConfig

    hf = HFLlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16)
    hf.rope_parameters = {"rope_type": rope_type, "rope_theta": 10000.0, "factor": 4.0}
    with pytest.raises(ValueError, match="unsupported RoPE scaling type"):
        LlamaConfig.from_hf(hf)


def test_unsupported_architecture_raises() -> None:
    from transformers import GPT2Config

    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        LlamaConfig.from_hf(GPT2Config())
