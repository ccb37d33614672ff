"""Fixtures shared by the reward tests."""

import pytest

from rlkit.rewards.scoring import RewardScorer


@pytest.fixture
def scorers():
    """Scorers made by a test, closed after it (worker processes must not outlive the test)."""
    made = []

    def make(*args, **kwargs):
        made.append(RewardScorer(*args, **kwargs))
        return made[-1]

    yield make
    for scorer in made:
        scorer.close()
