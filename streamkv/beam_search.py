"""Beam search inside the engine: every live beam is a sequence, and beams share blocks.

Why here and not vLLM's way. vLLM's ``LLM.beam_search`` drives its engine
from outside: every token step it submits each beam as a fresh one-token
request (``logprobs=2k``) and relies on the prefix cache to find the beam's
KV again. That costs a round trip, a prefix-cache lookup and a re-hash per
beam per token, recomputes each beam's partial last block every step (only
full blocks are cached), and without prefix caching recomputes everything.
Here a beam is a :class:`~streamkv.sched.request.Sequence` that stays in the
running set, so a step computes exactly one token per beam:

- a survivor extends its parent: the parent's best survivor reuses the
  parent's sequence, the others are ``Scheduler.fork`` children sharing all
  its blocks; the first write into the shared partial block copies it
  (copy-on-write), full blocks stay shared for good;
- a pruned beam is finished at once, so its references drop in the step that
  prunes it (blocks no other beam holds are free for the next step);
- finished hypotheses are token lists and hold no blocks.

The price is two small hooks in the engine step (:meth:`BeamSearch.take` for
the sampled rows, :meth:`BeamSearch.abort`) and one scheduler rule: a running
sequence with nothing to compute is skipped. Beams advance in lock-step: a
beam that has sampled keeps its log-probability row and waits (computed up to
its last token, skipped by the scheduler) until every live beam of its request
has sampled; the token budget, ``max_num_seqs`` or a preemption may split a
request's beams over several steps. A waiting beam preempted by recompute is
recomputed, and its forks then recompute too.

The search is transformers' ``GenerationMixin._beam_search`` (the 4.50+
rewrite: ``_get_top_k_continuations``, ``_update_finished_beams``,
``_check_early_stop_heuristic``) for one prompt, in float32 like it, so the
hypotheses equal ``generate(num_beams=k, do_sample=False, length_penalty=...,
early_stopping=...)``'s. Per step, with ``k`` beams and stop ids ``S``:

1. each live beam ``b`` (cumulative log-probability ``s_b``) has the
   ``log_softmax`` of its logits ``r_b`` (stop ids at ``-inf`` before
   ``min_tokens``); the candidates ``(b, t)`` score ``s_b + r_b[t]``, and the
   best ``K = max(2, 1 + |S|) * k`` are kept, best first;
2. a candidate *stops* when ``t`` is in ``S`` or it reaches ``max_tokens``;
3. the next live beams are the ``k`` best candidates that do not stop;
4. a stopping candidate among the first ``k`` becomes a finished hypothesis
   scored ``s / L ** length_penalty`` (``L``: its new tokens, ``t``
   included); the finished set keeps the ``k`` best (with
   ``early_stopping=True`` a full set takes no more);
5. the search ends when every candidate stops, when the set is full and
   ``early_stopping`` is ``True``, or when the set is full and the best live
   beam scored at length ``L`` (``"never"`` with ``length_penalty > 0``:
   at ``max_tokens``) does not beat the worst finished hypothesis.

The request's output is the ``n`` best hypotheses, sent once at the end (a
beam's text is not final until the search ends). Its session keeps the live
beam sharing the longest prefix with the best hypothesis.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerBase

from streamkv.detokenizer import IncrementalDetokenizer
from streamkv.output_processor import OutputProcessor
from streamkv.outputs import CompletionDelta, FinishReason
from streamkv.sched.output import ScheduledSeq
from streamkv.sched.request import Request, SeqStatus, Sequence
from streamkv.sched.scheduler import Scheduler

_NEG = -1.0e9  # transformers' "never chosen" score


@dataclass(slots=True)
class Hypothesis:
    """A finished (or, on cancel, the best unfinished) beam.

    Attributes:
        token_ids: new tokens (the prompt excluded), a final stop id included.
        score: ``cum_logprob / len(token_ids) ** length_penalty`` (float32 value).
        cum_logprob: sum of the tokens' log-probabilities (natural log).
        finish_reason: ``stop`` (a stop id), ``length`` or ``cancelled``.
    """

    token_ids: list[int]
    score: float
    cum_logprob: float
    finish_reason: FinishReason


@dataclass(slots=True, eq=False)
class Beam:
    """A live beam: its sequence, cumulative log-probability and, once sampled, its row."""

    seq: Sequence
    cum_logprob: float
    row: torch.Tensor | None = None  # float32 [vocab] log-probabilities of its next token


@dataclass(slots=True, eq=False)
class BeamGroup:
    """One request's search: its live beams (best first) and finished hypotheses (best first)."""

    request: Request
    beams: list[Beam]
    finished: list[Hypothesis] = field(default_factory=list)

    @property
    def width(self) -> int:
        width = self.request.params.beam_width
        assert width is not None
        return width

    @property
    def full(self) -> bool:
        return len(self.finished) >= self.width


