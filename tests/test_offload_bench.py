"""load_tests/bench_idle_sessions.py's pure parts: where two conversations diverge, and why."""

from __future__ import annotations

from load_tests.bench_idle_sessions import explain_mismatches, first_divergence


def test_first_divergence_finds_the_turn_and_token() -> None:
    want = [[1, 2, 3], [4, 5, 6]]
    assert first_divergence(want, want) is None
    assert first_divergence([[1, 2, 3], [4, 9, 6]], want) == (1, 1)
    assert first_divergence([[1, 2]], [[1, 2, 3]]) == (0, 2)  # a shorter answer
    assert first_divergence([[1, 2, 3]], want) == (1, 0)  # a missing turn (cut by the time bound)


def test_a_divergence_is_a_near_tie_only_when_both_rows_saw_a_small_gap() -> None:
    ref = {"outputs": [[[1, 2]], [[1, 2]], [[1, 2]], [[1, 2]]],
           "gaps": [[[0.5, 1e-6]], [[0.5, 2.0]], [[0.5, 2e-5]], [[0.5, 1e-6]]]}  # fmt: skip
    row = {"outputs": [[[1, 7]], [[1, 7]], [[1, 2]], [[1, 7]]],
           "gaps": [[[0.5, 3e-6]], [[0.5, 1.9]], [[0.5, 2e-5]], [[0.5, 0.3]]]}  # fmt: skip
    found = explain_mismatches(row, ref, near_tie=1e-4)
    assert [(m["conversation"], m["turn"], m["token"], m["near_tie"]) for m in found] == [
        (0, 0, 1, True),
        (1, 0, 1, False),  # a 2-nat margin flipped: not the batch mix, wrong KV
        (3, 0, 1, False),  # the logits themselves moved by far more than a reduction order can
    ]
