"""DPPO: a trust region on the probability of the sampled token instead of a clip on the ratio.

Rethinking the trust region (arXiv:2602.04879, verl's ``dppo_tv`` and ``dppo_kl``): a token whose
probability moved too far from ``pi_old`` *in the direction its advantage pushes* is dropped from the
loss; the others keep the truncated-IS gradient ``-sg[min(r, c)] A grad log pi``:

    loss = -A * sg[min(r, c)] * log pi * valid,   valid = detached trust-region test

The weight is the Ratio component's value (``TokenRatio`` is verl's). ``c = truncation``: verl's
``ActorConfig`` default ``clip_ratio_c = 3.0`` is what a verl user gets, although the loss function's
own fallback and the paper (its Section 5.4) recommend a large cap such as 20 to keep truncation bias
small; rlkit follows verl's number and the presets say which they use.

``clipped``: ``"fraction"`` tokens outside the trust region (verl's ``actor/pg_clipfrac``), split
into ``"lower"`` (``A <= 0`` side) and ``"upper"`` (``A > 0``); ``"truncated"`` valid tokens whose
weight was capped at ``c`` (verl's ``actor/pg_clipfrac_lower``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlkit.components.base import Need
from rlkit.components.clip import Clip, ClipInputs, ClipOutput, _check_eps


def _trust_region_loss(inputs: ClipInputs, valid_region: Tensor, truncation: float) -> ClipOutput:
    """``-A sg[min(r, c)] log pi`` on the tokens inside the trust region; the DPPO masks."""
    ratio = inputs.ratio.detach()  # [N, T]
    valid_region = valid_region.detach()  # [N, T] bool
    weight = torch.clamp(ratio, max=truncation)  # [N, T]
    loss = -inputs.advantages * weight * inputs.log_prob * valid_region.to(ratio.dtype)  # [N, T]
    valid = inputs.mask.bool()  # [N, T]
    outside = ~valid_region & valid  # [N, T]
    positive = inputs.advantages > 0  # [N, T]
    return ClipOutput(
        loss=loss,
        clipped={
            "fraction": outside,
            "lower": outside & ~positive,
            "upper": outside & positive,
            "truncated": (ratio > truncation) & valid_region & valid,
        },
    )


def _check(name: str, eps_low: float, eps_high: float, truncation: float) -> None:
    _check_eps("eps_low", eps_low, name, "the divergence allowed where A <= 0 (verl's default 0.2).")
    _check_eps("eps_high", eps_high, name, "the divergence allowed where A > 0 (verl's default 0.2).")
    _check_eps("truncation", truncation, name, "the cap c on the detached ratio weight, e.g. 3 or 20.")


class DPPOBinaryTV(Clip):
    """DPPO-Binary-TV: the trust region on ``p - p_old`` of the sampled token (verl ``dppo_tv``).

    A token with ``A > 0`` stays while ``p - p_old <= eps_high``; with ``A <= 0`` while
    ``p - p_old >= -eps_low`` (``p = pi(y_t)``, ``p_old = pi_old(y_t)``). See the module docstring.

    Args:
        eps_low: the total-variation step allowed downwards (``A <= 0``); > 0.
        eps_high: the total-variation step allowed upwards (``A > 0``); > 0.
        truncation: cap ``c`` of the detached ratio weight (verl's default 3.0; the paper: large, ~20).
    """

    needs = frozenset({Need.RATIO})

    def __init__(self, eps_low: float = 0.2, eps_high: float = 0.2, truncation: float = 3.0):
        _check("DPPOBinaryTV", eps_low, eps_high, truncation)
        self.eps_low = eps_low
        self.eps_high = eps_high
        self.truncation = truncation

    def __call__(self, inputs: ClipInputs) -> ClipOutput:
        step = torch.exp(inputs.log_prob) - torch.exp(inputs.old_log_prob)  # [N, T] p - p_old
        valid_region = torch.where(inputs.advantages > 0, step <= self.eps_high, step >= -self.eps_low)  # [N, T]
        return _trust_region_loss(inputs, valid_region, self.truncation)


class DPPOBinaryKL(Clip):
    """DPPO-Binary-KL: the trust region on the KL between the Bernoulli pair ``(p_old, 1 - p_old)`` and
    ``(p, 1 - p)`` of the sampled token (verl ``dppo_kl``).

    ``kl = p_old log(p_old / p) + (1 - p_old) log((1 - p_old + 1e-8) / (1 - p + 1e-8))``. A token with
    ``A > 0`` stays while ``kl <= eps_high`` or ``p <= p_old`` (it moved against its advantage's push);
    with ``A <= 0`` while ``kl <= eps_low`` or ``p >= p_old``. See the module docstring.

    Args:
        eps_low: the binary KL allowed where ``A <= 0``; > 0.
        eps_high: the binary KL allowed where ``A > 0``; > 0.
        truncation: cap ``c`` of the detached ratio weight (verl's default 3.0; the paper: large, ~20).
    """

    needs = frozenset({Need.RATIO})

    def __init__(self, eps_low: float = 0.2, eps_high: float = 0.2, truncation: float = 3.0):
        _check("DPPOBinaryKL", eps_low, eps_high, truncation)
        self.eps_low = eps_low
        self.eps_high = eps_high
        self.truncation = truncation

    def __call__(self, inputs: ClipInputs) -> ClipOutput:
        log_p, log_p_old = inputs.log_prob, inputs.old_log_prob  # [N, T]
        p, p_old = torch.exp(log_p), torch.exp(log_p_old)  # [N, T]
        kl = p_old * (log_p_old - log_p) + (1.0 - p_old) * torch.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))  # [N, T]
        keep_positive = (kl <= self.eps_high) | (p <= p_old)  # [N, T]
        keep_negative = (kl <= self.eps_low) | (p >= p_old)  # [N, T]
        valid_region = torch.where(inputs.advantages > 0, keep_positive, keep_negative)  # [N, T]
        return _trust_region_loss(inputs, valid_region, self.truncation)
