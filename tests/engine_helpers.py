"""Helpers shared by the engine tests."""

from __future__ import annotations

from typing import Any

from streamkv.llm import LLM
from streamkv.model.loader import LoadedModel
from streamkv.sampling_params import SamplingParams


def make_llm(loaded: LoadedModel, **options: Any) -> LLM:
    options.setdefault("device", "cpu")
    options.setdefault("num_blocks", 256)
    return LLM(loaded=loaded, **options)


def greedy(max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def prompts_of(lengths: list[int], seed: int = 0, vocab: int = 49152) -> list[list[int]]:
    """Deterministic pseudo-random prompts of the given lengths."""
    out = []
    x = 1234567 + seed
    for n in lengths:
        p = []
        for _ in range(n):
            x = (x * 1103515245 + 12345) % (2**31)
            p.append(100 + x % (vocab - 200))
        out.append(p)
    return out


def assert_pool_whole(llm: LLM) -> None:
    """Every block is free or cached, and the pool's books balance."""
    core = llm.core
    core.check_invariants()
    counts = core.kv.pool.state_counts()
    assert counts["used"] == counts["pinned"] == counts["shared"] == 0, counts
    assert core.kv.pool.num_free_blocks == core.num_blocks
