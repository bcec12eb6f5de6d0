"""Shared helpers of the throughput benchmarks (``bench_throughput``, ``bench_llamacpp``, ``bench_limit``).

- :func:`machine_banner`: :func:`load_tests.common.print_header` plus the
  library versions, printed first by every script (figures without it are
  useless);
- :func:`load_models`: one transformers load, our prepacked model built from it
  (and, on request, a dense copy and transformers' own model for the peer run);
- workloads: prompts of random token ids from a fixed seed (or real text);
- :func:`run_engine`: drive :class:`streamkv.engine_core.EngineCore` step by step
  with timing per step, so that prefill-included throughput, decode-only
  throughput (steps where every sequence decodes one token) and TTFT all come
  from one run.
"""

from __future__ import annotations

import contextlib
import io
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from load_tests.common import print_header

# Random prompt ids are drawn from [FIRST_PLAIN_TOKEN, vocab): SmolLM2's special
# tokens (<|im_start|>, <|endoftext|>, ...) all sit below 100.
FIRST_PLAIN_TOKEN = 100


# ----------------------------------------------------------------- machine


def machine_banner(threads: int, title: str, module: str) -> dict[str, Any]:
    """Set torch's thread count, print the machine and command; return the machine record (command included)."""
    import transformers

    torch.set_num_threads(threads)
    try:
        import llama_cpp

        llama_cpp_version = llama_cpp.__version__
    except Exception:  # noqa: BLE001 - absent or broken: just not reported
        llama_cpp_version = None
    header = print_header(
        title, module, threads_flag=threads, transformers=transformers.__version__,
        mkldnn=torch.backends.mkldnn.is_available(), llama_cpp_python=llama_cpp_version,
    )  # fmt: skip
    print(flush=True)
    return {**header["machine"], "command": header["command"]}


# ------------------------------------------------------------------- models


@dataclass(slots=True)
class Models:
    """Our engine's model and, on request, the peers built from the same load.

    Attributes:
        loaded: our model, prepacked for oneDNN (what the engine runs).
        dense: our model with dense weights (plain ``F.linear`` path), or None.
        hf_model: transformers' own fp32 model (de-quantized GGUF), or None.
        gguf_path: the GGUF file all of them come from.
        load_s: wall seconds of the whole load.
    """

    loaded: Any
    dense: Any
    hf_model: Any
    gguf_path: str
    load_s: float


def load_models(
    *,
    want_hf: bool = False,
    want_dense: bool = False,
    dtype: torch.dtype = torch.float32,
    quantization: str | None = None,
) -> Models:
    """Load the default GGUF once through transformers and build what is asked for.

    ``dtype`` and ``quantization`` apply to the engine's (prepacked) model;
    the dense one is always float32.
    """
    import transformers

    from streamkv.model.loader import default_model_path, from_hf, load_hf_checkpoint

    transformers.utils.logging.disable_progress_bar()
    t0 = time.perf_counter()
    path = default_model_path()
    captured = io.StringIO()  # transformers' GGUF de-quantization draws a plain tqdm bar on stderr
    with contextlib.redirect_stderr(captured):
        ckpt = load_hf_checkpoint(path, torch.float32)
    for line in captured.getvalue().replace("\r", "\n").splitlines():
        if line.strip() and "%|" not in line:
            print(line, file=sys.stderr)
    loaded = from_hf(ckpt, dtype, torch.device("cpu"), prepack=True, quantization=quantization)
    dense = from_hf(ckpt, torch.float32, torch.device("cpu"), prepack=False) if want_dense else None
    hf_model = ckpt.model if want_hf else None
    del ckpt
    return Models(loaded, dense, hf_model, path, time.perf_counter() - t0)


# ----------------------------------------------------------------- workloads


@dataclass(frozen=True, slots=True)
class Workload:
    """Requests of one benchmark: prompt token ids and exact output lengths.

    Attributes:
        name: ``uniform``, ``mixed`` ...
        prompts: token ids per request.
        output_lens: exact new tokens per request.
        prompt_source: ``random`` (ids from a fixed seed) or ``text``.
        seed: the seed everything was drawn from.
    """

    name: str
    prompts: list[list[int]]
    output_lens: list[int]
    prompt_source: str
    seed: int

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    def describe(self) -> str:
        pl = [len(p) for p in self.prompts]
        return (
            f"{self.name}: {self.num_requests} requests, prompts {min(pl)}-{max(pl)} tokens "
            f"(total {self.num_prompt_tokens}), outputs {min(self.output_lens)}-{max(self.output_lens)} tokens "
            f"(total {self.num_output_tokens}), {self.prompt_source} prompts, seed {self.seed}"
        )


