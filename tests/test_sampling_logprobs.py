"""min_tokens masking and sampled-token logprobs: exact values, and no work for rows that do not ask."""

from __future__ import annotations

import pytest
import torch

from streamkv.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from streamkv.llm import LLM
from streamkv.model.loader import LoadedModel
from streamkv.sampling import apply_min_tokens, compute_logprobs
from streamkv.sampling_params import SamplingParams


def test_logprobs_are_the_raw_log_softmax_and_only_for_rows_that_ask() -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(logprobs=2), SamplingParams(), SamplingParams(logprobs=0, temperature=0.3)]
    out = compute_logprobs(logits, [5, 6, 7], params)
    assert out[1] is None
    lp = torch.log_softmax(logits, dim=-1)
    assert out[0] is not None and out[2] is not None
    assert out[0][0].token_id == 5 and out[0][0].logprob == pytest.approx(float(lp[0, 5]))
    top = torch.topk(lp[0], 2)
    assert [t for t, _ in out[0][0].top] == top.indices.tolist()
    assert [v for _, v in out[0][0].top] == pytest.approx(top.values.tolist())
    assert out[2][0].top == [] and out[2][0].logprob == pytest.approx(float(lp[2, 7]))  # raw, not tempered
    assert compute_logprobs(logits, [1, 2, 3], [SamplingParams()] * 3) == [None, None, None]


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.zeros(3, 10)
    params = [SamplingParams(min_tokens=2, stop_token_ids=(4,)), SamplingParams(min_tokens=2), SamplingParams()]
    masked = apply_min_tokens(logits, params, [1, 2, 0], eos_token_ids={9})
    assert masked[0, 9] == masked[0, 4] == float("-inf") and torch.isfinite(masked[0, :4]).all()
    assert torch.isfinite(masked[1:]).all()  # row 1 reached min_tokens; row 2 asked nothing
    assert apply_min_tokens(logits, params[1:], [2, 0], eos_token_ids={9}) is logits  # no copy when nothing to mask
    ignore = apply_min_tokens(logits, [SamplingParams(min_tokens=3, ignore_eos=True)], [0], eos_token_ids={9})
    assert ignore is logits


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
    ],
)
def test_sampling_params_refuse_bad_values(kwargs: dict[str, int], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


@pytest.mark.slow
def test_engine_holds_off_a_stop_id_until_min_tokens(tiny_model_dir: str, tiny: LoadedModel) -> None:
    llm = LLM(
        config=EngineConfig(
            model=ModelConfig(model=tiny_model_dir, device="cpu"),
            cache=CacheConfig(num_blocks=32),
            scheduler=SchedulerConfig(max_model_len=256),
        ),
        loaded=tiny,
    )
    prompt = llm.tokenizer.encode("Hello there")
    first = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))[0].outputs[0].token_ids[0]
    stopped = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, stop_token_ids=(first,)))[0]
    assert stopped.outputs[0].token_ids == [first] and stopped.outputs[0].finish_reason == "stop"
    held = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, stop_token_ids=(first,), min_tokens=3))
    ids = held[0].outputs[0].token_ids
    assert len(ids) >= 3 and first not in ids[:3]
    with_lp = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0, logprobs=1))[0]
    plain = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0))[0]
    assert with_lp.outputs[0].token_ids == plain.outputs[0].token_ids  # asking for logprobs changes nothing
