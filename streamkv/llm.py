"""Offline API: ``LLM(...).generate(prompts, params)`` for scripts, tests and benchmarks."""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Sequence
from typing import Any

import torch

from streamkv.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from streamkv.engine_core import EngineCore
from streamkv.errors import EngineError
from streamkv.metrics_hooks import MetricsHooks
from streamkv.model.loader import LoadedModel
from streamkv.outputs import CompletedRequest, CompletionOutput, RequestOutput
from streamkv.sampling_params import EarlyStopping, SamplingParams
from streamkv.thread_governor import ThreadGovernor

_MODEL_KEYS = set(ModelConfig.__dataclass_fields__)
_CACHE_KEYS = set(CacheConfig.__dataclass_fields__)
_SCHED_KEYS = set(SchedulerConfig.__dataclass_fields__)
_ENGINE_KEYS = {"adaptive_threads"}


class LLM:
    """Run the engine synchronously in the caller's thread.

    Args:
        model: model path (``None``: the default SmolLM2 GGUF).
        config: a full :class:`EngineConfig` (then keyword options must be empty).
        loaded: an already loaded model to share (tests).
        metrics: optional metrics observer.
        **options: any field of ModelConfig, CacheConfig or SchedulerConfig
            (``device="cpu"``, ``num_blocks=64``, ``max_num_batched_tokens=16`` ...),
            and ``adaptive_threads`` (default True: while :meth:`generate` runs,
            the calling thread drops to one torch thread when it waits for a
            core, as the served engine does; :mod:`streamkv.thread_governor`).
            The engine runs at torch's thread count at this call.

    Raises:
        TypeError: an unknown option.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        config: EngineConfig | None = None,
        loaded: LoadedModel | None = None,
        metrics: MetricsHooks | None = None,
        **options: Any,
    ) -> None:
        if config is None:
            unknown = set(options) - _MODEL_KEYS - _CACHE_KEYS - _SCHED_KEYS - _ENGINE_KEYS
            if unknown:
                raise TypeError(f"unknown LLM options: {sorted(unknown)}")

            def pick(keys: set[str]) -> dict[str, Any]:
                return {k: v for k, v in options.items() if k in keys}

            config = EngineConfig(
                model=ModelConfig(model=model, **pick(_MODEL_KEYS - {"model"})),
                cache=CacheConfig(**pick(_CACHE_KEYS)),
                scheduler=SchedulerConfig(**pick(_SCHED_KEYS)),
                **pick(_ENGINE_KEYS),
            )
        elif options or model is not None:
            raise TypeError("pass either config or keyword options, not both")
        self.core = EngineCore(config, metrics, loaded)
        self._threads = torch.get_num_threads()  # the engine's count; see _run_to_completion
        self._local = threading.local()  # .governor: each calling thread's, gone with the thread
        self.tokenizer = self.core.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        session_ids: Sequence[str | None] | None = None,
    ) -> list[CompletedRequest]:
        """Generate for every prompt (strings are tokenized as-is; token lists used directly).

        Returns one :class:`CompletedRequest` per prompt, in order.

        Raises:
            streamkv.errors.EngineError: a prompt fails admission (nothing is run).
        """
        if isinstance(prompts, str):
            prompts = [prompts]
        ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        if params is None:
            params = SamplingParams()
        plist = list(params) if isinstance(params, Sequence) else [params] * len(ids)
        if len(plist) != len(ids):
            raise ValueError("one SamplingParams per prompt, or one for all")
        sessions = list(session_ids) if session_ids is not None else [None] * len(ids)
        if len(sessions) != len(ids):
            raise ValueError("one session id (or None) per prompt")
        for prompt, p in zip(ids, plist, strict=True):
            self.core.validate(prompt, p)
        results: dict[str, CompletedRequest] = {}
        order = []
        for prompt, p, sid in zip(ids, plist, sessions, strict=True):
            rid = f"offline-{next(self._ids)}"
            order.append(rid)
            res = CompletedRequest(rid, prompt, [CompletionOutput(i) for i in range(p.n)])
            results[rid] = res
            self.core.add_request(rid, prompt, p, functools.partial(_collect, res), sid)
        self._run_to_completion()
        return [results[rid] for rid in order]

    def _run_to_completion(self) -> None:
        """Step until every request is done, under this thread's thread governor (see ``adaptive_threads``).

        The engine runs at torch's thread count as it was when this ``LLM`` was
        made (a thread that first touched torch during another thread's drop
        would read 1), or at one thread while the governor holds a drop; the
        caller's own count is set back on the way out, also when a step raises.
        One governor per calling thread lives across calls, so a drop, its hold
        and a failed reading carry over, and the time between calls is paused out.
        """
        caller = torch.get_num_threads()
        governor = self._thread_governor()
        torch.set_num_threads(self._threads if governor is None else governor.current)
        if governor is not None:
            governor.resume()
        try:
            while self.core.has_work():
                self.core.step()
                if governor is not None:
                    governor.after_step()
        finally:
            if governor is not None:
                governor.pause()
            torch.set_num_threads(caller)

    def _thread_governor(self) -> ThreadGovernor | None:
        """The calling thread's governor: built at its first call, on it (its readings are that thread's)."""
        if not hasattr(self._local, "governor"):
            self._local.governor = self.core.thread_governor(self._threads)
        governor: ThreadGovernor | None = self._local.governor
        return governor

    def beam_search(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        beam_width: int,
        max_tokens: int,
        length_penalty: float = 1.0,
        *,
        early_stopping: EarlyStopping = False,
        num_hypotheses: int | None = None,
        ignore_eos: bool = False,
        stop_token_ids: Sequence[int] = (),
        min_tokens: int = 0,
    ) -> list[CompletedRequest]:
        """Beam search for every prompt (vLLM's ``LLM.beam_search`` arguments, transformers' scoring).

        Beams share their blocks and fork copy-on-write (:mod:`streamkv.beam_search`);
        the result equals transformers' ``generate(num_beams=beam_width,
        do_sample=False, length_penalty=..., early_stopping=...)``.

        Args:
            prompts: strings (tokenized as-is) or token id lists.
            beam_width: beams per prompt, 1..16.
            max_tokens: most new tokens per hypothesis.
            length_penalty: a hypothesis of ``L`` new tokens scores ``sum logprob / L ** length_penalty``.
            early_stopping: ``True``, ``False`` or ``"never"``, as in transformers.
            num_hypotheses: hypotheses returned per prompt (default ``beam_width``).
            ignore_eos, stop_token_ids, min_tokens: as in :class:`SamplingParams`.

        Returns:
            One :class:`CompletedRequest` per prompt whose ``outputs`` are the
            hypotheses, best first, each with its ``score``; ``token_ids``
            end with the stop id when ``finish_reason`` is ``stop``.

        Raises:
            ValueError: an out-of-range argument.
            streamkv.errors.EngineError: a prompt fails admission (nothing is run).
        """
        params = SamplingParams(
            n=beam_width if num_hypotheses is None else num_hypotheses,
            max_tokens=max_tokens,
            temperature=0.0,
            beam_width=beam_width,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            ignore_eos=ignore_eos,
            stop_token_ids=tuple(stop_token_ids),
            min_tokens=min_tokens,
        )
        return self.generate(prompts, params)


def _collect(res: CompletedRequest, out: RequestOutput | EngineError) -> None:
    if isinstance(out, EngineError):  # the synchronous engine reports failures by raising; never sent
        raise out
    for d in out.deltas:
        o = res.outputs[d.index]
        o.token_ids.extend(d.token_ids)
        o.text += d.text
        if d.finish_reason is not None:
            o.finish_reason = d.finish_reason
        if d.score is not None:
            o.score = d.score
    if out.finished:
        res.usage, res.ttft_s, res.e2e_s = out.usage, out.ttft_s, out.e2e_s
