"""Beam search on the real model against transformers' ``generate(num_beams=k, do_sample=False)``.

Every hypothesis (tokens and length-penalized score), not only the best one,
for several prompts, ``k`` in {2, 4}, and each ``early_stopping`` mode with a
length penalty below, at and above 1.
"""

from __future__ import annotations

import pytest
import torch

from streamkv.llm import LLM
from streamkv.model.chat import ChatFormatter
from streamkv.sampling_params import EarlyStopping

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

QUESTIONS = [
    "What is the capital of France?",  # answers in a few tokens: EOS hypotheses, early stopping
    "Name three primary colors.",
    "Write a haiku about the sea.",  # runs to max_tokens
]
MAX_TOKENS = 16

CASES = [
    *[(q, k, 1.0, False) for q in range(len(QUESTIONS)) for k in (2, 4)],
    (0, 4, 0.5, True),
    (1, 2, 2.0, "never"),
]


@pytest.fixture(scope="module")
def llm(smollm2) -> LLM:
    return LLM(loaded=smollm2, device="cpu")


def transformers_beams(
    checkpoint, ids: list[int], k: int, length_penalty: float, early_stopping: EarlyStopping, eos: list[int]
) -> tuple[list[list[int]], list[float]]:
    with torch.inference_mode():
        out = checkpoint.model.generate(
            torch.tensor([ids]),
            max_new_tokens=MAX_TOKENS,
            num_beams=k,
            num_return_sequences=k,
            do_sample=False,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            eos_token_id=eos,
            pad_token_id=eos[0],
            return_dict_in_generate=True,
            output_scores=True,
        )
    lengths = (out.beam_indices >= 0).sum(dim=1).tolist()  # each hypothesis' new tokens (the rest is padding)
    tokens = [out.sequences[i, len(ids) : len(ids) + n].tolist() for i, n in enumerate(lengths)]
    return tokens, out.sequences_scores.tolist()


@pytest.mark.parametrize(("question", "k", "length_penalty", "early_stopping"), CASES)
def test_beams_match_transformers(
    llm, smollm2, smollm2_checkpoint, question, k, length_penalty, early_stopping
) -> None:
    ids = ChatFormatter(smollm2.tokenizer).first_turn(QUESTIONS[question])
    eos = list(smollm2.eos_token_ids)
    want_tokens, want_scores = transformers_beams(smollm2_checkpoint, ids, k, length_penalty, early_stopping, eos)
    (res,) = llm.beam_search([ids], k, MAX_TOKENS, length_penalty, early_stopping=early_stopping)
    assert [o.token_ids for o in res.outputs] == want_tokens
    assert [o.score for o in res.outputs] == pytest.approx(want_scores, abs=1e-4)
    for o in res.outputs:
        assert o.finish_reason == ("stop" if o.token_ids[-1] in eos else "length")
        assert o.text == smollm2.tokenizer.decode(o.token_ids, skip_special_tokens=True)
    llm.core.check_invariants()
    assert llm.core.kv.num_free_blocks == llm.core.num_blocks
