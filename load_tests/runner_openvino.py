"""OpenVINO GenAI for ``offline_runner``: ``ContinuousBatchingPipeline`` stepped here, greedy, token ids in.

``ContinuousBatchingPipeline`` is what ``LLMPipeline(..., scheduler_config=...)``
runs underneath (continuous batching over a paged KV cache); driving it step
by step gives each token's arrival time. Variants (spec ``dtype``):

- ``f32``: ``INFERENCE_PRECISION_HINT=f32`` and ``KV_CACHE_PRECISION=f32``;
- ``default``: the CPU plugin's defaults (bf16 compute and u8 KV on CPUs with
  AVX512-BF16 or AMX).

Threads: ``INFERENCE_NUM_THREADS``. KV: ``cache_size`` GB, prefix caching off.
"""

from __future__ import annotations

from typing import Any

from offline_runner import EventLog, Workload


class Engine:
    def __init__(self, spec: dict[str, Any]) -> None:
        import openvino_genai as ov_genai

        sched = ov_genai.SchedulerConfig()
        sched.cache_size = int(spec["kv_cache_gib"])
        sched.max_num_batched_tokens = int(spec["max_num_batched_tokens"])
        sched.max_num_seqs = int(spec["max_num_seqs"])
        sched.enable_prefix_caching = False
        sched.dynamic_split_fuse = True
        self.properties: dict[str, Any] = {"INFERENCE_NUM_THREADS": int(spec["threads"])}
        if spec["dtype"] == "f32":
            self.properties |= {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}
        elif spec["dtype"] != "default":
            raise ValueError(f"OpenVINO variant dtype must be f32 or default, not {spec['dtype']!r}")
        self.sched = sched
        self.ir = spec["ov_model"]
        self.pipe = ov_genai.ContinuousBatchingPipeline(self.ir, sched, "CPU", self.properties)
        self._n = 0

    def versions(self) -> dict[str, str]:
        import openvino
        import openvino_genai

        return {"openvino_genai": openvino_genai.__version__, "openvino": openvino.__version__}

    def config(self) -> dict[str, Any]:
        s = self.sched
        return {"ir": self.ir, "properties": self.properties, "cache_size_gb": s.cache_size,
                "max_num_batched_tokens": s.max_num_batched_tokens, "max_num_seqs": s.max_num_seqs,
                "enable_prefix_caching": s.enable_prefix_caching,
                "dynamic_split_fuse": s.dynamic_split_fuse}  # fmt: skip

    def generate(self, workload: Workload, log: EventLog) -> list[list[int]]:
        import time

        import numpy as np
        import openvino
        import openvino_genai as ov_genai

        handles = []
        outputs: list[list[int]] = [[] for _ in workload.prompts]
        tensors = [openvino.Tensor(np.array([p], dtype=np.int64)) for p in workload.prompts]
        log.start()
        for ids, n in zip(tensors, workload.output_lens, strict=True):
            cfg = ov_genai.GenerationConfig()
            cfg.max_new_tokens = n
            cfg.min_new_tokens = n
            cfg.ignore_eos = True
            cfg.do_sample = False
            self._n += 1
            handles.append(self.pipe.add_request(self._n, ids, cfg))
        max_steps = workload.num_output_tokens + sum(len(p) for p in workload.prompts) + 16  # >= 1 token a step
        for _ in range(max_steps):
            busy = self.pipe.has_non_finished_requests()
            if busy:
                self.pipe.step()
            now = time.perf_counter()
            for i, h in enumerate(handles):
                if h.can_read():
                    for out in h.read().values():
                        outputs[i].extend(out.generated_ids)
                        log.tokens(i, len(out.generated_ids), now)
            if not busy:
                return outputs
        raise RuntimeError(f"OpenVINO did not finish {workload.name} in {max_steps} steps")
