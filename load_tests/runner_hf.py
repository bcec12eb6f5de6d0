"""transformers ``generate`` for ``offline_runner``: greedy, fp32, static batches, left padding.

A workload whose prompts all have one length runs as one batch (no padding);
any other runs in batches of ``hf_batch_size`` requests in its order. Each
batch generates exactly its longest requested output (``min_new_tokens`` =
``max_new_tokens``), and only the requested tokens of each row count. A
logits processor notes when each step's logits are ready, which is when that
step's tokens exist. Weights: the HF-format folder the peers load (the
de-quantized GGUF, bit-identical).
"""

from __future__ import annotations

import time
from typing import Any

from offline_runner import EventLog, Workload


class _StepClock:
    def __init__(self, on_step: Any) -> None:
        self.on_step = on_step

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        self.on_step(time.perf_counter())
        return scores


class Engine:
    def __init__(self, spec: dict[str, Any]) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from streamkv.model.mkl_vml import resolve_vml_dispatch

        torch.set_num_threads(int(spec["threads"]))
        resolve_vml_dispatch()  # the reference's first rotary cos splits between threads (streamkv.model.mkl_vml)
        self.dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[spec["dtype"]]
        self.model = AutoModelForCausalLM.from_pretrained(spec["hf_model"], dtype=self.dtype).eval()
        tok = AutoTokenizer.from_pretrained(spec["hf_model"])
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.batch_size = int(spec["hf_batch_size"])

    def versions(self) -> dict[str, str]:
        import torch
        import transformers

        return {"transformers": transformers.__version__, "torch": torch.__version__}

    def config(self) -> dict[str, Any]:
        import torch

        return {"dtype": str(self.dtype), "static_batch": self.batch_size, "torch_threads": torch.get_num_threads()}

    def generate(self, workload: Workload, log: EventLog) -> list[list[int]]:
        import torch
        from transformers import LogitsProcessorList

        outputs: list[list[int]] = []
        uniform = len({len(p) for p in workload.prompts}) == 1
        size = len(workload.prompts) if uniform else self.batch_size
        log.start()
        for lo in range(0, len(workload.prompts), size):
            prompts = workload.prompts[lo : lo + size]
            olens = workload.output_lens[lo : lo + size]
            width = max(len(p) for p in prompts)
            ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(prompts), width), dtype=torch.long)
            for i, p in enumerate(prompts):
                ids[i, width - len(p) :] = torch.tensor(p)
                mask[i, width - len(p) :] = 1
            new = max(olens)
            step = [0]

            def on_step(now: float, olens: list[int] = olens, lo: int = lo, step: list[int] = step) -> None:
                for i, n in enumerate(olens):
                    if step[0] < n:
                        log.tokens(lo + i, 1, now)
                step[0] += 1

            with torch.inference_mode():
                out = self.model.generate(
                    input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new, min_new_tokens=new,
                    pad_token_id=self.pad_id, logits_processor=LogitsProcessorList([_StepClock(on_step)]),
                    use_cache=True,
                )  # fmt: skip
            outputs += [out[i, width : width + n].tolist() for i, n in enumerate(olens)]
        return outputs
