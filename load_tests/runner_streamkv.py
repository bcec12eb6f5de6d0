"""streamkv's offline engine for ``offline_runner``: the ``LLM`` API, stepped here to time each token.

The spec's ``dtype`` (and ``quantization`` and ``kv_cache_dtype`` when set) go to ``LLM(...)`` as
they are, so the runner works with whatever the checked-out streamkv accepts;
an option it does not know makes the variant *unsupported*, not an error.
Prefix caching is off (the repeats reuse the same prompts); the KV pool is
``kv_cache_gib``, as for the peers.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from offline_runner import EventLog, Unsupported, Workload

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


class Engine:
    def __init__(self, spec: dict[str, Any]) -> None:
        import torch

        from streamkv.llm import LLM

        torch.set_num_threads(int(spec["threads"]))
        self.options: dict[str, Any] = {
            "dtype": spec["dtype"], "device": "cpu", "kv_cache_memory": int(spec["kv_cache_gib"] * (1 << 30)),
            "max_num_seqs": int(spec["max_num_seqs"]), "max_num_batched_tokens": int(spec["max_num_batched_tokens"]),
            "max_model_len": int(spec["max_model_len"]), "enable_prefix_caching": False, "seed": 0,
        }  # fmt: skip
        if spec.get("quantization"):
            self.options["quantization"] = spec["quantization"]
        if spec.get("kv_cache_dtype"):
            self.options["kv_cache_dtype"] = spec["kv_cache_dtype"]
        try:
            self.llm = LLM(spec.get("streamkv_model"), **self.options)
        except (TypeError, ValueError) as e:  # an option this streamkv does not have (yet)
            raise Unsupported(f"streamkv LLM({self.options}) refused: {e}") from e
        self._n = 0

    def versions(self) -> dict[str, str]:
        import importlib.metadata
        import subprocess

        import torch

        repo = Path(__file__).resolve().parent.parent
        git = subprocess.run(
            ["git", "-C", str(repo), "describe", "--always", "--dirty"], capture_output=True, text=True, check=False
        )
        return {"streamkv": importlib.metadata.version("streamkv"), "git": git.stdout.strip() or "?",
                "torch": torch.__version__}  # fmt: skip

    def config(self) -> dict[str, Any]:
        import torch

        return {**self.options, "torch_threads": torch.get_num_threads()}

    def generate(self, workload: Workload, log: EventLog) -> list[list[int]]:
        from streamkv.sampling_params import SamplingParams

        core = self.llm.core
        outputs: list[list[int]] = [[] for _ in workload.prompts]

        def sink_for(i: int) -> Callable[[Any], None]:
            def sink(out: Any) -> None:
                now = time.perf_counter()
                n = 0
                for d in out.deltas:
                    outputs[i].extend(d.token_ids)
                    n += len(d.token_ids)
                log.tokens(i, n, now)

            return sink

        self._n += 1
        log.start()
        arrival = time.monotonic()
        for i, (prompt, n) in enumerate(zip(workload.prompts, workload.output_lens, strict=True)):
            params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
            core.add_request(f"run{self._n}-{i}", prompt, params, sink_for(i), arrival_time=arrival)
        while core.has_work():
            core.step()
        return outputs
