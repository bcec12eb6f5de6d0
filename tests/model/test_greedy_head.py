"""Greedy tokens of a float32 LM head from its bf16 estimate (``greedy_head.cpp``, ``streamkv/model/greedy_head.py``).

The contract is exactness: every token is ``argmax`` (the first index on ties)
of ``small_linear``'s fp32 logits on the same pack, Q8_0 codes or dense fp32,
at any row count and scale of ``x``, with exact ties, near ties that only the
last bits settle and hundreds of near-equal rows; a row it cannot certify (a
NaN or inf in ``x``) is handed back. Then the engine: greedy decodes with the
greedy head give the tokens of the full head, on the tiny model and on the real
SmolLM2, and steps that need logits (logprobs, sampling) still get them.
"""

from __future__ import annotations

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from streamkv.metrics import EngineMetrics
from streamkv.model.greedy_head import GREEDY_HEAD_MIN_ROWS, GreedyHead
from streamkv.model.linear import SmallMatmul
from streamkv.model.loader import LoadedModel
from streamkv.ops.cpu_ops import load_linear_ops
from streamkv.sampling_params import SamplingParams
from tests.engine_helpers import greedy, make_llm, prompts_of
from tests.test_gguf_codes import random_codes

ops = load_linear_ops()
pytestmark = pytest.mark.skipif(
    ops is None or not ops.small_linear_bf16_supported(), reason="the greedy head needs the bf16 kernel (AVX512-BF16)"
)


def heads(kind: str, weight: torch.Tensor | None = None, n: int = 1000, k: int = 256) -> tuple[SmallMatmul, GreedyHead]:
    """(the fp32 head, its greedy head) on Q8_0 codes or on a dense fp32 ``weight``."""
    codes = random_codes("q8_0", n, k) if kind == "q8_0" else None
    w = codes.dequantize().float() if codes is not None else weight
    assert w is not None
    full = SmallMatmul.pack(ops, w, codes=codes)
    head = GreedyHead.build(ops, w, full, codes)
    assert head is not None
    return full, head


def tokens(head: GreedyHead, x: torch.Tensor) -> list[int]:
    """The op's answer per row, -1 included (``GreedyHead.__call__`` turns any -1 into ``None``)."""
    out = torch.empty(x.shape[0], dtype=torch.long)
    head.candidates += ops.greedy_head(out, x, head.estimate(x.to(torch.bfloat16)), head.exact, head.row_norms)
    return out.tolist()


@pytest.mark.parametrize("kind", ["q8_0", "dense"])
@pytest.mark.parametrize("rows", [1, 3, 16, 33, 128])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 40.0])
def test_tokens_are_the_fp32_heads_argmax(kind: str, rows: int, scale: float) -> None:
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(1000, 256, generator=g) * 0.05 if kind == "dense" else None
    full, head = heads(kind, weight)
    x = torch.randn(rows, 256, generator=g) * scale
    assert tokens(head, x) == full(x).argmax(dim=1).tolist()
    assert head.candidates >= rows  # the estimate's own argmax is always a candidate


def test_exact_ties_keep_the_first_index_and_near_ties_the_true_one() -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(512, 128, generator=g) * 0.05
    w[300] = w[7]  # an exact tie: torch.argmax answers 7
    w[301] = w[9]
    w[301, 5] = torch.nextafter(w[9, 5], torch.tensor(1.0))  # 9 and 301 part in the last bits of one product
    w[400:480] = w[11] + torch.randn(80, 128, generator=g) * 1e-6  # 80 rows within the estimate's error of row 11
    full, head = heads("dense", w)
    x = torch.randn(64, 128, generator=g)
    x[:8] = w[7] * 20  # rows whose maximum is the tied pair
    x[8:16] = w[9] * 20
    x[16:24] = w[11] * 20
    want = full(x).argmax(dim=1).tolist()
    assert tokens(head, x) == want
    assert {want[i] for i in range(8)} == {7}
    assert head.candidates > 64 + 8 * 80  # the near-equal rows were all computed exactly


def test_rows_whose_estimate_ranks_the_right_token_below_another() -> None:
    # 512 rows near one direction, x mostly orthogonal to it: small logits from large sums |x w|, so the bf16
    # estimate's error spans several of its steps and it ranks the fp32 head's token strictly below another's in
    # some rows; the bound must keep the right one in (its estimate alone would not).
    g = torch.Generator().manual_seed(5)
    base = torch.randn(128, generator=g) * 0.05
    w = base + torch.randn(512, 128, generator=g) * 1e-3
    full, head = heads("dense", w)
    unit = base / base.norm()
    x = torch.randn(256, 128, generator=g) * 5
    x = x - (x @ unit)[:, None] * unit + 0.5 * unit
    want = full(x).argmax(dim=1)
    est = head.estimate(x.bfloat16()).float()
    below = int((est.gather(1, want[:, None])[:, 0] < est.max(dim=1).values).sum())
    assert below >= 3, "the case should hold rows whose estimate ranks the right token strictly below another"
    assert tokens(head, x) == want.tolist()


