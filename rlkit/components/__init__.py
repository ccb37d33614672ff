"""rlkit's interchangeable components: pure tensor maths, no Lightning.

Importing this package registers every class with jsonargparse, so the CLI resolves short names
(``--model.advantage=GroupMean``).
"""

from rlkit.components.advantage import (
    GAE,
    Advantage,
    AdvantageInputs,
    DiscountedReturn,
    GPGScaled,
    GreedyBaseline,
    GroupMean,
    GroupMeanWhitened,
    GroupNorm,
    LeaveOneOut,
    LengthWeightedBaseline,
)
from rlkit.components.aggregation import (
    Aggregation,
    SeqMeanTokenMean,
    SeqMeanTokenSum,
    SeqMeanTokenSumNorm,
    StepTotals,
    TokenMean,
    TokenSum,
)
from rlkit.components.clip import Clip, ClipOutput, NoClip, PPOClip
from rlkit.components.entropy import entropy_from_logits
from rlkit.components.kl import K1, K2, K3, KL, AbsKL
from rlkit.components.kl_reward import AdaptiveKLController, FixedKLController, KLController, KLPenalty
from rlkit.components.logprobs import token_log_probs
from rlkit.components.ratio import LogProb, Ratio, SequenceRatio, TokenRatio
from rlkit.components.value import ClippedValueLoss
from rlkit.components.whiten import masked_mean, masked_var, masked_whiten

__all__ = [
    "GAE", "Advantage", "AdvantageInputs", "DiscountedReturn", "GPGScaled", "GreedyBaseline", "GroupMean",
    "GroupMeanWhitened", "GroupNorm", "LeaveOneOut", "LengthWeightedBaseline",
    "Aggregation", "SeqMeanTokenMean", "SeqMeanTokenSum", "SeqMeanTokenSumNorm", "StepTotals", "TokenMean",
    "TokenSum",
    "Clip", "ClipOutput", "NoClip", "PPOClip",
    "KL", "K1", "K2", "K3", "AbsKL",
    "KLPenalty", "KLController", "FixedKLController", "AdaptiveKLController",
    "LogProb", "Ratio", "SequenceRatio", "TokenRatio",
    "ClippedValueLoss", "entropy_from_logits", "token_log_probs", "masked_mean", "masked_var", "masked_whiten",
]  # fmt: skip
