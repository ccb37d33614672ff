"""Batched reward functions (TRL's shape, BatchedReward): one call per scoring batch, with every completion;
the same scores as one call per completion; a batch that raises, hangs or returns the wrong length is one
error naming the function and what it returned."""

import math

import pytest
import reward_fixtures

from rlkit.data.prompts import Prompt
from rlkit.rewards import BatchedReward, RewardError, RewardScorer, TRLReward

SOLUTIONS = ["4", "6", "8"]


def batch(n=6):
    """``n`` rows over three prompts, every other completion right."""
    prompts = [Prompt(f"{s}?", meta={"solution": s}) for s in SOLUTIONS for _ in range(n // 3)]
    completions = [p.meta["solution"] if j % 2 == 0 else "0" for j, p in enumerate(prompts)]
    return completions, prompts, [1] * len(prompts)


def test_one_call_per_batch_with_every_completion_and_the_same_scores(scorers):
    reward_fixtures.trl_counted.batches.clear()
    completions, prompts, lengths = batch(6)
    total, parts = scorers([TRLReward("reward_fixtures.trl_counted")]).score(completions, prompts, lengths)
    assert reward_fixtures.trl_counted.batches == [6]  # one call, all six completions
    assert total.tolist() == [1.0, 0.0] * 3
    reward_fixtures.trl_counted.batches.clear()
    one_by_one = scorers([TRLReward("reward_fixtures.trl_counted", batched=False)])
    total_1, parts_1 = one_by_one.score(completions, prompts, lengths)
    assert reward_fixtures.trl_counted.batches == [1] * 6  # the per-completion path
    assert total_1.tolist() == total.tolist() and parts_1["trl_counted"].tolist() == parts["trl_counted"].tolist()


def test_columns_and_chat_completions_line_up_row_by_row():
    reward_fixtures.trl_echo.calls.clear()
    messages = [{"role": "user", "content": "2+2?"}]
    prompts = [Prompt("1+1=", meta={"solution": "2"}), Prompt(messages, meta={"solution": "4", "level": 3})]
    RewardScorer([TRLReward("reward_fixtures.trl_echo")]).score(["2", "4"], prompts, [1, 1])
    # a column some rows lack is None there, as in a dataset with a missing value
    assert reward_fixtures.trl_echo.calls == [
        {
            "prompts": ["1+1=", messages],
            "completions": ["2", [{"role": "assistant", "content": "4"}]],
            "solution": ["2", "4"],
            "level": [None, 3],
        }
    ]


def test_in_a_worker_process(scorers):
    completions, prompts, lengths = batch(6)
    scorer = scorers([TRLReward("reward_fixtures.trl_counted"), TRLReward("reward_fixtures.trl_echo")], workers=2)
    total, parts = scorer.score(completions, prompts, lengths)
    assert parts["trl_counted"].tolist() == [1.0, 0.0] * 3 and total.tolist() == [2.0, 1.0] * 3
    with pytest.raises(RewardError, match=r"'trl_drops_one' \(TRLReward\) raised ValueError: .* returned list "):
        scorers([TRLReward("reward_fixtures.trl_drops_one")], workers=1).score(completions, prompts, lengths)


@pytest.mark.parametrize("workers", [0, 1])
def test_a_batch_that_fails_is_one_error_naming_the_function(scorers, workers):
    completions, prompts, lengths = batch(6)
    with pytest.raises(
        RewardError,
        match=r"'trl_drops_one' \(TRLReward\) raised ValueError: TRLReward\('reward_fixtures.trl_drops_one'\) "
        r"returned list \[1.0, 1.0, 1.0, 1.0, 1.0\] for 6 completions; a TRL reward function returns a list with "
        r"one float .* on its batch of 6 completions \(rows 0-5; ",
    ):
        scorers([TRLReward("reward_fixtures.trl_drops_one")], workers=workers).score(completions, prompts, lengths)
    with pytest.raises(RewardError, match=r"'trl_batch_raises' \(TRLReward\) raised RuntimeError: reward model out"):
        scorers([TRLReward("reward_fixtures.trl_batch_raises")], workers=workers).score(completions, prompts, lengths)
    # time limit: timeout_s per completion of the batch
    hung = scorers([TRLReward("reward_fixtures.trl_sleeps")], timeout_s=0.05, workers=workers)
    with pytest.raises(RewardError, match=r"took longer than timeout_s=0.05 s per completion \(0.3 s\) on its batch"):
        hung.score(completions, prompts, lengths)


def test_on_error_zero_scores_the_failed_rows_0_and_counts_them(scorers):
    completions, prompts, lengths = batch(6)
    scorer = scorers(
        [TRLReward("reward_fixtures.trl_batch_raises"), TRLReward("reward_fixtures.trl_counted")], on_error="zero"
    )
    total, parts = scorer.score(completions, prompts, lengths)
    assert scorer.errors == 6 and parts["trl_batch_raises"].tolist() == [0.0] * 6  # every row of the batch
    assert total.tolist() == [1.0, 0.0] * 3
    # a value that is not a number fails its own row only
    scorer = scorers([TRLReward("reward_fixtures.trl_text_on_second")], on_error="zero")
    _, parts = scorer.score(completions, prompts, lengths)
    assert scorer.errors == 1 and parts["trl_text_on_second"].tolist() == [1.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    with pytest.raises(RewardError, match=r"returned str 'yes', which is not a number on row 1 of the batch"):
        RewardScorer([TRLReward("reward_fixtures.trl_text_on_second")]).score(completions, prompts, lengths)


class Lengths(BatchedReward):
    """A batched reward of one's own: the length of each completion, or a wrong-length list when told."""

    name = "lengths"

    def __init__(self, short=False):
        self.short = short

    def score_batch(self, completions, prompts):
        scores = [float(len(c)) if c != "-" else None for c in completions]
        return scores[:-1] if self.short else scores


def test_a_batched_reward_of_ones_own(scorers):
    _, parts = scorers([Lengths()]).score(["ab", "-", "abc"], [Prompt("p")] * 3, [1] * 3)
    values = parts["lengths"].tolist()
    assert values[0] == 2.0 and math.isnan(values[1]) and values[2] == 3.0
    assert Lengths()("abcd", Prompt("p")) == 4.0  # __call__: a batch of one
    with pytest.raises(
        RewardError,
        match=r"'lengths' \(Lengths\) returned list \[2.0, None\] \(2 values\) for 3 "
        r"completions, on its batch .* Return a list with one score",
    ):
        scorers([Lengths(short=True)]).score(["ab", "-", "abc"], [Prompt("p")] * 3, [1] * 3)
