"""The engine core: one step = schedule, run the model, sample, hand tokens to the output processor.

Single owner: only the thread that calls :meth:`EngineCore.step` (and the
other mutating methods) touches scheduler and cache state. The async front
end (:mod:`streamkv.engine`) talks to it through a command queue; other
threads read only :attr:`EngineCore.stats`, the record published after
every step and command.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any

import torch

from streamkv.beam_search import BeamSearch
from streamkv.cache.disk_tier import DiskTier, kv_fingerprint
from streamkv.cache.kv_cache_manager import KVCacheManager, cdiv
from streamkv.cache.offload import SessionOffload
from streamkv.config import EngineConfig
from streamkv.errors import EngineError, ErrorCode
from streamkv.metrics_hooks import MetricsHooks
from streamkv.model.loader import LoadedModel, default_model_path, load_model
from streamkv.ops.host_malloc import retain_freed_memory
from streamkv.output_processor import OutputProcessor
from streamkv.outputs import RequestSink, TokenLogprob
from streamkv.runner import (
    ModelRunner,
    kv_bytes_per_block,
    make_backend,
    profile_kv_budget,
    resolve_device,
)
from streamkv.sampling import apply_min_tokens, compute_logprobs, sample_batch
from streamkv.sampling_params import SamplingParams
from streamkv.sched.output import ScheduledSeq, SchedulerOutput
from streamkv.sched.request import Request, SeqStatus, Sequence
from streamkv.sched.scheduler import Scheduler
from streamkv.stats import EngineStats, snapshot_json
from streamkv.thread_governor import ThreadGovernor
from streamkv.watchdog import Watchdog

logger = logging.getLogger(__name__)


class EngineCore:
    """Continuous batching over a paged KV pool.

    Args:
        config: the engine configuration.
        metrics: optional observer of steps, tokens and finished requests.
        loaded: an already loaded model (tests share one); loaded from
            ``config.model`` when omitted.
    """

    def __init__(self, config: EngineConfig, metrics: MetricsHooks | None = None, loaded: LoadedModel | None = None):
        self.config = config
        self.metrics = metrics
        self.device = resolve_device(config.model.device)
        if self.device.type == "cpu":
            retain_freed_memory()  # a step's activations reuse the last step's pages instead of faulting in new ones
        self.loaded = loaded if loaded is not None else load_model(config.model, self.device)
        self.tokenizer = self.loaded.tokenizer
        self.eos_token_ids = frozenset(self.loaded.eos_token_ids)
        cc, sc = config.cache, config.scheduler
        self.block_size = cc.block_size
        block_bytes = kv_bytes_per_block(self.loaded, cc.block_size, cc.kv_cache_dtype)
        self.num_blocks = cc.num_blocks or self._blocks_for_budget(block_bytes)
        num_host_blocks = cc.swap_space // block_bytes
        if not cc.session_offload:  # preempted sequences alone never need more than the pool
            num_host_blocks = min(num_host_blocks, self.num_blocks)
        pool_tokens = self.num_blocks * cc.block_size
        self.max_model_len = sc.max_model_len or min(self.loaded.max_model_len, pool_tokens)
        if self.max_model_len > self.loaded.max_model_len:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's context ({self.loaded.max_model_len})"
            )
        self.kv = KVCacheManager(
            num_blocks=self.num_blocks,
            block_size=cc.block_size,
            enable_prefix_caching=cc.enable_prefix_caching,
            extra_key=self.loaded.name.encode(),
            max_pinned_blocks=int(cc.max_pinned_fraction * self.num_blocks),
            num_host_blocks=num_host_blocks,
            offload_sessions=cc.session_offload,
            spill_to_disk=cc.session_offload and cc.kv_offload_dir is not None,
        )
        self.scheduler = Scheduler(sc, self.kv)
        self.backend = make_backend(config.model.attention_backend, self.device)
        self.runner = ModelRunner(
            self.loaded, self.backend, self.num_blocks, cc.block_size, num_host_blocks, self.device, cc.kv_cache_dtype
        )
        self.offload = SessionOffload(self.kv, self.runner, self._disk_tier(), block_bytes)
        self.outputs = OutputProcessor(
            self.tokenizer, self.eos_token_ids, self.max_model_len, self.scheduler.finish, metrics, config.model.seed
        )
        self.num_steps = 0
        self._closed = False
        self.watchdog = Watchdog()
        self._seq_ids = itertools.count()
        self.beams = BeamSearch(self.scheduler, self.outputs, self.tokenizer, self.eos_token_ids, self._seq_ids)
        self._order = itertools.count()
        self.stats = self._build_stats()
        logger.info(
            "KV pool: %d blocks x %d tokens = %d tokens (%.1f MiB, %s, %d B/token), host swap %d blocks; "
            "max_model_len %d; attention backend %s on %s",
            self.num_blocks, cc.block_size, pool_tokens, self.num_blocks * block_bytes / 2**20,
            self.runner.kv_format.name, block_bytes // cc.block_size, num_host_blocks, self.max_model_len,
            self.backend.name, self.device,
        )  # fmt: skip

    def _disk_tier(self) -> DiskTier | None:
        cc = self.config.cache
        if cc.kv_offload_dir is None:
            return None
        m, kv0 = self.loaded.model, self.runner.kv_caches[0]
        path = self.config.model.model or default_model_path()
        kv_shape = [kv0.shape[0], *kv0.shape[2:]]
        fingerprint = kv_fingerprint(m, path, self.loaded.dtype, kv0.dtype, cc.block_size, kv_shape)
        return DiskTier(cc.kv_offload_dir, cc.kv_offload_disk_space, fingerprint)

    def _blocks_for_budget(self, block_bytes: int) -> int:
        cc, sc = self.config.cache, self.config.scheduler
        budget = cc.kv_cache_memory
        if self.device.type == "cuda" and cc.gpu_memory_utilization is not None:
            budget = profile_kv_budget(
                self.loaded, self.device, cc.gpu_memory_utilization,
                sc.max_num_batched_tokens, sc.max_num_seqs, cc.block_size, cc.kv_cache_dtype,
            )  # fmt: skip
        num = budget // block_bytes
        if num < 1:
            raise ValueError(f"KV budget of {budget} bytes holds no block of {block_bytes} bytes")
        return int(num)

    # --------------------------------------------------------------- requests

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Admission check; returns the effective ``max_tokens``.

        Raises:
            EngineError: ``empty_prompt``, ``invalid_params`` (a token id out of
                the vocabulary), ``prompt_too_long`` (prompt + max_tokens over
                max_model_len) or ``exceeds_pool`` (could never fit the KV pool).
        """
        n = len(prompt_token_ids)
        if n == 0:
            raise EngineError(ErrorCode.EMPTY_PROMPT, "the prompt has no tokens")
        vocab = self.loaded.hf_config.vocab_size
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in prompt_token_ids):
            raise EngineError(ErrorCode.INVALID_PARAMS, f"prompt token ids must be integers in [0, {vocab})")
        if n >= self.max_model_len:
            raise EngineError(
                ErrorCode.PROMPT_TOO_LONG,
                f"prompt of {n} tokens leaves no room to generate under max_model_len {self.max_model_len}",
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n
        if n + max_tokens > self.max_model_len:
            raise EngineError(
                ErrorCode.PROMPT_TOO_LONG,
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) exceeds max_model_len {self.max_model_len}",
            )
        if cdiv(n + max_tokens, self.block_size) > self.num_blocks:
            raise EngineError(
                ErrorCode.EXCEEDS_POOL,
                f"{n + max_tokens} tokens need more than the pool's {self.num_blocks} blocks of {self.block_size}",
            )
        width = params.beam_width  # every beam may come to hold all its blocks alone (after preemptions)
        if width is not None and width * cdiv(n + max_tokens, self.block_size) > self.num_blocks:
            raise EngineError(
                ErrorCode.EXCEEDS_POOL,
                f"beam_width {width} x {n + max_tokens} tokens may need more than the pool's "
                f"{self.num_blocks} blocks of {self.block_size}",
            )
        return max_tokens

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        sink: RequestSink,
        session_id: str | None = None,
        arrival_time: float | None = None,
    ) -> Request:
        """Validate and queue a request (see :meth:`validate` for errors); outputs go to ``sink``."""
        if request_id in self.outputs.requests:
            raise EngineError(ErrorCode.INVALID_PARAMS, f"request id {request_id!r} is already in flight")
        max_tokens = self.validate(prompt_token_ids, params)
        req = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            max_tokens=max_tokens,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            order=next(self._order),
            session_id=session_id,
        )
        if session_id is not None:
            self.offload.prepare_turn(session_id)  # a session saved on disk starts coming back to the host tier
        seq = Sequence(next(self._seq_ids), req, 0, list(prompt_token_ids), len(prompt_token_ids))
        req.seqs.append(seq)
        self.outputs.add_request(req, sink)
        self.outputs.add_sequence(seq)
        if params.beam_search:
            self.beams.add(req)
        self.scheduler.add(seq)
        self.publish_stats()
        return req

    def abort(self, request_id: str) -> bool:
        """Cancel a request; its blocks are freed (or pinned for its session) now."""
        found = self.beams.abort(request_id) or self.outputs.abort(request_id)
        self.publish_stats()
        return found

    def release_session(self, session_id: str) -> bool:
        found = self.kv.release_session(session_id)
        self.offload.release(session_id)
        self.publish_stats()
        return found

    def saved_sessions(self) -> list[tuple[str, list[int]]]:
        """``(session_id, history)`` of the sessions saved on disk when the engine started."""
        return self.offload.saved_sessions()

    def close(self) -> None:
        """Shutdown: save idle sessions to the disk tier (if any) and stop its writer (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            pending = SchedulerOutput()  # copies decided after the last step (pins given way since)
            pending.swap_out, pending.swap_in, pending.spills = self.kv.take_transfers()
            spilled = self.offload.read_spills(pending.spills)
            self.runner.execute(pending)
            self.offload.write_spills(pending.spills, spilled)
            self.offload.save_all()
        finally:
            self.offload.close()

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    @property
    def requests(self) -> dict[str, Request]:
        """Requests in flight by id (a copy)."""
        return {rid: state.request for rid, state in self.outputs.requests.items()}

    # ------------------------------------------------------------------- step

    def step(self) -> bool:
        """Run one engine step; ``False`` when there was nothing to do."""
        t0 = time.perf_counter()
        self.offload.poll()  # disk reads that have landed go to the host tier, for this step's admission
        out = self.scheduler.schedule()
        if out.is_empty:
            if self.scheduler.has_work():
                self.offload.poll(timeout_s=0.01)  # a turn may wait for its disk read: no busy spin
                self._observe_progress(0)
            return False
        spilled = self.offload.read_spills(out.spills)  # before the step's copies reuse their host blocks
        hidden = self.runner.forward(out)
        self.offload.write_spills(out.spills, spilled)
        sampling = self.scheduler.update(out)
        head = self.loaded.model.greedy_head
        greedy = None
        if head is not None and head.takes(hidden.shape[0]) and all(map(_plain_greedy, sampling)):  # no loop without
            before = head.candidates
            greedy = self.runner.greedy_tokens(hidden)
            if self.metrics is not None:
                self.metrics.observe_greedy_head(hidden.shape[0], head.candidates - before, greedy is None)
        if greedy is not None:  # every row's token without the logits (GreedyHead): no beams, forks or logprobs
            self.outputs.process([s.seq for s in sampling], greedy, time.monotonic(), None)
            self._finish_step(t0, out)
            return True
        logits = self.runner.logits(hidden)
        seqs: list[Sequence] = []  # the sequences that sample, and the logits row each reads
        row_ids: list[int] = []
        for row, s in self.beams.take(sampling, logits, time.monotonic()):  # beam rows step their search
            req = s.seq.request
            if req.params.n > 1 and not req.forked:
                ids = [next(self._seq_ids) for _ in range(req.params.n - 1)]
                for child in self.scheduler.fork(s.seq, ids):
                    self.outputs.add_sequence(child)
                    seqs.append(child)
                    row_ids.append(row)
            seqs.append(s.seq)
            row_ids.append(row)
        tokens: list[int] = []
        logprobs: list[list[TokenLogprob] | None] | None = None
        if seqs:
            if row_ids != list(range(logits.shape[0])):  # forks sample the same row several times
                logits = logits[torch.tensor(row_ids, device=logits.device)]
            params = [seq.request.params for seq in seqs]
            # min_tokens masks EOS and stop ids; logprobs only for the rows that ask (OpenAI API)
            masked = apply_min_tokens(logits, params, [seq.num_output_tokens for seq in seqs], self.eos_token_ids)
            tokens = sample_batch(masked, params, self.outputs.generators(seqs), self.loaded.model.fused_ops)
            logprobs = compute_logprobs(logits, tokens, params)
        self.outputs.process(seqs, tokens, time.monotonic(), logprobs)
        self._finish_step(t0, out)
        return True

    def _finish_step(self, t0: float, out: SchedulerOutput) -> None:
        self.num_steps += 1
        if self.metrics is not None:
            self.metrics.observe_step(time.perf_counter() - t0, out.num_batched_tokens)
        self._observe_progress(out.num_batched_tokens)
        self.publish_stats()

    def thread_governor(self, threads: int) -> ThreadGovernor | None:
        """A governor of the calling thread's torch threads (``EngineConfig.adaptive_threads``), or ``None`` when off.

        Build it on the thread that steps the engine (its readings are that
        thread's schedstat), call its ``after_step`` after each :meth:`step`,
        and its ``release`` when the stepping ends (``torch.set_num_threads``
        also sets the count that threads started later begin with). The
        ``streamkv_engine_threads`` gauge and the drops counter follow it.

        Args:
            threads: the configured torch thread count, restored when cores are free.
        """
        metrics = self.metrics
        if not self.config.adaptive_threads:
            if metrics is not None:
                metrics.observe_threads(threads, dropped=False)
            return None

        def on_change(current: int) -> None:
            if metrics is not None:
                metrics.observe_threads(current, dropped=current < threads)

        governor = ThreadGovernor(threads, torch.set_num_threads, on_change=on_change)
        if metrics is not None:
            metrics.observe_threads(threads, dropped=False)
        governor.start()  # the first step is judged too; an idle wait before it is paused out
        return governor

    def _observe_progress(self, num_computed_tokens: int) -> None:
        """Feed the watchdog (a stall is logged once and counted)."""
        finished = sum(self.outputs.finished.values())
        if self.watchdog.observe(num_computed_tokens, finished, self.scheduler.describe) and self.metrics is not None:
            self.metrics.observe_stall()

    # ------------------------------------------------------------------ stats

    def publish_stats(self) -> None:
        """Replace :attr:`stats` with a fresh record (one attribute store: readers see old or new)."""
        self.stats = self._build_stats()

    def snapshot(self, session_id: str | None = None, include_blocks: bool = True) -> dict[str, Any]:
        """The JSON form of the last published stats (see :func:`streamkv.stats.snapshot_json`)."""
        return snapshot_json(self.stats, session_id, include_blocks)

    def check_invariants(self) -> None:
        self.kv.check_invariants()

    def _build_stats(self) -> EngineStats:
        turns: dict[str, tuple[int, ...]] = {}
        for state in self.outputs.requests.values():
            req = state.request
            if req.session_id is not None and req.seqs and req.seqs[0].status is SeqStatus.RUNNING:
                turns[req.session_id] = tuple(self.kv.block_table(req.seqs[0].seq_id))
        return EngineStats(
            self.scheduler.stats(), self.kv.stats(self.offload.stats()), self.outputs.stats(), turns,
            self.runner.kv_format.name, self.runner.kv_bytes_per_token,
        )  # fmt: skip


def _plain_greedy(s: ScheduledSeq) -> bool:
    """Whether the entry's token is the argmax of its raw logits and nothing else reads them: greedy, one sample,
    no beams, no logprobs, no ``min_tokens`` ban left (:meth:`ModelRunner.greedy_tokens` may serve it)."""
    p = s.seq.request.params
    return (p.greedy and p.n == 1 and p.beam_width is None and p.logprobs is None
            and s.seq.num_output_tokens >= p.min_tokens)  # fmt: skip