def _text_token_stream(tokenizer: Any) -> list[int]:
    """Real English/Python text: the source of a few standard-library modules, tokenized once."""
    import argparse as _a
    import inspect
    import json as _j
    import logging as _l

    text = "\n".join(inspect.getsource(m) for m in (_a, _l, _j))
    return tokenizer.encode(text)


def make_prompts(
    lengths: Sequence[int], seed: int, vocab_size: int, source: str = "random", tokenizer: Any = None
) -> list[list[int]]:
    """One prompt per length: random ids in ``[FIRST_PLAIN_TOKEN, vocab)``, or slices of real text."""
    gen = torch.Generator().manual_seed(seed)
    if source == "random":
        return [torch.randint(FIRST_PLAIN_TOKEN, vocab_size, (n,), generator=gen).tolist() for n in lengths]
    if source != "text":
        raise ValueError(f"prompt source must be random or text, not {source!r}")
    if tokenizer is None:
        raise ValueError("text prompts need the tokenizer")
    stream = _text_token_stream(tokenizer)
    out = []
    for n in lengths:
        start = int(torch.randint(0, len(stream) - n, (1,), generator=gen))
        out.append(stream[start : start + n])
    return out


def uniform_workload(
    num_requests: int, prompt_len: int, output_len: int, vocab_size: int, seed: int = 0, source: str = "random",
    tokenizer: Any = None,
) -> Workload:  # fmt: skip
    prompts = make_prompts([prompt_len] * num_requests, seed, vocab_size, source, tokenizer)
    return Workload("uniform", prompts, [output_len] * num_requests, source, seed)


def mixed_workload(
    num_requests: int, prompt_range: tuple[int, int], output_range: tuple[int, int], vocab_size: int,
    seed: int = 0, source: str = "random", tokenizer: Any = None,
) -> Workload:  # fmt: skip
    """Lengths uniform over the inclusive ranges, drawn from ``seed`` (prompts from ``seed + 1``)."""
    gen = torch.Generator().manual_seed(seed)
    plens = torch.randint(prompt_range[0], prompt_range[1] + 1, (num_requests,), generator=gen).tolist()
    olens = torch.randint(output_range[0], output_range[1] + 1, (num_requests,), generator=gen).tolist()
    prompts = make_prompts(plens, seed + 1, vocab_size, source, tokenizer)
    return Workload("mixed", prompts, olens, source, seed)


# ------------------------------------------------------------------ engine


