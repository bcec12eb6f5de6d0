"""Sampling: greedy, top-k, top-p and per-sequence generators."""

from __future__ import annotations

import math

import pytest
import torch

from streamkv.ops.cpu_ops import load_fused_ops
from streamkv.sampling import apply_min_tokens, compute_logprobs, greedy_tokens, sample_batch, sample_token
from streamkv.sampling_params import SamplingParams


def test_greedy_takes_argmax():
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert sample_token(logits, SamplingParams(temperature=0), None) == 1


@pytest.mark.skipif(load_fused_ops() is None, reason="the fused C++ ops could not be built here")
def test_greedy_rows_on_the_cpu_op_equal_torch_argmax_in_a_mixed_batch():
    ops = load_fused_ops()
    logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(3))
    logits[2, 10] = logits[2, 900] = logits[2].max() + 1  # a tie: the first index
    params = [SamplingParams(temperature=0)] * 3 + [SamplingParams(temperature=1.0, seed=1)] + [SamplingParams()] * 2
    params[5] = SamplingParams(temperature=0)
    gens = [None, None, None, torch.Generator().manual_seed(1), None, None]
    want = logits.argmax(-1).tolist()
    assert greedy_tokens(logits, ops) == want == greedy_tokens(logits)
    got = sample_batch(logits, params, gens, ops)
    assert [got[i] for i in (0, 1, 2, 5)] == [want[i] for i in (0, 1, 2, 5)] and got[2] == 10


@pytest.mark.parametrize("fused", [False, True])
def test_a_bf16_models_logits_sample_as_their_float32_widening(fused: bool) -> None:
    # The runner hands a bf16 model's logits on unwidened: every row must draw, mask and score as its float32 copy
    ops = load_fused_ops() if fused else None
    if fused and ops is None:
        pytest.skip("the fused C++ ops could not be built here")
    logits = (torch.randn(6, 3000, generator=torch.Generator().manual_seed(11)) * 4).bfloat16()
    logits[1, 7] = logits[1, 2900] = logits[1].max() + 1  # a tie: the first index
    logits[4, 5] = float("nan")
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, logprobs=3),
        SamplingParams(temperature=0.8, seed=5, top_k=50),
        SamplingParams(temperature=1.0, seed=6, top_p=0.9, logprobs=2),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, min_tokens=3, stop_token_ids=(9,)),
    ]
    logits[5, 9] = logits[5].max() + 1  # the likeliest token is banned until min_tokens

    def run(x: torch.Tensor) -> tuple[list[int], object]:
        gens = [None if p.seed is None else torch.Generator().manual_seed(p.seed) for p in params]
        masked = apply_min_tokens(x, params, [0] * len(params), eos_token_ids=(0,))
        tokens = sample_batch(masked, params, gens, ops)
        return tokens, compute_logprobs(x, tokens, params)

    (tokens, logprobs), want = run(logits), run(logits.float())
    assert (tokens, logprobs) == want
    assert tokens[0] == int(logits[0].float().argmax()) and tokens[1] == 7 and tokens[4] == 5 and tokens[5] != 9
    assert logprobs[0] is None and logprobs[1] is not None and logprobs[3] is not None


def test_top_k_one_is_greedy_whatever_the_temperature():
    logits = torch.randn(100, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    picks = {sample_token(logits, SamplingParams(temperature=5.0, top_k=1), g) for _ in range(20)}
    assert picks == {int(torch.argmax(logits))}


def test_top_p_keeps_only_the_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    g = torch.Generator().manual_seed(2)
    picks = {sample_token(logits, SamplingParams(temperature=1.0, top_p=0.7), g) for _ in range(200)}
    assert picks == {0, 1}


def test_same_seed_same_tokens_regardless_of_batch():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(3))
    p = SamplingParams(temperature=0.9, seed=4)
    alone = [sample_token(logits[1], p, torch.Generator().manual_seed(4)) for _ in range(1)]
    gens = [torch.Generator().manual_seed(s) for s in (9, 4, 7)]
    batched = sample_batch(logits, [SamplingParams(temperature=1.0), p, SamplingParams(temperature=0)], gens)
    assert batched[1] == alone[0]
    assert batched[2] == int(torch.argmax(logits[2]))


def test_extreme_temperature_and_top_p_never_break_sampling():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(5)) * 30
    g = torch.Generator().manual_seed(6)
    argmax = int(torch.argmax(logits))
    for p in (
        SamplingParams(temperature=1e-300),
        SamplingParams(temperature=1e-38),
        SamplingParams(temperature=1e-6),
        SamplingParams(temperature=1.0, top_p=1e-300),
        SamplingParams(temperature=1.0, top_p=1e-46),
    ):
        assert sample_token(logits, p, g) == argmax
    # a huge temperature is close to uniform but still a valid draw
    assert 0 <= sample_token(logits, SamplingParams(temperature=1e30), g) < 1000


@pytest.mark.parametrize("field", ["temperature", "top_p"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_values_are_refused(field: str, value: float) -> None:
    # temperature=nan used to pass every range check and sample token 0 forever
    with pytest.raises(ValueError, match=f"{field} must be a finite number"):
        SamplingParams(**{field: value})
