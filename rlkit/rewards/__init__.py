"""Reward functions (answers, code, format, length, adapters for TRL and verl functions) and the
scorer that runs them on a batch. Importing this package does not import torch (reward worker
processes import it and start quickly)."""

from rlkit.rewards.adapters import TRLReward, VerlReward
from rlkit.rewards.base import LengthAwareReward, RewardFunction
from rlkit.rewards.code import CodeExecution, extract_code
from rlkit.rewards.format import FormatReward, OverlongPenalty
from rlkit.rewards.math import ExactAnswer, MathAnswer, extract_answer, normalize_answer
from rlkit.rewards.scoring import RewardError, RewardScorer

__all__ = [
    "CodeExecution",
    "ExactAnswer",
    "FormatReward",
    "LengthAwareReward",
    "MathAnswer",
    "OverlongPenalty",
    "RewardError",
    "RewardFunction",
    "RewardScorer",
    "TRLReward",
    "VerlReward",
    "extract_answer",
    "extract_code",
    "normalize_answer",
]
