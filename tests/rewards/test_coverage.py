"""RewardCoverage: the share of a rollout each reward function applied to, a warning once it falls below
its threshold, and a stop after a run of rollouts on which it applied to nothing."""

import math

import pytest

from rlkit.rewards import RewardError
from rlkit.rewards.coverage import RewardCoverage

NONE = math.nan  # how RewardScorer records None ("does not apply")


def test_the_applied_fraction_of_each_function_is_returned_per_rollout():
    coverage = RewardCoverage(["python", "accuracy"])
    stats = coverage.update({"python": [1.0, NONE, 0.0, NONE], "accuracy": [1.0, 0.0, 0.0, 1.0]})
    assert stats == {"reward/python/applied_fraction": 0.5, "reward/accuracy/applied_fraction": 1.0}


def test_a_run_stops_only_after_the_stated_number_of_rollouts_in_a_row_without_a_score(caplog):
    coverage = RewardCoverage(["rare"], stop_after=3, kinds={"rare": "TRLReward"})
    with caplog.at_level("WARNING", logger="rlkit.rewards.coverage"):
        for _ in range(2):
            coverage.update({"rare": [NONE] * 8})
        coverage.update({"rare": [NONE] * 7 + [1.0]})  # it applied once: the count starts again
        for _ in range(2):
            coverage.update({"rare": [NONE] * 8})
    assert len(caplog.messages) == 1 and "'rare' (TRLReward) applied to 0%" in caplog.messages[0]
    with pytest.raises(RewardError, match=r"'rare' \(TRLReward\) returned None .* of the last 3 rollouts"):
        coverage.update({"rare": [NONE] * 8})


def test_the_warning_threshold_and_never_stopping():
    coverage = RewardCoverage(["f"], warn_below=0.0, stop_after=0)
    for _ in range(50):
        assert coverage.update({"f": [NONE] * 4}) == {"reward/f/applied_fraction": 0.0}
    with pytest.raises(ValueError, match=r"stop_after must be >= 0 \(0: never stop\), got -1"):
        RewardCoverage(["f"], stop_after=-1)
