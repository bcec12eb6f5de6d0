"""bf16 (the ``--dtype auto`` choice on CPUs with AVX512-BF16) against transformers in bf16 and our fp32.

Two figures, on the real SmolLM2 (loaded once per run):

* greedy tokens of the engine in bf16, checked position by position against
  transformers' bf16 model fed the same tokens (teacher forcing): each token
  is transformers' argmax, or, where it is not, the two candidates' logits
  in transformers lie within bf16 rounding of each other (``TIE_ULPS`` units
  in the last place of bf16 at the top logit's magnitude), so either choice is
  a correct bf16 answer. The test prints which positions were ties.
* perplexity of a fixed English text (~400 tokens) in bf16 within 0.5% of fp32.
"""

from __future__ import annotations

import copy
import math
import random
from typing import Any

import pytest
import torch

from streamkv.attention.metadata import AttentionMetadata
from streamkv.attention.torch_paged import TorchPagedAttention
from streamkv.llm import LLM
from streamkv.model.chat import ChatFormatter
from streamkv.model.loader import HFCheckpoint, LoadedModel, from_hf
from streamkv.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

NEW_TOKENS = 48
TIE_ULPS = 4  # bf16 has 8 significand bits: one ulp at |x| in [2^e, 2^(e+1)) is 2^(e-7)
# ~400 tokens: over the first paragraph alone (144 tokens) bf16's rounding noise alone moved the figure from -0.26%
# (oneDNN's AVX512-BF16 kernels) to +0.65% (its AMX kernels, same weights); over all three, -0.10% and -0.26%.
TEXT = (
    "The water cycle describes how water moves between the land, the oceans and the air. "
    "Heat from the sun evaporates water from seas and lakes, and plants release vapour from their "
    "leaves. As the warm, moist air rises it cools, and the vapour condenses into tiny droplets "
    "that form clouds. When the droplets grow heavy enough they fall as rain or snow. Some of that "
    "water runs off into rivers and flows back to the sea, some soaks into the ground and refills "
    "aquifers, and some is taken up by the roots of plants. Over thousands of years the same water "
    "passes through this cycle again and again, shaping valleys, feeding forests and keeping the "
    "climate of the planet within the narrow range that life depends on. "
    "People have always settled near water. The first towns grew up beside rivers, where the soil was rich "
    "and boats could carry goods from one place to another. Farmers learned to dig channels that brought "
    "water to their fields, and engineers built dams and aqueducts to store it and move it over long "
    "distances. Today a city of several million people needs a great deal of clean water every day, for "
    "drinking, for cooking and washing, and for the factories and power stations that keep it running. "
    "Most of that water is taken from rivers, lakes and wells, cleaned in treatment plants, and pumped "
    "through a network of pipes that may be hundreds of kilometres long. After it has been used, the "
    "waste water flows through another set of pipes to plants where it is cleaned again before it is "
    "returned to a river or the sea. "
    "Because fresh water is so important, scientists watch the water cycle closely. Satellites measure "
    "the temperature of the oceans, the amount of snow on the mountains and the moisture in the soil. "
    "Weather stations record how much rain falls in each region, and gauges on rivers show how quickly "
    "the water is flowing. With these measurements, forecasters can warn people when a flood is likely, "
    "and farmers can plan when to plant their crops and how much water they will need during a dry summer."
)


@pytest.fixture(scope="module")
def smollm2_bf16(smollm2_checkpoint: HFCheckpoint) -> LoadedModel:
    return from_hf(smollm2_checkpoint, torch.bfloat16, torch.device("cpu"))


@pytest.fixture(scope="module")
def hf_bf16(smollm2_checkpoint: HFCheckpoint) -> Any:
    return copy.deepcopy(smollm2_checkpoint.model).to(torch.bfloat16).eval()


def bf16_ulp(x: float) -> float:
    """One unit in the last place of bf16 at magnitude ``|x|``."""
    return 2.0 ** (math.floor(math.log2(max(abs(x), 1e-30))) - 7)


def teacher_forced(loaded: LoadedModel, hf_model: Any) -> tuple[list[int], torch.Tensor]:
    """Our ``NEW_TOKENS`` greedy tokens for a fixed chat prompt, and the ``hf_model`` logits rows predicting them."""
    prompt = ChatFormatter(loaded.tokenizer).first_turn("Explain what a KV cache is in one sentence.")
    llm = LLM(loaded=loaded, device="cpu")
    (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    ours = out.outputs[0].token_ids
    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt + ours])).logits[0].float()
    # Row p predicts token p + 1: generated token i comes from row len(prompt) - 1 + i.
    return ours, logits[len(prompt) - 1 : len(prompt) - 1 + NEW_TOKENS]