def blocks_needed(workload: Workload, block_size: int = 16) -> int:
    """KV blocks that hold every request at once (no preemption in a static run)."""
    return sum(-(-(len(p) + o) // block_size) for p, o in zip(workload.prompts, workload.output_lens, strict=True))


def make_llm(loaded: Any, *, max_num_seqs: int, max_num_batched_tokens: int, num_blocks: int) -> Any:
    """An offline engine over ``loaded``; prefix caching off (repeated runs would hit it)."""
    from streamkv.llm import LLM

    return LLM(
        loaded=loaded,
        device="cpu",
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        num_blocks=num_blocks,
        enable_prefix_caching=False,
    )


@dataclass(slots=True)
class StepRecord:
    """One engine step: wall seconds, tokens it computed, sequences in it, pure decode or not."""

    seconds: float
    num_tokens: int
    num_seqs: int
    pure_decode: bool


@dataclass(slots=True)
class EngineRun:
    """What one timed engine run measured.

    Attributes:
        wall_s: first ``add_request`` to last token.
        output_tokens: tokens generated.
        prompt_tokens: prompt tokens.
        steps: one record per engine step.
        ttft_s: arrival to first token per request.
        token_ids: output ids per request, in workload order.
    """

    wall_s: float
    output_tokens: int
    prompt_tokens: int
    steps: list[StepRecord]
    ttft_s: list[float]
    token_ids: list[list[int]] = field(default_factory=list)

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def decode_steps(self) -> list[StepRecord]:
        return [s for s in self.steps if s.pure_decode]

    @property
    def decode_tok_s(self) -> float:
        """Tokens per second over steps in which every scheduled sequence decoded one token."""
        steps = self.decode_steps
        secs = sum(s.seconds for s in steps)
        return sum(s.num_seqs for s in steps) / secs if secs else float("nan")

    @property
    def decode_tok_s_full_batch(self) -> float:
        """Decode tokens per second over pure-decode steps at the run's largest decode batch."""
        steps = self.decode_steps
        if not steps:
            return float("nan")
        top = max(s.num_seqs for s in steps)
        full = [s for s in steps if s.num_seqs == top]
        return sum(s.num_seqs for s in full) / sum(s.seconds for s in full)


def run_engine(llm: Any, workload: Workload, *, greedy: bool = True) -> EngineRun:
    """Submit every request at once and step the engine to completion, timing each step.

    The runner's ``forward`` is wrapped on this instance (nothing in ``streamkv``
    changes) to see each step's batch shape; the wrapper costs ~1 us per step.
    """
    from streamkv.sampling_params import SamplingParams

    core = llm.core
    runner = core.runner
    shapes: list[tuple[int, int, bool]] = []
    original = runner.forward

    def forward(out: Any) -> Any:
        n = out.num_batched_tokens
        shapes.append((n, len(out.scheduled), n == len(out.scheduled)))
        return original(out)

    outputs: list[list[int]] = [[] for _ in workload.prompts]
    first: list[float | None] = [None] * workload.num_requests

    def sink_for(i: int) -> Callable[[Any], None]:
        def sink(out: Any) -> None:
            for d in out.deltas:
                outputs[i].extend(d.token_ids)
            if first[i] is None and out.ttft_s is not None:
                first[i] = out.ttft_s

        return sink

    runner.forward = forward
    steps: list[StepRecord] = []
    try:
        t0 = time.perf_counter()
        arrival = time.monotonic()
        for i, (prompt, n) in enumerate(zip(workload.prompts, workload.output_lens, strict=True)):
            params = SamplingParams(temperature=0.0 if greedy else 1.0, max_tokens=n, ignore_eos=True)
            core.add_request(f"bench-{id(workload)}-{i}", prompt, params, sink_for(i), arrival_time=arrival)
        while core.has_work():
            ts = time.perf_counter()
            core.step()
            dt = time.perf_counter() - ts
            if shapes:
                n, b, pure = shapes.pop()
                steps.append(StepRecord(dt, n, b, pure))
        wall = time.perf_counter() - t0
    finally:
        del runner.forward  # back to the class's method
    return EngineRun(
        wall_s=wall,
        output_tokens=sum(len(o) for o in outputs),
        prompt_tokens=workload.num_prompt_tokens,
        steps=steps,
        ttft_s=[t if t is not None else float("nan") for t in first],
        token_ids=outputs,
    )


# -------------------------------------------------------------------- misc


def summarize(values: Sequence[float]) -> str:
    """``mean / p50 / max`` of seconds, as milliseconds or seconds."""
    vals = [v for v in values if v == v]
    if not vals:
        return "n/a"
    fmt = (lambda s: f"{s * 1e3:.0f} ms") if max(vals) < 1 else (lambda s: f"{s:.2f} s")
    return f"mean {fmt(statistics.fmean(vals))}, p50 {fmt(statistics.median(vals))}, max {fmt(max(vals))}"


def greedy_agreement(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> tuple[float, float]:
    """(fraction of requests whose outputs match exactly, mean common-prefix fraction).

    fp32 greedy decoding of the same weights diverges only where two logits
    nearly tie, so a low figure means a bug, not noise.
    """
    exact, prefix = 0, 0.0
    for x, y in zip(a, b, strict=True):
        n = min(len(x), len(y))
        k = next((i for i in range(n) if x[i] != y[i]), n)
        exact += k == n
        prefix += k / n if n else 1.0
    return exact / len(a), prefix / len(a)


def goal_line(name: str, value: float, goal: float, unit: str = "x", higher_is_better: bool = True) -> str:
    """``GOAL PASS: name (goal >=2.00x, measured 2.31x, margin +15%)`` (the format of ``load_tests.common.goal``)."""
    ok = value >= goal if higher_is_better else value <= goal
    margin = (value / goal - 1) * 100 if goal else float("nan")
    op = ">=" if higher_is_better else "<="
    return (
        f"GOAL {'PASS' if ok else 'FAIL'}: {name} (goal {op}{goal:.2f}{unit}, measured {value:.2f}{unit}, "
        f"margin {margin:+.0f}%)"
    )
