"""Token sampling: greedy, temperature, top-k, top-p, with a generator per sequence.

Each sequence owns a ``torch.Generator``; a token is drawn from it only when
that sequence samples, so the same seed gives the same tokens whatever else
is in the batch and across preemption (the generator lives on the sequence,
not in the step).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from types import ModuleType

import torch

from streamkv.outputs import TokenLogprob
from streamkv.sampling_params import SamplingParams


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Draw one token id.

    Args:
        logits: float32 or bfloat16 ``[vocab]`` for one sequence (widened to float32 before any arithmetic).
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


def greedy_tokens(rows: torch.Tensor, ops: ModuleType | None = None) -> list[int]:
    """``torch.argmax(rows, dim=-1)`` of float32 or bfloat16 ``[N, vocab]`` logits, as a list of ``N`` token ids.

    With ``ops`` (:func:`streamkv.ops.cpu_ops.load_fused_ops`'s module) a CPU
    float32 or bfloat16 tensor takes its ``argmax_rows``: the same answer (first
    maximum; a NaN counts as the maximum; bf16 compared as its exact float32
    widening), ~10x faster than torch's CPU argmax over a 49,152-token
    vocabulary (docs/benchmarks.md, "bf16 decode attention and greedy argmax").
    """
    if (
        ops is not None
        and rows.device.type == "cpu"
        and rows.dtype in (torch.float32, torch.bfloat16)
        and rows.stride(-1) == 1
    ):
        out = torch.empty(rows.shape[0], dtype=torch.long)
        ops.argmax_rows(out, rows)
        return out.tolist()
    return torch.argmax(rows, dim=-1).tolist()


def sample_batch(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    ops: ModuleType | None = None,
) -> list[int]:
    """Sample one token per row of ``logits`` ``[N, vocab]``; ``ops`` as for :func:`greedy_tokens`.

    ``logits`` is float32, or a bf16 model's bfloat16 (what ``ModelRunner.execute``
    returns): each use compares or widens it exactly, so the tokens are those of
    its float32 widening.
    """
    greedy = [i for i, p in enumerate(params) if p.greedy]
    out = [0] * len(params)
    if greedy:
        # All rows greedy (the common batch): no gathered copy of the [N, vocab] logits first.
        rows = logits if len(greedy) == len(params) else logits[torch.tensor(greedy, device=logits.device)]
        for i, tok in zip(greedy, greedy_tokens(rows, ops), strict=True):
            out[i] = tok
    for i, p in enumerate(params):
        if not p.greedy:
            out[i] = sample_token(logits[i], p, generators[i])
    return out


def apply_min_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    num_output_tokens: Sequence[int],
    eos_token_ids: Collection[int],
) -> torch.Tensor:
    """Forbid EOS and ``stop_token_ids`` in rows that have not reached ``min_tokens`` yet.

    Args:
        logits: float32 or bfloat16 ``[N, vocab]``, one row per sampling sequence.
        params: each row's sampling parameters.
        num_output_tokens: tokens each row's sequence has generated so far.
        eos_token_ids: the model's EOS ids (not forbidden when ``ignore_eos``).

    Returns:
        ``logits`` itself when no row is below its ``min_tokens`` (no copy),
        else a copy with the forbidden ids at ``-inf``.
    """
    banned = [
        (i, [*(() if p.ignore_eos else eos_token_ids), *p.stop_token_ids])
        for i, (p, num) in enumerate(zip(params, num_output_tokens, strict=True))
        if num < p.min_tokens
    ]
    banned = [(i, ids) for i, ids in banned if ids]
    if not banned:
        return logits
    logits = logits.clone()
    for i, ids in banned:
        logits[i, torch.tensor(ids, device=logits.device)] = float("-inf")
    return logits


def compute_logprobs(
    logits: torch.Tensor, tokens: Sequence[int], params: Sequence[SamplingParams]
) -> list[list[TokenLogprob] | None]:
    """Log-probabilities of the sampled tokens, for the rows whose ``params.logprobs`` is set.

    Args:
        logits: float32 or bfloat16 ``[N, vocab]``, the raw logits the tokens were sampled from
            (widened to float32 for the log-softmax).
        tokens: the ``N`` sampled token ids.
        params: each row's sampling parameters.

    Returns:
        Per row ``None`` (not asked: nothing is computed) or a one-element
        list holding the token's :class:`TokenLogprob` (natural log of the
        softmax of the raw logits, before temperature and truncation).
    """
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    out: list[list[TokenLogprob] | None] = [None] * len(params)
    if not rows:
        return out
    idx = torch.tensor(rows, device=logits.device)
    lp = torch.log_softmax(logits[idx].float(), dim=-1)
    chosen = lp.gather(1, torch.tensor([[tokens[i]] for i in rows], device=logits.device)).squeeze(1).tolist()
    k = max(params[i].logprobs or 0 for i in rows)
    top_vals, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    vals, ids = top_vals.tolist(), top_ids.tolist()
    for j, i in enumerate(rows):
        n = params[i].logprobs or 0
        out[i] = [TokenLogprob(tokens[i], chosen[j], list(zip(ids[j][:n], vals[j][:n], strict=True)))]
    return out