def test_bf16_greedy_agrees_with_transformers_bf16_or_ties(
    smollm2_bf16: LoadedModel, hf_bf16: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    ours, rows = teacher_forced(smollm2_bf16, hf_bf16)
    verdicts = []
    for i, (row, token) in enumerate(zip(rows, ours, strict=True)):
        top = int(row.argmax())
        if top == token:
            verdicts.append("=")
            continue
        gap = float(row[top] - row[token])
        limit = TIE_ULPS * bf16_ulp(float(row[top]))
        verdicts.append("t")
        assert gap <= limit, (
            f"position {i}: we chose {token}, transformers bf16 {top}, logit gap {gap:.4f} > bf16 rounding {limit:.4f}"
        )
    with capsys.disabled():
        ties = [i for i, v in enumerate(verdicts) if v == "t"]
        print(f"\nbf16 greedy vs transformers bf16: {verdicts.count('=')}/{NEW_TOKENS} argmax, ties at {ties}")


def perplexity(loaded: LoadedModel, ids: list[int]) -> float:
    """exp(mean next-token cross-entropy) of ``ids`` in one paged prefill (torch reference attention)."""
    model, block_size = loaded.model, 16
    num_blocks = -(-len(ids) // block_size)
    shape = (2, num_blocks, block_size, model.num_kv_heads, model.head_dim)
    kv_caches = [torch.zeros(shape, dtype=loaded.dtype) for _ in range(model.num_layers)]
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [list(range(num_blocks))], block_size)
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), kv_caches, meta, TorchPagedAttention())
        logits = model.compute_logits(hidden[:-1])
        loss = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]))
    return math.exp(float(loss))


def test_bf16_perplexity_within_half_a_percent_of_fp32(
    smollm2: LoadedModel, smollm2_bf16: LoadedModel, capsys: pytest.CaptureFixture[str]
) -> None:
    ids = smollm2.tokenizer.encode(TEXT)
    assert len(ids) > 100
    fp32, bf16 = perplexity(smollm2, ids), perplexity(smollm2_bf16, ids)
    with capsys.disabled():
        print(f"\nperplexity over {len(ids)} tokens: fp32 {fp32:.4f}, bf16 {bf16:.4f} ({bf16 / fp32 - 1:+.3%})")
    assert 1.0 < fp32 < 100.0  # the text is ordinary English: a working model finds it easy
    assert abs(bf16 / fp32 - 1) <= 0.005


def test_bf16_matmuls_run_on_the_ggufs_codes_bitwise(
    smollm2_bf16: LoadedModel, smollm2_checkpoint: HFCheckpoint
) -> None:
    """A bf16 load keeps every projection's Q4_1 codes and the LM head's Q8_0 codes (they round to the loaded bf16
    weights; the loader checks that), and the kernel on them gives the dense bf16 kernel's bits at decode and
    prefill rows. Greedy tokens then match a load without the codes."""
    from streamkv.model.linear import Linear, has_gguf_kernel
    from streamkv.ops.cpu_ops import load_linear_ops

    ops = load_linear_ops()
    if not has_gguf_kernel(ops, torch.bfloat16):
        pytest.skip("the bf16 GGUF kernel needs AVX512-BF16")
    dense = from_hf(smollm2_checkpoint, torch.bfloat16, torch.device("cpu"), gguf_codes=False)
    pairs = [
        (m.small, dense.model.get_submodule(name).small)
        for name, m in smollm2_bf16.model.named_modules()
        if isinstance(m, Linear)
    ]
    assert len(pairs) == 4 * smollm2_bf16.model.config.num_hidden_layers
    pairs.append((smollm2_bf16.model.small_lm_head, dense.model.small_lm_head))
    for ours, reference in pairs:
        assert ours is not None and ours.packed.dtype == torch.uint8
        assert reference is not None and reference.packed.dtype == torch.bfloat16
        for rows in (1, 13, 40, 129):
            x = torch.randn(rows, 2 * reference.packed.shape[1]).bfloat16()
            assert torch.equal(ours(x), reference(x)), rows
    prompts = [ChatFormatter(smollm2_bf16.tokenizer).first_turn(q) for q in ("Name a colour.", "What is 2 + 2?")]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    runs = [LLM(loaded=loaded, device="cpu").generate(prompts, params) for loaded in (smollm2_bf16, dense)]
    assert [o.outputs[0].token_ids for o in runs[0]] == [o.outputs[0].token_ids for o in runs[1]]


def test_bf16_greedy_output_does_not_depend_on_the_batch_or_the_chunk(smollm2_bf16: LoadedModel) -> None:
    """Invariant 3 in bf16 on the real model: 16 prompts decoded together (prefill steps of up to 512 tokens) give
    each prompt's tokens alone, and again with prefill chunks of 48 tokens beside the decode rows. Until round 44 the
    prefill rows past 128 ran on oneDNN in another summation order and 4-9 of 16 prompts decoded differently
    (some from their first token)."""
    rng = random.Random(3)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randrange(20, 45))] for _ in range(16)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    common = {"loaded": smollm2_bf16, "device": "cpu", "enable_prefix_caching": False, "num_blocks": 256}
    llm = LLM(**common)
    alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert sum(len(p) for p in prompts) > 128  # the prefill step is past the old 128-row crossover
    assert together == alone
    chunked = LLM(**common, max_num_batched_tokens=48)
    assert [o.outputs[0].token_ids for o in chunked.generate(prompts, params)] == alone
