"""Deliberately broken pieces for the bad-input tests (importable as ``spine.faulty``)."""

import torch

from rlkit.components.ratio import Ratio
from rlkit.data.prompts import Prompt
from rlkit.engines.hf import HFEngine
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


class MismatchedEngine(HFEngine):
    """HFEngine whose reported log-probs carry a deterministic offset of up to +-0.008 per (token, position),
    so a rollout correction with a narrow band acts, and acts alike in every process: a bfloat16 engine's
    mismatch depends on how the prompts were batched, which data parallelism changes."""

    def generate(self, prompts, n, seed, greedy=False):
        rows = super().generate(prompts, n, seed, greedy=greedy)
        for row in rows:
            for g in row:
                g.logprobs = [
                    lp + 0.004 * ((tok * 7 + t * 3) % 5 - 2)
                    for t, (tok, lp) in enumerate(zip(g.token_ids, g.logprobs, strict=True))
                ]
        return rows
