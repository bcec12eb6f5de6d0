"""The engine's greedy output is the same on the Triton backend (interpreted here) as on torch."""

from __future__ import annotations

import pytest

from streamkv.llm import LLM
from streamkv.sampling_params import SamplingParams

pytest.importorskip("triton")


def test_greedy_output_identical_on_triton_and_torch(tiny):
    prompts = [[100 + (7 * i) % 4000 for i in range(n)] for n in (5, 23, 40)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        # a small budget mixes chunked prefill with decodes: both kernels run
        llm = LLM(loaded=tiny, device="cpu", num_blocks=64, max_num_batched_tokens=16, attention_backend=backend)
        assert llm.core.backend.name == backend
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert outs["triton"] == outs["torch"]
