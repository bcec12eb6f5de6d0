"""Token sampling: greedy, temperature, top-k, top-p, with a generator per sequence.

Each sequence owns a ``torch.Generator``; a token is drawn from it only when
that sequence samples, so the same seed gives the same tokens whatever else
is in the batch and across preemption (the generator lives on the sequence,
not in the step).
"""

from __future__ import annotations

import torch

from streamkv.sampling_params import SamplingParams


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Draw one token id.

    Args:
        logits: float32 ``[vocab]`` for one sequence.
        params: its sampling parameters.
        generator: the sequence's CPU generator (ignored when greedy).

    Returns:
        The token id (argmax when ``temperature == 0``).
    """
    if params.greedy:
        return int(torch.argmax(logits))
    logits = logits.float() / params.temperature
    if not torch.isfinite(logits.max()):  # a tiny temperature overflowed: the limit is greedy
        return int(torch.argmax(logits))
    if params.top_k is not None and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = torch.cumsum(probs, dim=-1) - probs >= params.top_p
        drop[0] = False  # even a top_p that rounds to 0 in float32 keeps the likeliest token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(0, order, sorted_logits)
    probs = torch.softmax(logits, dim=-1).cpu()
    return int(torch.multinomial(probs, 1, generator=generator))


def sample_batch(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int]:
    """Sample one token per row of ``logits`` ``[N, vocab]`` (float32)."""
    greedy = [i for i, p in enumerate(params) if p.greedy]
    out = [0] * len(params)
    if greedy:
        idx = torch.tensor(greedy, device=logits.device)
        for i, tok in zip(greedy, torch.argmax(logits[idx], dim=-1).tolist()):
            out[i] = tok
    for i, p in enumerate(params):
        if not p.greedy:
            out[i] = sample_token(logits[i], p, generators[i])
    return out
