"""`looprl.forward.score.micro_batches`: the one split of sequences into forward passes
(the update's and the vLLM rescorer's)."""

from __future__ import annotations

from looprl.forward.score import micro_batches

PROMPT = [1, 2, 3, 4, 5, 6]


def test_a_shared_prompt_is_counted_once():
    sequences = [PROMPT + [7, 8], PROMPT + [9], PROMPT + [10, 11, 12]]
    # cost of all three: 6 (one prompt) + 3 rows x 3 (longest suffix) = 15
    assert micro_batches(sequences, [6, 6, 6], [1.0] * 3, token_budget=15) == [[0, 1, 2]]
    assert micro_batches(sequences, [6, 6, 6], [1.0] * 3, token_budget=14) == [[0, 1], [2]]


def test_distinct_prompts_each_count():
    sequences = [PROMPT + [7], [9, 9, 9, 9, 9, 9, 7]]
    # two prompts of 6 + 2 rows x 1
    assert micro_batches(sequences, [6, 6], [1.0, 1.0], token_budget=14) == [[0, 1]]
    assert micro_batches(sequences, [6, 6], [1.0, 1.0], token_budget=13) == [[0], [1]]


def test_a_new_temperature_starts_a_new_micro_batch_in_order():
    sequences = [PROMPT + [7]] * 4
    temperatures = [1.0, 1.0, 0.7, 1.0]
    assert micro_batches(sequences, [6] * 4, temperatures, 1_000) == [[0, 1], [2], [3]]


def test_a_sequence_over_the_budget_goes_alone():
    sequences = [PROMPT + [7], PROMPT + list(range(50)), PROMPT + [8]]
    assert micro_batches(sequences, [6] * 3, [1.0] * 3, token_budget=20) == [[0], [1], [2]]
    assert micro_batches([], [], [], token_budget=20) == []
