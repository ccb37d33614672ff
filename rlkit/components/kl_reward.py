"""KL in the reward: a per-token penalty ``-beta * kl(pi_old, pi_ref)`` added to the token rewards.

The alternative to a KL term in the loss (``kl``/``kl_coef`` of a family): InstructGPT's PPO (Ouyang et al.
2022) and verl's ``compute_rewards`` / ``apply_kl_penalty`` shape the reward instead,
``r_t = score * [t = last] - beta * kl_t``, with ``kl_t`` estimated on the sampled tokens from the log-probs
before the update and a frozen reference's. ``beta`` is fixed or adapted towards a target KL (Ziegler et al.
2019, "Fine-Tuning Language Models from Human Preferences").
"""

from __future__ import annotations

from abc import abstractmethod

import torch
from torch import Tensor

from rlkit.components.base import Component, Need
from rlkit.components.kl import KL


class KLController(Component):
    """Base of KL coefficients: ``coef`` (the current ``beta``) and ``update(current_kl, n_steps)`` after each
    rollout. ``coef`` is a plain float: the family checkpoints it for exact resume."""

    coef: float

    @abstractmethod
    def update(self, current_kl: float, n_steps: int) -> None:
        """Adapt ``coef`` after a rollout of ``n_steps`` sequences whose mean per-sequence KL was ``current_kl``."""


def _check_coef(coef: float, controller: str) -> None:
    if not coef >= 0:
        raise ValueError(f"{controller} coef={coef} must be >= 0 (e.g. 0.001, verl's default; 0.02 in InstructGPT)")


class FixedKLController(KLController):
    """A constant ``beta`` (verl ``FixedKLController``).

    Args:
        coef: ``beta``, the weight of the per-token KL subtracted from the reward.
    """

    def __init__(self, coef: float = 0.001) -> None:
        _check_coef(coef, "FixedKLController")
        self.coef = coef

    def update(self, current_kl: float, n_steps: int) -> None:
        return None


class AdaptiveKLController(KLController):
    """``beta`` steered towards a target KL (Ziegler et al. 2019; verl ``AdaptiveKLController``).

    ``e = clip(KL / target_kl - 1, -0.2, 0.2)``, ``beta <- beta * (1 + e * n_steps / horizon)``: a KL above
    the target raises ``beta``, one below lowers it, by at most 20% per ``horizon`` sequences.

    Worked example (coef 0.2, target 6, horizon 10000, 256 sequences): KL 0 gives ``e = -0.2`` and
    ``beta = 0.2 * (1 - 0.2 * 0.0256) = 0.198976``; KL 6 leaves ``beta`` unchanged.

    Args:
        coef: the initial ``beta`` (verl ``init_kl_coef``).
        target_kl: the KL per sequence to steer towards (verl ``target_kl``).
        horizon: sequences over which ``beta`` may change by 20% (verl ``horizon``).
    """

    def __init__(self, coef: float = 0.001, target_kl: float = 0.1, horizon: int = 10000) -> None:
        _check_coef(coef, "AdaptiveKLController")
        if not target_kl > 0:
            raise ValueError(f"AdaptiveKLController target_kl={target_kl} must be > 0 (e.g. 6.0 as in Ziegler et al.)")
        if horizon < 1:
            raise ValueError(f"AdaptiveKLController horizon={horizon} must be >= 1 sequences (e.g. 10000)")
        self.coef = coef
        self.target_kl = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)
        self.coef = self.coef * (1.0 + error * n_steps / self.horizon)


class KLPenalty(Component):
    """Subtract ``coef * kl(logp_old, logp_ref)`` from every completion token's reward (verl ``compute_rewards``).

    ``__call__(token_rewards, old_logprobs, ref_logprobs, mask) -> (rewards, kl)``, all ``[N, T]``; ``kl`` is
    zero outside the mask. The controller's current ``coef`` is used; the family updates it afterwards with
    the rollout's mean per-sequence KL (verl ``apply_kl_penalty``).

    Args:
        kl: the per-token estimator (``K1``, verl's default ``kl``; ``K3``, verl's ``low_var_kl``).
        controller: the coefficient, ``FixedKLController`` or ``AdaptiveKLController``.
    """

    needs = frozenset({Need.OLD_LOGPROBS, Need.REFERENCE})

    def __init__(self, kl: KL, controller: KLController) -> None:
        self.kl = kl
        self.controller = controller

    @torch.no_grad()
    def __call__(
        self, token_rewards: Tensor, old_logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor
    ) -> tuple[Tensor, Tensor]:
        kl = self.kl(old_logprobs, ref_logprobs) * mask  # [N, T]
        return token_rewards - self.controller.coef * kl, kl  # [N, T], [N, T]
