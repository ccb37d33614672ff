"""Rewards on the shape of a completion rather than its answer: format and length."""

from __future__ import annotations

import re

from rlkit.data.prompts import Prompt
from rlkit.rewards.base import LengthAwareReward, RewardFunction


class FormatReward(RewardFunction):
    """1.0 when the whole completion matches a regular expression, else 0.0.

    ``re.fullmatch(pattern, completion, re.DOTALL)``: ``.`` also matches newlines, as in the
    ``<think>...</think><answer>...</answer>`` format rewards of DeepSeek-R1-style recipes.

    Args:
        pattern: a Python regular expression the entire completion must match, e.g.
            ``"<think>.*</think>\\s*<answer>.*</answer>"``.
        name: the label of this reward's curve (``reward/<name>``).
    """

    def __init__(self, pattern: str, name: str = "format") -> None:
        try:
            self.regex = re.compile(pattern, re.DOTALL)
        except re.error as e:
            raise ValueError(
                f"FormatReward: pattern {pattern!r} is not a valid regular expression: {e}. Fix the "
                f"pattern (in YAML, quote it and escape backslashes as needed)."
            ) from e
        self.pattern = pattern
        self.name = name

    def __call__(self, completion: str, prompt: Prompt) -> float:
        return float(self.regex.fullmatch(completion) is not None)


class OverlongPenalty(LengthAwareReward):
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), on the length ``|y|`` in tokens.

    ``R = 0`` if ``|y| <= L_max - L_cache``; ``((L_max - L_cache) - |y|) / L_cache`` if
    ``L_max - L_cache < |y| <= L_max``; ``-1`` if ``|y| > L_max``. Add it to a correctness reward in
    ``RewardScorer`` (DAPO uses weight 1; verl's ``penalty_factor`` is that weight).

    Args:
        max_length: ``L_max``, the length in tokens from which the penalty is -1; usually the
            engine's maximum number of new tokens.
        buffer: ``L_cache``, the number of tokens before ``max_length`` over which the penalty falls
            linearly from 0 to -1 (DAPO: 4096 of 20480).
        name: the label of this reward's curve (``reward/<name>``).
    """

    def __init__(self, max_length: int, buffer: int, name: str = "overlong") -> None:
        if max_length < 2:
            raise ValueError(f"OverlongPenalty: max_length must be at least 2 tokens, got {max_length}.")
        if not 1 <= buffer < max_length:
            raise ValueError(
                f"OverlongPenalty: buffer must satisfy 1 <= buffer < max_length={max_length}, got "
                f"{buffer}. The penalty starts at max_length - buffer tokens (DAPO: buffer 4096 of 20480)."
            )
        self.max_length = max_length
        self.buffer = buffer
        self.name = name

    def __call__(self, completion: str, prompt: Prompt, length: int | None = None) -> float:
        if length is None:
            raise ValueError(
                "OverlongPenalty needs the completion length in tokens: call it with length=..., as RewardScorer does."
            )
        free = self.max_length - self.buffer
        if length <= free:
            return 0.0
        if length > self.max_length:
            return -1.0
        return (free - length) / self.buffer