def test_a_row_it_cannot_certify_is_handed_back() -> None:
    full, head = heads("q8_0")
    x = torch.randn(6, 256)
    x[2, 3] = float("nan")
    x[4, 0] = float("inf")
    x[5, 7] = 2.0**16  # finite, but past what the bound's flush-to-zero term covers
    got = tokens(head, x)
    assert got[2] == got[4] == got[5] == -1
    assert [got[i] for i in (0, 1, 3)] == full(x).argmax(dim=1)[[0, 1, 3]].tolist()
    assert head(x) is None
    assert head(x[[0, 1, 3]]) == [got[i] for i in (0, 1, 3)]
    huge = torch.full((64, 256), 2.0**16)
    assert GreedyHead.build(ops, huge, SmallMatmul.pack(ops, huge)) is None  # |W| past the bound's cover


def test_the_op_refuses_a_layout_it_does_not_read() -> None:
    _, head = heads("q8_0")
    x = torch.randn(4, 256)
    approx = head.estimate(x.bfloat16())
    out = torch.empty(4, dtype=torch.long)
    with pytest.raises(RuntimeError, match="Q8_0"):
        ops.greedy_head(out, x, approx, head.exact.view(-1), head.row_norms)
    q4 = SmallMatmul.pack(ops, random_codes("q4_1", 64, 256).dequantize().float(), codes=random_codes("q4_1", 64, 256))
    assert GreedyHead.build(ops, torch.zeros(64, 256), q4) is None  # Q4_1 head: the full head runs


def greedy_runs(
    loaded: LoadedModel, prompts: list[list[int]], params: list[SamplingParams], metrics: EngineMetrics | None = None
) -> list[list[int]]:
    llm = make_llm(loaded, max_num_seqs=64, metrics=metrics)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]


def greedy_head_counters(metrics: EngineMetrics) -> tuple[float, float, float]:
    """(rows, candidates, fallbacks) as /metrics shows them."""
    got = {s.name: s.value for f in text_string_to_metric_families(metrics.render()[0].decode()) for s in f.samples}
    return tuple(got[f"streamkv_greedy_head_{n}_total"] for n in ("rows", "candidates", "fallbacks"))  # type: ignore[return-value]


@pytest.mark.parametrize("which", ["tiny", "smollm2"])
def test_engine_greedy_tokens_do_not_change(which: str, request: pytest.FixtureRequest) -> None:
    loaded = request.getfixturevalue(which)
    model = loaded.model
    head = model.greedy_head
    assert head is not None, "a float32 CPU model on this build gets a greedy head"
    prompts = prompts_of([5, 17, 40, 9, 33, 21], seed=3, vocab=model.config.vocab_size)
    params = [greedy(10) for _ in prompts]
    try:
        model.greedy_head = None
        want = greedy_runs(loaded, prompts, params)
        model.greedy_head = head
        before = head.candidates
        metrics = EngineMetrics()
        assert greedy_runs(loaded, prompts, params, metrics) == want
        assert head.candidates - before >= len(prompts) * 8  # decode steps of >= GREEDY_HEAD_MIN_ROWS rows ran on it
        assert len(prompts) >= GREEDY_HEAD_MIN_ROWS
        # /metrics counts its rows (decode steps of the 6 rows; the prefill steps' rows may or may not batch) and the
        # exact logits it computed, and no fallback
        rows, candidates, fallbacks = greedy_head_counters(metrics)
        assert len(prompts) * 8 <= rows <= len(prompts) * 10 and candidates == head.candidates - before
        assert fallbacks == 0
        # A step with a row that reads the logits (logprobs) or samples takes the full head, the tokens unchanged.
        mixed = [*params[:-2], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2),
                 SamplingParams(temperature=0.8, max_tokens=10, ignore_eos=True, seed=1)]  # fmt: skip
        before = head.candidates
        metrics = EngineMetrics()
        got = greedy_runs(loaded, prompts, mixed, metrics)
        assert got[:-1] == want[:-1]
        assert head.candidates == before
        assert greedy_head_counters(metrics) == (0, 0, 0)
    finally:
        model.greedy_head = head


def test_a_step_handed_back_takes_the_full_head_and_counts_a_fallback(tiny: LoadedModel) -> None:
    model = tiny.model
    head = model.greedy_head
    assert head is not None
    prompts = prompts_of([6, 11, 30], seed=5, vocab=model.config.vocab_size)
    params = [greedy(6) for _ in prompts]

    class Declines:  # a head whose every row is one it cannot certify (a non-finite value)
        candidates = 0

        def takes(self, rows: int) -> bool:
            return head.takes(rows)

        def __call__(self, hidden: torch.Tensor) -> None:
            return None

    try:
        want = greedy_runs(tiny, prompts, params)
        model.greedy_head = Declines()  # type: ignore[assignment]
        metrics = EngineMetrics()
        assert greedy_runs(tiny, prompts, params, metrics) == want
        rows, candidates, fallbacks = greedy_head_counters(metrics)
        assert rows == candidates == 0 and fallbacks >= 5  # the decode steps of 3 rows, at least
    finally:
        model.greedy_head = head
