"""Deliberately broken pieces for the bad-input tests (importable as ``spine.faulty``)."""

import torch

from rlkit.components.ratio import Ratio
from rlkit.data.prompts import Prompt
from rlkit.rewards.base import RewardFunction


class NaNRatio(Ratio):
    """A ratio that turns the loss into NaN."""

    def __call__(self, log_prob, old_log_prob, mask):
        return torch.exp(log_prob - old_log_prob) * float("nan")


class RaisingReward(RewardFunction):
    """A reward function with a bug."""

    name = "buggy"

    def __call__(self, completion: str, prompt: Prompt) -> float:
        raise KeyError("answer")
