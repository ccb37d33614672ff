"""A worked answer's final result: the number a completion ends with, after its last ``=``."""

from __future__ import annotations

import re

from rlkit.data.prompts import Prompt
from rlkit.rewards.base import RewardFunction

_FINAL = re.compile(r"=\s*(-?\d+)\s*")


class FinalAnswer(RewardFunction):
    """1.0 when the completion ends with ``=<integer>`` and that integer equals the ground truth, else 0.0.

    Made for worked answers such as ``"3+5=8,8+7=15"`` (``rlkit.embedded.chain.AdditionChain``): only the result
    after the last ``=`` counts, and nothing may follow it, so a completion cut off in the middle of a
    step (``"...,8+7"``) or one that runs on after its result (``"...=15,15+"``) earns nothing, while the
    intermediate steps are not checked. Compared as integers (``"015"`` equals ``"15"``).

    Args:
        name: the label of this reward's curve (``reward/<name>``).
    """

    def __init__(self, name: str = "accuracy") -> None:
        self.name = name

    def __call__(self, completion: str, prompt: Prompt) -> float:
        if prompt.ground_truth is None:
            raise ValueError(
                "FinalAnswer needs a ground truth, and this prompt has none: set PromptFile's answer_key "
                "to the column holding the answers."
            )
        match = _FINAL.fullmatch(completion, completion.rfind("=")) if "=" in completion else None
        if match is None:
            return 0.0
        try:
            return float(int(match.group(1)) == int(prompt.ground_truth.strip()))
        except ValueError:  # a ground truth that is not an integer never matches
            return 0.0
