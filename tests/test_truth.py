"""The real model through the engine against transformers' own generate (greedy)."""

from __future__ import annotations

import pytest
import torch

from streamkv.llm import LLM
from streamkv.model.chat import ChatFormatter
from streamkv.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
    "Explain what a KV cache is in one sentence.",
]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def chat_prompts(smollm2):
    chat = ChatFormatter(smollm2.tokenizer)
    return [chat.first_turn(q) for q in QUESTIONS]


@pytest.fixture(scope="module")
def hf_greedy(smollm2_checkpoint, chat_prompts):
    """transformers generate, one prompt at a time (no padding effects)."""
    model = smollm2_checkpoint.model
    outs = []
    with torch.inference_mode():
        for ids in chat_prompts:
            gen = model.generate(
                torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, eos_token_id=None
            )
            outs.append(gen[0, len(ids) :].tolist())
    return outs


def test_greedy_matches_transformers_alone(smollm2, chat_prompts, hf_greedy):
    llm = LLM(loaded=smollm2, device="cpu")
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for ids, want in zip(chat_prompts, hf_greedy, strict=True):
        (out,) = llm.generate([ids], params)
        assert out.outputs[0].token_ids == want


def test_greedy_matches_transformers_batched_with_others(smollm2, chat_prompts, hf_greedy):
    llm = LLM(loaded=smollm2, device="cpu", max_num_batched_tokens=48)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    fillers = [smollm2.tokenizer.encode("Once upon a time " * k) for k in (1, 7, 15)]
    outs = llm.generate(chat_prompts + fillers, params)
    assert [o.outputs[0].token_ids for o in outs[: len(chat_prompts)]] == hf_greedy


def test_capital_of_france_names_paris(smollm2, chat_prompts):
    llm = LLM(loaded=smollm2, device="cpu")
    (out,) = llm.generate([chat_prompts[0]], SamplingParams(temperature=0, max_tokens=40))
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # the model ends its turn with <|im_end|>


def test_stop_string_across_token_boundaries(smollm2):
    """SmolLM2 answers "A: Alpha Beta Gamma Delta ..."; "a Gam" spans " Beta" + " Gamma"."""
    chat = ChatFormatter(smollm2.tokenizer)
    prompt = chat.first_turn("Repeat exactly, ten times: alpha beta gamma delta")
    llm = LLM(loaded=smollm2, device="cpu")
    outs = []
    llm.core.add_request("stop", prompt, SamplingParams(temperature=0, max_tokens=20, stop=["a Gam"]), outs.append)
    while llm.core.has_work():
        llm.core.step()
    deltas = [d for o in outs for d in o.deltas]
    streamed = "".join(d.text for d in deltas)
    assert deltas[-1].finish_reason == "stop"
    assert streamed == "A: Alpha Bet"  # ends right before the stop string, nothing withdrawn
    ids = [t for d in deltas for t in d.token_ids]
    assert smollm2.tokenizer.decode(ids, skip_special_tokens=True).startswith("A: Alpha Beta Gam")