class BeamSearch:
    """The beam-search requests in flight and their step (engine thread only).

    Args:
        scheduler: forks survivors, finishes pruned beams.
        outputs: emits each request's final output.
        tokenizer: detokenizes the hypotheses.
        eos_token_ids: the model's EOS ids (stop ids unless ``ignore_eos``).
        seq_ids: the engine's sequence id counter (forks take ids from it).
    """

    def __init__(
        self,
        scheduler: Scheduler,
        outputs: OutputProcessor,
        tokenizer: PreTrainedTokenizerBase,
        eos_token_ids: frozenset[int],
        seq_ids: Iterator[int],
    ) -> None:
        self.scheduler = scheduler
        self.outputs = outputs
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self._seq_ids = seq_ids
        self.groups: dict[str, BeamGroup] = {}
        self._by_seq: dict[int, BeamGroup] = {}

    def add(self, req: Request) -> None:
        """Track a beam-search request whose sequence 0 is queued."""
        group = BeamGroup(req, [Beam(req.seqs[0], 0.0)])
        self.groups[req.request_id] = group
        self._by_seq[req.seqs[0].seq_id] = group

    def take(self, sampling: list[ScheduledSeq], logits: torch.Tensor, now: float) -> list[tuple[int, ScheduledSeq]]:
        """Consume this step's beam rows; return the other ``(logits row, entry)`` pairs to sample.

        Args:
            sampling: the entries that sample, row ``i`` of ``logits`` being entry ``i``'s.
            logits: float32 or bfloat16 ``[len(sampling), vocab]`` (widened for the log-softmax).
            now: monotonic seconds (the final output's time).
        """
        rest: list[tuple[int, ScheduledSeq]] = []
        touched: dict[str, BeamGroup] = {}
        for row, s in enumerate(sampling):
            group = self._by_seq.get(s.seq.seq_id)
            if group is None:
                rest.append((row, s))
                continue
            beam = next(b for b in group.beams if b.seq is s.seq)
            beam.row = self._log_probs(logits[row], s.seq)
            touched[group.request.request_id] = group
        for group in touched.values():
            if all(b.row is not None for b in group.beams):
                self._step(group, now)
        return rest

    def abort(self, request_id: str, now: float | None = None) -> bool:
        """Cancel a beam-search request: the best hypotheses so far, as ``cancelled``; ``False`` if unknown."""
        group = self.groups.get(request_id)
        if group is None:
            return False
        live = [self._unfinished(group, b) for b in group.beams if b.seq.num_output_tokens]
        best = sorted(group.finished + live, key=lambda h: h.score, reverse=True)
        hyps = [Hypothesis(h.token_ids, h.score, h.cum_logprob, FinishReason.CANCELLED) for h in best]
        self._end(group, hyps, SeqStatus.FINISHED_ABORTED, now)
        return True

    # ------------------------------------------------------------ the step

    def _log_probs(self, logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
        row = torch.log_softmax(logits.float(), dim=-1).cpu()
        p = seq.request.params
        if seq.num_output_tokens < p.min_tokens:  # transformers masks the log-probs, after the softmax
            row[list(self._stop_ids(seq.request))] = float("-inf")
        return row

    def _stop_ids(self, req: Request) -> set[int]:
        p = req.params
        return set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))

    def _step(self, group: BeamGroup, now: float) -> None:
        req, k = group.request, group.width
        p = req.params
        stop_ids = self._stop_ids(req)
        rows = torch.stack([b.row for b in group.beams if b.row is not None])  # [beams, vocab]
        cum = torch.tensor([b.cum_logprob for b in group.beams], dtype=torch.float32)
        scores = (rows + cum[:, None]).flatten()
        num_keep = min(max(2, 1 + len(stop_ids)) * k, scores.numel())
        top, idx = torch.topk(scores, num_keep)
        vocab = rows.shape[1]
        num_out = group.beams[0].seq.num_output_tokens + 1  # every beam has as many new tokens
        at_length = num_out >= req.max_tokens
        cands = [(int(i) // vocab, int(i) % vocab) for i in idx.tolist()]
        stops = [at_length or t in stop_ids for _, t in cands]
        self.outputs.record_generated(len(group.beams), now)

        # 4: stopping candidates among the first k join the finished set (transformers' float32 arithmetic)
        penalized = (top / (num_out**p.length_penalty)).tolist()
        if not (group.full and p.early_stopping is True):
            for j in range(min(k, num_keep)):
                if stops[j]:
                    b, t = cands[j]
                    seq = group.beams[b].seq
                    reason = FinishReason.STOP if t in stop_ids else FinishReason.LENGTH
                    tokens = seq.token_ids[seq.num_prompt_tokens :] + [t]
                    group.finished.append(Hypothesis(tokens, penalized[j], float(top[j]), reason))
            group.finished.sort(key=lambda h: h.score, reverse=True)
            del group.finished[k:]

        # 3: the k best candidates that do not stop
        survivors = [(j, *cands[j]) for j in range(num_keep) if not stops[j]][:k]
        if self._done(group, survivors, top, num_out):
            self._end(group, group.finished[: p.n], SeqStatus.FINISHED_STOPPED, now)
            return
        self._advance(group, survivors, top)

    def _done(self, group: BeamGroup, survivors: list[tuple[int, int, int]], top: torch.Tensor, num_out: int) -> bool:
        """Step 5: no candidate continues, or the finished set is full and cannot improve."""
        p = group.request.params
        if not survivors:
            return True
        if not group.full:
            return False
        if p.early_stopping is True:
            return True
        length = group.request.max_tokens if p.early_stopping == "never" and p.length_penalty > 0 else num_out
        best_possible = float(top[survivors[0][0]].reshape(1) / (length**p.length_penalty))
        return not best_possible > group.finished[-1].score

    def _advance(self, group: BeamGroup, survivors: list[tuple[int, int, int]], top: torch.Tensor) -> None:
        """Extend the survivors' parents (forking for the 2nd survivor on), finish the pruned beams."""
        parents = group.beams
        by_parent: dict[int, list[int]] = {}
        for rank, (_, b, _) in enumerate(survivors):
            by_parent.setdefault(b, []).append(rank)
        new_beams: list[Beam | None] = [None] * len(survivors)
        for b, ranks in by_parent.items():
            parent = parents[b].seq
            children = self.scheduler.fork(parent, itertools.islice(self._seq_ids, len(ranks) - 1))
            for seq, rank in zip([parent, *children], ranks, strict=True):
                j, _, t = survivors[rank]
                seq.token_ids.append(t)
                new_beams[rank] = Beam(seq, float(top[j]))
                self._by_seq[seq.seq_id] = group
        for b, beam in enumerate(parents):
            if b not in by_parent:
                self._finish_seq(beam.seq, SeqStatus.FINISHED_ABORTED, pin=False)
        group.beams = [b for b in new_beams if b is not None]

    # ------------------------------------------------------------- the end

    def _unfinished(self, group: BeamGroup, beam: Beam) -> Hypothesis:
        tokens = beam.seq.token_ids[beam.seq.num_prompt_tokens :]
        lp = group.request.params.length_penalty
        score = float(torch.tensor([beam.cum_logprob], dtype=torch.float32) / (len(tokens) ** lp))
        return Hypothesis(tokens, score, beam.cum_logprob, FinishReason.CANCELLED)

    def _end(self, group: BeamGroup, hyps: list[Hypothesis], status: SeqStatus, now: float | None) -> None:
        """Finish every live beam (the session keeps the one closest to the best), emit the hypotheses."""
        req = group.request
        keep = self._session_beam(group, hyps[0] if hyps else None)
        for beam in group.beams:
            self._finish_seq(beam.seq, status, pin=beam is keep)
        del self.groups[req.request_id]
        deltas = [self._delta(req, i, h) for i, h in enumerate(hyps[: req.params.n])]
        deltas += [CompletionDelta(i, [], "", FinishReason.CANCELLED) for i in range(len(deltas), req.params.n)]
        self.outputs.emit_final(req, deltas, time.monotonic() if now is None else now)

    def _session_beam(self, group: BeamGroup, best: Hypothesis | None) -> Beam | None:
        if group.request.session_id is None or best is None or not group.beams:
            return None
        want = group.request.prompt_token_ids + best.token_ids
        return max(group.beams, key=lambda b: _common_prefix(b.seq.token_ids[: b.seq.num_computed_tokens], want))

    def _finish_seq(self, seq: Sequence, status: SeqStatus, pin: bool) -> None:
        self._by_seq.pop(seq.seq_id, None)
        self.scheduler.finish(seq, status, pin=pin)

    def _delta(self, req: Request, index: int, hyp: Hypothesis) -> CompletionDelta:
        ends_on_stop = hyp.finish_reason is FinishReason.STOP or (
            bool(hyp.token_ids) and hyp.token_ids[-1] in self._stop_ids(req)
        )
        body = hyp.token_ids[:-1] if ends_on_stop else hyp.token_ids
        detok = IncrementalDetokenizer(self.tokenizer, (), req.prompt_token_ids)
        text, ids = "", list[int]()
        for t in body:
            out = detok.add_token(t)
            text, ids = text + out.text, ids + out.token_ids
        rest = detok.flush()
        text, ids = text + rest.text, ids + rest.token_ids + hyp.token_ids[len(body) :]
        return CompletionDelta(index, ids, text, hyp.finish_reason, score=hyp.score)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
