"""KL-divergence estimators between the policy and a reference policy, per token.

Schulman, "Approximating KL Divergence" (2020): k1, k2, k3 estimators of KL(pi || pi_ref), with
``log r = log pi_ref - log pi`` on tokens sampled from ``pi``.

``straight_through=True`` keeps the estimator's value but takes the gradient of k2
(``(1/2)(log pi - log pi_ref)^2``), whose gradient ``(log pi - log pi_ref) grad log pi`` is an
unbiased estimate of the gradient of KL(pi || pi_ref) when used as a loss (verl's ``k1+``, ``k3+``...).
"""

from __future__ import annotations

from abc import abstractmethod

import torch
from torch import Tensor

from rlkit.components.base import Component, Need


class KL(Component):
    """Base of every KL estimator: ``__call__(log_prob, ref_log_prob) -> [N, T]`` per-token estimate."""

    needs = frozenset({Need.REFERENCE})

    @abstractmethod
    def __call__(self, log_prob: Tensor, ref_log_prob: Tensor) -> Tensor: ...


def _straight_through(value: Tensor, log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    """The value of ``value`` with the gradient of k2 (verl's ``+`` forms)."""
    k2 = 0.5 * (log_prob - ref_log_prob).square()  # [N, T]
    return k2 - k2.detach() + value.detach()  # [N, T]


class K1(KL):
    """k1 = ``log pi - log pi_ref`` (unbiased, high variance, can be negative). verl ``k1``/``kl``.

    Args:
        straight_through: keep this value but take the gradient of k2 (verl ``k1+``).
    """

    def __init__(self, straight_through: bool = False):
        self.straight_through = straight_through

    def __call__(self, log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
        value = log_prob - ref_log_prob  # [N, T]
        return _straight_through(value, log_prob, ref_log_prob) if self.straight_through else value


class K2(KL):
    """k2 = ``(1/2)(log pi - log pi_ref)^2`` (biased, low variance). verl ``k2``/``mse``.

    Args:
        straight_through: no effect on k2 (it is its own gradient); accepted so every KL swaps alike.
    """

    def __init__(self, straight_through: bool = False):
        self.straight_through = straight_through

    def __call__(self, log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
        return 0.5 * (log_prob - ref_log_prob).square()  # [N, T]


class K3(KL):
    """k3 = ``r - log r - 1``, ``r = pi_ref / pi`` (unbiased, low variance, >= 0). verl ``k3``/``low_var_kl``.

    As verl, ``log r`` is clamped to [-20, 20] before ``exp`` and k3 to [-10, 10].

    Args:
        straight_through: keep this value but take the gradient of k2 (verl ``k3+``).
    """

    def __init__(self, straight_through: bool = False):
        self.straight_through = straight_through

    def __call__(self, log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
        log_r = torch.clamp(ref_log_prob - log_prob, min=-20.0, max=20.0)  # [N, T]
        value = torch.clamp(torch.exp(log_r) - log_r - 1.0, min=-10.0, max=10.0)  # [N, T]
        return _straight_through(value, log_prob, ref_log_prob) if self.straight_through else value


class AbsKL(KL):
    """``|log pi - log pi_ref|``. verl ``abs``.

    Args:
        straight_through: keep this value but take the gradient of k2 (verl ``abs+``).
    """

    def __init__(self, straight_through: bool = False):
        self.straight_through = straight_through

    def __call__(self, log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
        value = (log_prob - ref_log_prob).abs()  # [N, T]
        return _straight_through(value, log_prob, ref_log_prob) if self.straight_through else value
