"""Rollout correction: per-token weights for the mismatch between the engine that sampled and the trainer.

The engine (vLLM in bf16, another kernel, stale weights) samples from ``mu``; the trainer's policy is
``pi``. Each token's ratio ``rho_t = pi(y_t) / mu(y_t)`` is computed from the trainer's log-probs and
the engine's; a correction turns it into a weight that multiplies the token's policy loss, and may
drop tokens or whole sequences from the loss (Yao et al. 2025, "Your Efficient RL Framework Secretly
Brings You Off-Policy RL Training"; verl's ``rollout_corr_helper``).

``level`` says which ratio a token sees: ``"token"`` its own ``rho_t``; ``"sequence"`` its row's
product ``prod_t rho_t``; ``"geometric"`` its row's geometric mean ``exp(mean_t log rho_t)``. Log-ratios
are clamped to ``[-20, 20]`` before ``exp`` (verl's safety bound).

Two modes, chosen by ``bypass``:

- decoupled (``bypass=False``): the trainer recomputes ``pi_old`` and the weights compare it with the
  engine, once per rollout (``log_prob = pi_old``). The PPO ratio then handles ``pi / pi_old``.
- bypass (``bypass=True``, verl's bypass mode): the engine's log-probs serve as ``pi_old`` and the
  trainer skips its recompute; the weights compare the *current* policy (detached) with the engine, per
  micro-batch. With ``LogProb`` + ``NoClip`` this is verl's bypass REINFORCE; with ``NoCorrection`` and
  ``PPOClip`` verl's bypass PPO-clip (the PPO ratio is then the correction; verl computes weights there
  for its metrics only).

Every weight is per token or per row, so micro-batching does not change them. verl's batch
normalisation of the weights (mean 1 over the batch) is not offered (see README).
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from rlkit.components.base import Component, Need

SAFETY_BOUND = 20.0  # log-ratios are clamped to [-20, 20] before exp, as verl
Level = Literal["token", "sequence", "geometric"]


@dataclass
class CorrectionOutput:
    """Attributes:
    weights: ``[N, T]`` detached weights multiplying each token's policy loss (0 on padding).
    keep: ``[N, T]`` bool, tokens left in the loss; a dropped token leaves the step's token and
        sequence counts too (the caller builds ``StepTotals`` from ``mask * keep``).
    metrics: scalars over the valid tokens given: ``weight_mean``, ``ess`` (the normalised effective
        sample size ``(sum w)^2 / (n sum w^2)``, 1 when all weights are equal) and the fraction the
        correction acted on are token means; ``weight_max`` is a maximum.
    """

    weights: Tensor
    keep: Tensor
    metrics: dict[str, Tensor] = field(default_factory=dict)


class RolloutCorrection(Component):
    """Base of every rollout correction: ``__call__(log_prob, rollout_log_prob, mask) -> CorrectionOutput``.

    ``log_prob`` is the trainer's ``[N, T]`` (``pi_old``, or the current policy detached when ``bypass``),
    ``rollout_log_prob`` the engine's, ``mask`` the completion mask. ``bypass`` tells the caller to use
    the engine's log-probs as ``pi_old`` and skip its own recompute. A decoupled correction (not bypass)
    compares with the trainer's log-probs before the update and gives its weights to the components
    beside it (``OptimalTokenBaseline(use_is_weights=true)``).
    """

    bypass: bool

    @property
    def needs(self) -> frozenset[Need]:
        return frozenset() if self.bypass else frozenset({Need.OLD_LOGPROBS})

    @property
    def provides(self) -> frozenset[Need]:
        return frozenset() if self.bypass else frozenset({Need.IS_WEIGHTS})

    @abstractmethod
    def __call__(self, log_prob: Tensor, rollout_log_prob: Tensor, mask: Tensor) -> CorrectionOutput: ...


def _log_ratio(log_prob: Tensor, rollout_log_prob: Tensor, mask: Tensor, level: str) -> Tensor:
    """``log rho`` at ``level`` broadcast to tokens ``[N, T]``, clamped to the safety bound."""
    token = (log_prob.detach() - rollout_log_prob) * mask  # [N, T]
    if level == "token":
        log_rho = token  # [N, T]
    elif level == "sequence":
        log_rho = token.sum(dim=-1, keepdim=True).expand_as(token)  # [N, T]
    else:
        lengths = mask.sum(dim=-1, keepdim=True).clamp(min=1)  # [N, 1]
        log_rho = (token.sum(dim=-1, keepdim=True) / lengths).expand_as(token)  # [N, T]
    return torch.clamp(log_rho, -SAFETY_BOUND, SAFETY_BOUND)  # [N, T]


def _weight_metrics(weights: Tensor, valid: Tensor, acted: Tensor, acted_name: str) -> dict[str, Tensor]:
    count = valid.sum().clamp(min=1)  # []
    w = torch.where(valid, weights, 0.0)  # [N, T]
    total, squares = w.sum(), w.square().sum()  # [], []
    return {
        "weight_mean": total / count,
        "weight_max": torch.where(valid, weights, -torch.inf).max() if valid.any() else weights.new_zeros(()),
        acted_name: (acted & valid).sum() / count,
        "ess": total.square() / (count * squares) if squares > 0 else weights.new_zeros(()),
    }


def _check_level(level: str, name: str) -> None:
    if level not in ("token", "sequence", "geometric"):
        raise ValueError(f"{name} level={level!r} must be 'token', 'sequence' or 'geometric'.")


def _check_band(lower: float, upper: float, name: str, example: str) -> None:
    if not 0.0 < lower <= upper:
        raise ValueError(
            f"{name} lower={lower}, upper={upper}: need 0 < lower <= upper, ratios pi/mu inside [lower, upper] "
            f"are kept (e.g. {example})."
        )


class NoCorrection(RolloutCorrection):
    """Every weight 1, nothing dropped. With ``bypass=True``: verl's bypass mode with PPO-clip (the
    engine's log-probs are ``pi_old``, so the PPO ratio itself corrects the mismatch).

    Args:
        bypass: use the engine's log-probs as ``pi_old`` and skip the trainer's recompute.
    """

    def __init__(self, bypass: bool = False):
        self.bypass = bypass

    def __call__(self, log_prob: Tensor, rollout_log_prob: Tensor, mask: Tensor) -> CorrectionOutput:
        mask = mask.to(log_prob.dtype)  # [N, T]
        return CorrectionOutput(weights=mask.clone(), keep=mask.bool())


class TruncatedIS(RolloutCorrection):
    """Truncated importance sampling (TIS; Yao et al. 2025; verl ``rollout_is`` with a float threshold).

    ``w = min(rho, threshold)`` at ``level`` (``"token"``: verl ``rollout_is=token``, ``"sequence"``:
    ``rollout_is=sequence``; ``"geometric"`` is rlkit's). Metric ``truncated_fraction``: tokens whose
    weight was capped. verl's defaults: token level, threshold 2.0.

    Args:
        level: ``"token"``, ``"sequence"`` (product over the row) or ``"geometric"`` (geometric mean).
        threshold: the cap on the weight; > 0 (verl's docs: 1.5-5 per token, 2-10 per sequence).
        bypass: verl's bypass mode (see the module docstring).
    """

    def __init__(self, level: Level = "token", threshold: float = 2.0, bypass: bool = False):
        _check_level(level, "TruncatedIS")
        if not threshold > 0:
            raise ValueError(f"TruncatedIS threshold={threshold} must be > 0: the cap on pi/mu, e.g. 2.0.")
        self.level = level
        self.threshold = threshold
        self.bypass = bypass

    def __call__(self, log_prob: Tensor, rollout_log_prob: Tensor, mask: Tensor) -> CorrectionOutput:
        mask = mask.to(log_prob.dtype)  # [N, T]
        rho = torch.exp(_log_ratio(log_prob, rollout_log_prob, mask, self.level))  # [N, T]
        weights = torch.clamp(rho, max=self.threshold) * mask  # [N, T]
        valid = mask.bool()  # [N, T]
        metrics = _weight_metrics(weights, valid, rho > self.threshold, "truncated_fraction")
        return CorrectionOutput(weights=weights.detach(), keep=valid, metrics=metrics)


class IcePop(RolloutCorrection):
    """IcePop: the ratio as weight inside a two-sided band, 0 outside (Ling Team 2025, "Every Step Evolves:
    Scaling Reinforcement Learning for Trillion-Scale Thinking Model" (Ring-1T);
    verl ``rollout_is_threshold="lower_upper"``).

    ``w = rho * 1[lower <= rho <= upper]`` at ``level``. A zeroed token stays in the step's counts
    (verl: IcePop changes the weights, not the response mask). Metric ``masked_fraction``: tokens zeroed.
    Defaults are verl's example band ``0.5_5.0``.

    Args:
        level: ``"token"``, ``"sequence"`` or ``"geometric"``.
        lower: the smallest ratio kept; > 0.
        upper: the largest ratio kept; >= lower.
        bypass: verl's bypass mode (see the module docstring).
    """

    def __init__(self, level: Level = "token", lower: float = 0.5, upper: float = 5.0, bypass: bool = False):
        _check_level(level, "IcePop")
        _check_band(lower, upper, "IcePop", "lower=0.5, upper=5.0")
        self.level = level
        self.lower = lower
        self.upper = upper
        self.bypass = bypass

    def __call__(self, log_prob: Tensor, rollout_log_prob: Tensor, mask: Tensor) -> CorrectionOutput:
        mask = mask.to(log_prob.dtype)  # [N, T]
        rho = torch.exp(_log_ratio(log_prob, rollout_log_prob, mask, self.level))  # [N, T]
        inside = (rho >= self.lower) & (rho <= self.upper)  # [N, T]
        weights = torch.where(inside, rho, 0.0) * mask  # [N, T]
        valid = mask.bool()  # [N, T]
        metrics = _weight_metrics(weights, valid, ~inside, "masked_fraction")
        return CorrectionOutput(weights=weights.detach(), keep=valid, metrics=metrics)


class MaskedIS(RolloutCorrection):
    """Masked importance sampling: drop the tokens (or whole rows) whose ratio leaves a band; weight 1
    otherwise (verl ``rollout_rs`` ``token_k1``, ``seq_sum_k1``, ``seq_mean_k1``).

    A token is kept while ``lower <= rho <= upper`` at ``level``; a dropped token leaves the loss *and* the
    step's token/sequence counts (verl modifies the response mask). verl states the band on ``mu / pi``
    (its ``k1 = -log rho``): for a symmetric band (``lower = 1 / upper``) the two agree; otherwise rlkit's
    ``[lower, upper]`` on ``pi / mu`` is verl's ``[1/upper, 1/lower]``. Metric ``masked_fraction``: tokens
    dropped. verl's divergence filters on k2/k3 statistics are not offered (see README).

    Args:
        level: ``"token"``, ``"sequence"`` (product over the row) or ``"geometric"`` (geometric mean).
        lower: the smallest ratio kept; > 0.
        upper: the largest ratio kept; >= lower.
        bypass: verl's bypass mode (see the module docstring).
    """

    def __init__(self, level: Level = "token", lower: float = 0.5, upper: float = 2.0, bypass: bool = False):
        _check_level(level, "MaskedIS")
        _check_band(lower, upper, "MaskedIS", "lower=0.5, upper=2.0")
        self.level = level
        self.lower = lower
        self.upper = upper
        self.bypass = bypass

    def __call__(self, log_prob: Tensor, rollout_log_prob: Tensor, mask: Tensor) -> CorrectionOutput:
        mask = mask.to(log_prob.dtype)  # [N, T]
        rho = torch.exp(_log_ratio(log_prob, rollout_log_prob, mask, self.level))  # [N, T]
        valid = mask.bool()  # [N, T]
        keep = (rho >= self.lower) & (rho <= self.upper) & valid  # [N, T]
        weights = keep.to(mask.dtype)  # [N, T]
        metrics = _weight_metrics(weights, valid, ~keep, "masked_fraction")
        return CorrectionOutput(weights=weights, keep=keep, metrics=metrics)
