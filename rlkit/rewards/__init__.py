"""Reward functions (answers, format, length) and the scorer that runs them on a batch."""

from rlkit.rewards.base import LengthAwareReward, RewardFunction
from rlkit.rewards.final import FinalAnswer
from rlkit.rewards.format import FormatReward, OverlongPenalty
from rlkit.rewards.math import ExactAnswer, MathAnswer, extract_answer, normalize_answer
from rlkit.rewards.scoring import RewardError, RewardScorer

__all__ = [
    "ExactAnswer",
    "FinalAnswer",
    "FormatReward",
    "LengthAwareReward",
    "MathAnswer",
    "OverlongPenalty",
    "RewardError",
    "RewardFunction",
    "RewardScorer",
    "extract_answer",
    "normalize_answer",
]
