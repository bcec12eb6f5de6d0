"""The output side of a step: append sampled tokens, check stops, detokenize, emit.

vLLM v1 splits the same way (``OutputProcessor`` plus ``check_stop``): the
engine core schedules, runs and samples; this module turns each sampled
token into client-facing output. It owns everything per request that the
scheduler need not know: the sink, one incremental detokenizer and one
``torch.Generator`` per sample, first/last token times, usage and the
finished-request counters. Engine thread only.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerBase

from streamkv.detokenizer import IncrementalDetokenizer
from streamkv.errors import EngineError
from streamkv.metrics_hooks import MetricsHooks
from streamkv.outputs import (
    CompletionDelta,
    FinishReason,
    RequestOutput,
    RequestSink,
    TokenLogprob,
    Usage,
)
from streamkv.sched.request import Request, SeqStatus, Sequence

FinishFn = Callable[[Sequence, SeqStatus], None]


@dataclass(slots=True)
class SampleState:
    """Output-side state of one sample (one :class:`Sequence`)."""

    detokenizer: IncrementalDetokenizer
    generator: torch.Generator
    # logprobs of sampled tokens whose ids the detokenizer still holds back (they travel together)
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def take_logprobs(self, n: int | None) -> list[TokenLogprob] | None:
        """The oldest ``n`` held logprobs (all with ``None``); ``None`` when there are none."""
        taken = self.logprobs[:n] if n is not None else self.logprobs[:]
        del self.logprobs[: len(taken)]
        return taken or None


@dataclass(slots=True)
class RequestState:
    """Output-side state of one request: where its outputs go and its samples' state by index."""

    request: Request
    sink: RequestSink
    samples: list[SampleState] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class OutputStats:
    """What the output processor reports each step (immutable; safe to read from any thread).

    Attributes:
        prompt_tokens: prompt tokens of finished requests (monotonic).
        generation_tokens: sampled tokens (monotonic).
        finished: finished samples by reason (monotonic).
        generation_history: recent ``(monotonic time s, generation_tokens)`` points, oldest first.
    """

    prompt_tokens: int
    generation_tokens: int
    finished: dict[FinishReason, int]
    generation_history: tuple[tuple[float, int], ...]

    def tokens_per_s(self, window_s: float = 5.0, now: float | None = None) -> float:
        """Generation tokens per second over the last ``window_s`` seconds (0 when idle)."""
        now = time.monotonic() if now is None else now
        recent = [h for h in self.generation_history if now - h[0] <= window_s]
        if len(recent) < 2:
            return 0.0
        (t0, n0), (t1, n1) = recent[0], recent[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0


class OutputProcessor:
    """Turns sampled tokens into :class:`RequestOutput` objects for each request's sink.

    Args:
        tokenizer: for the incremental detokenizers.
        eos_token_ids: token ids that end a sample unless ``ignore_eos``.
        max_model_len: a sample ends with ``length`` when it reaches this many tokens.
        finish: ends a sequence in the scheduler (frees or pins its blocks).
        metrics: optional observer of TTFT, ITL and finished requests.
        seed: seed of the generator unseeded requests draw their seeds from;
            ``None`` seeds it from OS entropy.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        eos_token_ids: frozenset[int],
        max_model_len: int,
        finish: FinishFn,
        metrics: MetricsHooks | None = None,
        seed: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.metrics = metrics
        self._finish = finish
        self.requests: dict[str, RequestState] = {}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: dict[FinishReason, int] = dict.fromkeys(FinishReason, 0)
        self._history: deque[tuple[float, int]] = deque(maxlen=64)
        self._rng = torch.Generator()
        if seed is None:
            self._rng.seed()
        else:
            self._rng.manual_seed(seed)

    # ------------------------------------------------------------ requests

    def add_request(self, req: Request, sink: RequestSink) -> None:
        """Track a new request; state for each of its sequences is added with :meth:`add_sequence`."""
        self.requests[req.request_id] = RequestState(req, sink)

    def add_sequence(self, seq: Sequence) -> None:
        """Give a new sample its detokenizer and generator (seeded from ``params.seed`` and the index)."""
        req = seq.request
        state = self.requests[req.request_id]
        assert seq.index == len(state.samples), "samples are added in index order"
        p = req.params
        gen = torch.Generator()
        if p.seed is not None:
            gen.manual_seed((p.seed * 1_000_003 + seq.index) % (2**63))
        else:
            gen.manual_seed(int(torch.randint(0, 2**62, (1,), generator=self._rng)))
        detok = IncrementalDetokenizer(self.tokenizer, p.stop, req.prompt_token_ids)
        state.samples.append(SampleState(detok, gen))

    def generators(self, seqs: Seq[Sequence]) -> list[torch.Generator | None]:
        """The sampling generator of each sequence, in order."""
        return [self.requests[s.request.request_id].samples[s.index].generator for s in seqs]

    # ---------------------------------------------------------------- step

    def process(
        self,
        seqs: Seq[Sequence],
        tokens: Seq[int],
        now: float,
        logprobs: Seq[list[TokenLogprob] | None] | None = None,
    ) -> None:
        """Append ``tokens[i]`` to ``seqs[i]``, end samples that stop, emit one output per request.

        ``logprobs[i]``, when given, rides on ``seqs[i]``'s delta (``None`` for rows that did not ask),
        held back with its token id while the detokenizer holds that id back: a delta's
        ``token_ids``, ``text`` and ``logprobs`` always describe the same tokens.
        """
        deltas: dict[str, list[CompletionDelta]] = {}
        for i, (seq, token) in enumerate(zip(seqs, tokens, strict=True)):
            delta = self._append_token(seq, token, now)
            if logprobs is not None and logprobs[i] is not None:
                sample = self.requests[seq.request.request_id].samples[seq.index]
                sample.logprobs.extend(logprobs[i] or ())
                delta.logprobs = sample.take_logprobs(len(delta.token_ids))
            deltas.setdefault(seq.request.request_id, []).append(delta)
        self.record_generated(len(seqs), now)
        for rid, ds in deltas.items():
            self._emit(self.requests[rid], ds)

    def record_generated(self, num_tokens: int, now: float) -> None:
        """Count ``num_tokens`` sampled tokens (throughput and the generation counter)."""
        self.generation_tokens += num_tokens
        self._history.append((now, self.generation_tokens))

    def emit_final(self, req: Request, deltas: list[CompletionDelta], now: float) -> None:
        """Finish ``req`` with deltas built elsewhere (beam search sends its hypotheses once, at the end).

        Every sequence of ``req`` must be finished already. Usage counts the
        deltas' tokens, the finished counters one sample per delta, and the
        first token is this output (TTFT = e2e).
        """
        state = self.requests.pop(req.request_id)
        elapsed = now - req.arrival_time
        completion = sum(len(d.token_ids) for d in deltas)
        usage = Usage(len(req.prompt_token_ids), req.num_cached_tokens, completion)
        out = RequestOutput(req.request_id, deltas, True, usage, elapsed, elapsed, req.num_cached_tokens)
        for d in deltas:
            assert d.finish_reason is not None
            self.finished[d.finish_reason] += 1
        self.prompt_tokens += len(req.prompt_token_ids)
        if self.metrics is not None:
            self.metrics.observe_first_token(elapsed)
            reason0 = deltas[0].finish_reason if deltas else FinishReason.CANCELLED
            assert reason0 is not None
            self.metrics.observe_finished(elapsed, len(req.prompt_token_ids), completion, reason0)
        state.sink(out)

    def abort(self, request_id: str) -> bool:
        """End every unfinished sample of a request as ``cancelled`` and emit the final output."""
        state = self.requests.get(request_id)
        if state is None:
            return False
        deltas = []
        for seq in state.request.seqs:
            if not seq.status.finished:
                self._finish(seq, SeqStatus.FINISHED_ABORTED)
                sample = state.samples[seq.index]
                rest = sample.detokenizer.flush()
                held = sample.take_logprobs(None)
                deltas.append(CompletionDelta(seq.index, rest.token_ids, rest.text, FinishReason.CANCELLED, held))
        self._emit(state, deltas)
        return True

    def fail_all(self, error: EngineError) -> None:
        """Send ``error`` to the sink of every request in flight (the engine thread is dying)."""
        for state in list(self.requests.values()):
            state.sink(error)

    def stats(self) -> OutputStats:
        return OutputStats(self.prompt_tokens, self.generation_tokens, dict(self.finished), tuple(self._history))

    # ----------------------------------------------------------- internals

    def _append_token(self, seq: Sequence, token: int, now: float) -> CompletionDelta:
        """vLLM's ``check_stop``: EOS or a stop id, then a stop string, then the length limits."""
        req = seq.request
        detok = self.requests[req.request_id].samples[seq.index].detokenizer
        seq.token_ids.append(token)
        if seq.first_token_time is None:
            seq.first_token_time = now
            if self.metrics is not None and seq.index == 0:
                self.metrics.observe_first_token(now - req.arrival_time)
        elif self.metrics is not None and seq.last_token_time is not None:
            self.metrics.observe_inter_token(now - seq.last_token_time)
        seq.last_token_time = now
        p = req.params
        status = None
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            status = SeqStatus.FINISHED_STOPPED
            out = detok.flush()
            out.token_ids.append(token)  # never fed to the detokenizer; EOS and stop ids decode to no text
        else:
            out = detok.add_token(token)
            if out.stopped:
                status = SeqStatus.FINISHED_STOPPED
            elif seq.num_output_tokens >= req.max_tokens or seq.num_tokens >= self.max_model_len:
                status = SeqStatus.FINISHED_LENGTH
                rest = detok.flush()
                out.text += rest.text
                out.token_ids += rest.token_ids
        if status is None:
            return CompletionDelta(seq.index, out.token_ids, out.text)
        self._finish(seq, status)
        return CompletionDelta(seq.index, out.token_ids, out.text, status.finish_reason)

    def _emit(self, state: RequestState, deltas: list[CompletionDelta]) -> None:
        req = state.request
        finished = req.finished
        out = RequestOutput(req.request_id, deltas, finished, num_cached_tokens=req.num_cached_tokens)
        first = req.seqs[0].first_token_time
        if first is not None:
            out.ttft_s = first - req.arrival_time
        if finished:
            completion = sum(s.num_output_tokens for s in req.seqs)
            out.usage = Usage(len(req.prompt_token_ids), req.num_cached_tokens, completion)
            out.e2e_s = time.monotonic() - req.arrival_time
            del self.requests[req.request_id]
            for seq in req.seqs:
                reason = seq.status.finish_reason
                assert reason is not None
                self.finished[reason] += 1
            self.prompt_tokens += len(req.prompt_token_ids)
            if self.metrics is not None:
                reason0 = req.seqs[0].status.finish_reason
                assert reason0 is not None
                self.metrics.observe_finished(out.e2e_s, len(req.prompt_token_ids), completion, reason0)
        state.sink(out)
