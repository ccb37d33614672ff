"""A reward for the study tests that holds a run in the middle of training, in a torch-free module."""

import os
import time
from pathlib import Path

from rlkit.rewards import RewardFunction


class Gated(RewardFunction):
    """Scores 1. After ``open_calls`` calls (in this process), each call waits while the file named by
    ``$RLKIT_TEST_GATE`` exists: the run stops in the middle of a rollout until the test removes it. It
    creates ``<gate>.waiting`` when it starts to wait.

    Args:
        open_calls: calls that pass before the gate applies (e.g. two rollouts' worth).
    """

    name = "gated"

    def __init__(self, open_calls: int = 32) -> None:
        self.open_calls = open_calls
        self.calls = 0

    def __call__(self, completion, prompt):
        self.calls += 1
        gate = os.environ.get("RLKIT_TEST_GATE")
        if gate and self.calls > self.open_calls and Path(gate).exists():
            Path(gate + ".waiting").touch()
            while Path(gate).exists():
                time.sleep(0.05)
        return 1.0
