"""The engine core: one step = schedule, run the model, sample, stream.

Single owner: only the thread that calls :meth:`EngineCore.step` (and the
other mutating methods) touches scheduler and cache state. The async front
end (:mod:`streamkv.engine`) talks to it through a command queue.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import defaultdict, deque
from collections.abc import Callable

import torch

from streamkv.attention.backend import AttentionBackend
from streamkv.cache.kv_cache_manager import KVCacheManager, cdiv
from streamkv.config import EngineConfig
from streamkv.detokenizer import IncrementalDetokenizer
from streamkv.errors import EngineError
from streamkv.metrics_hooks import MetricsHooks
from streamkv.model.loader import LoadedModel, load_model
from streamkv.outputs import CompletionDelta, RequestOutput, Usage
from streamkv.runner import ModelRunner, kv_bytes_per_block
from streamkv.sampling import sample_batch
from streamkv.sampling_params import SamplingParams
from streamkv.sched.request import Request, Sequence, SeqStatus
from streamkv.sched.scheduler import Scheduler
from streamkv.stats import build_snapshot

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def make_backend(name: str, device: torch.device) -> AttentionBackend:
    """``auto`` picks triton on CUDA; on the CPU the C++ ``cpu`` backend when its op builds, else torch.

    triton and the C++ op are imported (built) lazily. A CPU op that cannot be
    built is logged by :func:`streamkv.ops.cpu_ops.load_cpu_ops`.
    """
    if name == "auto" and device.type == "cuda":
        name = "triton"
    elif name == "auto":
        from streamkv.attention.cpu_paged import cpu_ops_available

        name = "cpu" if cpu_ops_available() else "torch"
    if name == "cpu":
        from streamkv.attention.cpu_paged import CpuPagedAttention

        return CpuPagedAttention()
    if name == "triton":
        from streamkv.attention.triton_paged import TritonPagedAttention

        return TritonPagedAttention()
    from streamkv.attention.torch_paged import TorchPagedAttention

    return TorchPagedAttention()


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
        self.loaded = loaded if loaded is not None else load_model(config.model, self.device)
        self.tokenizer = self.loaded.tokenizer
        self.eos_token_ids = frozenset(self.loaded.eos_token_ids)
        cc, sc = config.cache, config.scheduler
        self.block_size = cc.block_size
        block_bytes = kv_bytes_per_block(self.loaded, cc.block_size)
        self.num_blocks = cc.num_blocks or self._blocks_for_budget(block_bytes)
        num_host_blocks = min(cc.swap_space // block_bytes, self.num_blocks)
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
        )
        self.scheduler = Scheduler(sc, self.kv)
        self.backend = make_backend(config.model.attention_backend, self.device)
        self.runner = ModelRunner(self.loaded, self.backend, self.num_blocks, cc.block_size, num_host_blocks, self.device)
        self.requests: dict[str, Request] = {}
        self.finished_reasons: dict[str, int] = defaultdict(int)
        self.num_steps = 0
        self._seq_ids = itertools.count()
        self._order = itertools.count()
        self._rng = torch.Generator()
        if config.model.seed is None:
            self._rng.seed()
        else:
            self._rng.manual_seed(config.model.seed)
        self._gen_history: deque[tuple[float, int]] = deque(maxlen=64)
        logger.info(
            "KV pool: %d blocks x %d tokens = %d tokens (%.1f MiB, %d B/token), host swap %d blocks; "
            "max_model_len %d; attention backend %s on %s",
            self.num_blocks, cc.block_size, pool_tokens, self.num_blocks * block_bytes / 2**20,
            block_bytes // cc.block_size, num_host_blocks, self.max_model_len, self.backend.name, self.device,
        )  # fmt: skip

    def _blocks_for_budget(self, block_bytes: int) -> int:
        cc = self.config.cache
        budget = cc.kv_cache_memory
        if self.device.type == "cuda" and cc.gpu_memory_utilization is not None:
            budget = self._profile_gpu_budget(cc.gpu_memory_utilization)
        num = budget // block_bytes
        if num < 1:
            raise ValueError(f"KV budget of {budget} bytes holds no block of {block_bytes} bytes")
        return int(num)

    def _profile_gpu_budget(self, utilization: float) -> int:
        """Device bytes left for KV after a forward at the full token budget (vLLM's profile run)."""
        from streamkv.attention.metadata import AttentionMetadata

        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        n = self.config.scheduler.max_num_batched_tokens
        m = self.loaded.model
        bs = self.config.cache.block_size
        nb = cdiv(n, bs)
        caches = [torch.zeros(2, nb, bs, m.num_kv_heads, m.head_dim, dtype=self.loaded.dtype, device=self.device)
                  for _ in range(m.num_layers)]  # fmt: skip
        meta = AttentionMetadata.build([n], [n], [list(range(nb))], bs, self.device)
        with torch.inference_mode():
            hidden = m(torch.zeros(n, dtype=torch.long, device=self.device),
                       torch.arange(n, device=self.device), caches, meta, make_backend("torch", self.device))  # fmt: skip
            m.compute_logits(hidden[-min(n, self.config.scheduler.max_num_seqs):])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        del caches, hidden
        used_by_others = total - free - torch.cuda.memory_reserved(self.device)
        budget = int(total * utilization) - peak - used_by_others
        logger.info("GPU profile: peak %.2f GiB of %.2f GiB; KV budget %.2f GiB", peak / 2**30, total / 2**30, budget / 2**30)
        return max(budget, 0)

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
            raise EngineError("empty_prompt", "the prompt has no tokens")
        vocab = self.loaded.hf_config.vocab_size
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in prompt_token_ids):
            raise EngineError("invalid_params", f"prompt token ids must be integers in [0, {vocab})")
        if n >= self.max_model_len:
            raise EngineError(
                "prompt_too_long",
                f"prompt of {n} tokens leaves no room to generate under max_model_len {self.max_model_len}",
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n
        if n + max_tokens > self.max_model_len:
            raise EngineError(
                "prompt_too_long",
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) exceeds max_model_len {self.max_model_len}",
            )
        if cdiv(n + max_tokens, self.block_size) > self.num_blocks:
            raise EngineError(
                "exceeds_pool",
                f"{n + max_tokens} tokens need more than the pool's {self.num_blocks} blocks of {self.block_size}",
            )
        return max_tokens

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        sink: Callable[[RequestOutput], None],
        session_id: str | None = None,
        arrival_time: float | None = None,
    ) -> Request:
        """Validate and queue a request (see :meth:`validate` for errors)."""
        if request_id in self.requests:
            raise EngineError("invalid_params", f"request id {request_id!r} is already in flight")
        max_tokens = self.validate(prompt_token_ids, params)
        req = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            max_tokens=max_tokens,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            order=next(self._order),
            sink=sink,
            session_id=session_id,
        )
        seq = self._new_seq(req, 0, list(prompt_token_ids), 0)
        req.seqs.append(seq)
        self.requests[request_id] = req
        self.scheduler.add(seq)
        return req

    def abort(self, request_id: str) -> bool:
        """Cancel a request; its blocks are freed (or pinned for its session) now."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        deltas = []
        for seq in req.seqs:
            if not seq.status.finished:
                self.scheduler.finish(seq, SeqStatus.FINISHED_ABORTED)
                deltas.append(CompletionDelta(seq.index, [], seq.detokenizer.flush(), "cancelled"))
        self._emit(req, deltas)
        return True

    def release_session(self, session_id: str) -> bool:
        return self.kv.release_session(session_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ------------------------------------------------------------------- step

    def step(self) -> bool:
        """Run one engine step; ``False`` when there was nothing to do."""
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        if out.is_empty:
            return False
        logits = self.runner.execute(out)
        sampling = self.scheduler.update(out)
        deltas: dict[Request, list[CompletionDelta]] = defaultdict(list)
        now = time.monotonic()
        rows: list[tuple[Sequence, int]] = []  # (sequence that samples, logits row)
        for row, s in enumerate(sampling):
            seq = s.seq
            req = seq.request
            if req.params.n > 1 and not req.forked:
                req.forked = True
                for i in range(1, req.params.n):
                    child = self._new_seq(req, i, list(seq.token_ids), seq.num_computed_tokens)
                    req.seqs.append(child)
                    self.kv.fork(seq, child)
                    self.scheduler.add_running(child)
                    rows.append((child, row))
            rows.append((seq, row))
        if rows:
            row_ids = [r for _, r in rows]
            if row_ids != list(range(logits.shape[0])):  # forks sample the same row several times
                logits = logits[torch.tensor(row_ids, device=logits.device)]
            tokens = sample_batch(
                logits,
                [seq.request.params for seq, _ in rows],
                [seq.generator for seq, _ in rows],
            )
            for (seq, _), token in zip(rows, tokens):
                delta = self._append_token(seq, token, now)
                deltas[seq.request].append(delta)
        for req, ds in deltas.items():
            self._emit(req, ds)
        self.num_steps += 1
        self.scheduler.counters.generation_tokens += len(rows)
        self._gen_history.append((now, self.scheduler.counters.generation_tokens))
        if self.metrics is not None:
            self.metrics.observe_step(time.perf_counter() - t0, out.num_batched_tokens)
        return True

    def _append_token(self, seq: Sequence, token: int, now: float) -> CompletionDelta:
        req = seq.request
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
            text = seq.detokenizer.flush()
        else:
            text, stopped = seq.detokenizer.add_token(token)
            if stopped:
                status = SeqStatus.FINISHED_STOPPED
            elif seq.num_output_tokens >= req.max_tokens or seq.num_tokens >= self.max_model_len:
                status = SeqStatus.FINISHED_LENGTH
                text += seq.detokenizer.flush()
        if status is not None:
            self.scheduler.finish(seq, status)
        return CompletionDelta(seq.index, [token], text, status.value if status is not None else None)

    def _emit(self, req: Request, deltas: list[CompletionDelta]) -> None:
        finished = req.finished
        out = RequestOutput(req.request_id, deltas, finished)
        first = req.seqs[0].first_token_time
        if first is not None:
            out.ttft_s = first - req.arrival_time
        if finished:
            now = time.monotonic()
            completion = sum(s.num_output_tokens for s in req.seqs)
            out.usage = Usage(len(req.prompt_token_ids), req.num_cached_tokens, completion)
            out.e2e_s = now - req.arrival_time
            del self.requests[req.request_id]
            for seq in req.seqs:
                self.finished_reasons[seq.status.value] += 1
            self.scheduler.counters.prompt_tokens += len(req.prompt_token_ids)
            if self.metrics is not None:
                self.metrics.observe_finished(
                    out.e2e_s, len(req.prompt_token_ids), completion, req.seqs[0].status.value
                )
        req.sink(out)

    def _new_seq(self, req: Request, index: int, token_ids: list[int], num_computed: int) -> Sequence:
        p = req.params
        gen = torch.Generator()
        if p.seed is not None:
            gen.manual_seed((p.seed * 1_000_003 + index) % (2**63))
        else:
            gen.manual_seed(int(torch.randint(0, 2**62, (1,), generator=self._rng)))
        return Sequence(
            seq_id=next(self._seq_ids),
            request=req,
            index=index,
            token_ids=token_ids,
            num_prompt_tokens=len(req.prompt_token_ids),
            generator=gen,
            detokenizer=IncrementalDetokenizer(self.tokenizer, p.stop, req.prompt_token_ids),
            num_computed_tokens=num_computed,
        )

    # ------------------------------------------------------------ accounting

    def tokens_per_s(self, window_s: float = 5.0) -> float:
        """Generation tokens per second over the last ``window_s`` seconds."""
        hist = list(self._gen_history)
        if len(hist) < 2:
            return 0.0
        now = time.monotonic()
        recent = [h for h in hist if now - h[0] <= window_s]
        if len(recent) < 2:
            return 0.0
        (t0, n0), (t1, n1) = recent[0], recent[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0

    def snapshot(self, session_id: str | None = None, include_blocks: bool = True) -> dict:
        return build_snapshot(self, session_id, include_blocks)

    def check_invariants(self) -> None:
        self.kv.check_invariants()
