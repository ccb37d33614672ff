"""Policy surrogates ("clips"): the per-token policy loss from the ratio, the log-probs and the advantages.

A clip sees :class:`ClipInputs`: the Ratio component's output *and* the log-probs it came from, so a
surrogate that weights ``log pi`` by a detached, clipped ratio (CISPO, DPPO) or penalises the
log-ratio (DRO, KL-Cov) needs no identity such as ``log r = log pi - log pi_old``.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

from rlkit.components.base import Component, Need


@dataclass
class ClipInputs:
    """What a clip sees for one micro-batch; every tensor is ``[n, T]``.

    Attributes:
        ratio: the Ratio component's output (carries the gradient; ``log pi`` itself for ``LogProb``).
        log_prob: ``log pi`` of the sampled tokens under the current policy (carries the gradient).
        old_log_prob: ``log pi_old``, the behaviour policy (the trainer's recompute; the engine's
            log-probs in bypass mode). No gradient.
        advantages: per-token advantages. No gradient.
        mask: completion mask, 1 where the token is in the loss.
        selected: tokens a step-level rule picked over the whole optimizer step (``SelectingClip.select``
            on the step, sliced to these rows); None: a selecting clip picks within these rows only.
    """

    ratio: Tensor
    log_prob: Tensor
    old_log_prob: Tensor
    advantages: Tensor
    mask: Tensor
    selected: Tensor | None = None


@dataclass
class ClipOutput:
    """Per-token loss ``[N, T]`` plus ``[N, T]`` boolean masks of where each clip was active.

    The masks let the caller report fractions over the whole optimizer step (mask-weighted),
    so the metric is correct however the step is split into micro-batches.
    """

    loss: Tensor
    clipped: dict[str, Tensor] = field(default_factory=dict)


class Clip(Component):
    """Base of every policy surrogate: ``__call__(inputs: ClipInputs) -> ClipOutput``.

    Attributes:
        clips: whether any of its ``clipped`` masks can be True (False: ``clip/*`` are 0 by construction
            and are not logged).
    """

    clips: ClassVar[bool] = True

    @abstractmethod
    def __call__(self, inputs: ClipInputs) -> ClipOutput: ...


class SelectingClip(Clip):
    """A surrogate that treats some tokens differently, chosen by a statistic of the whole batch.

    ``select(inputs, generator)`` returns the ``[N, T]`` boolean tokens chosen. The caller runs it once
    on the whole optimizer step (detached tensors) and passes the rows' slice as
    ``ClipInputs.selected``, so micro-batching does not change the choice. Without it the clip selects
    within the micro-batch it is given (verl's behaviour: its selection depends on the micro-batch).
    """

    needs = frozenset({Need.OLD_LOGPROBS})

    @abstractmethod
    def select(self, inputs: ClipInputs, generator: torch.Generator | None = None) -> Tensor: ...


def _check_eps(name: str, value: float, clip: str, hint: str) -> None:
    if not value > 0.0:
        raise ValueError(f"{clip} {name}={value} must be > 0: {hint}")


def _side_masks(fraction: Tensor, advantages: Tensor) -> dict[str, Tensor]:
    return {"fraction": fraction, "lower": fraction & (advantages < 0), "upper": fraction & (advantages > 0)}


class PPOClip(Clip):
    """PPO's clipped surrogate (Schulman et al. 2017), with clip-higher and dual-clip.

    ``loss = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))``; clip-higher (DAPO, Yu et al. 2025)
    is ``eps_high > eps_low``. Dual-clip (Ye et al. 2020) bounds the loss of negative advantages:
    ``loss = min(loss, -A c)`` where ``A < 0``.

    ``clipped`` masks: ``"fraction"`` where the clipped term is strictly larger (verl's
    ``actor/pg_clipfrac``), split into ``"lower"`` (``A < 0``, ``r < 1 - eps_low``) and ``"upper"``
    (``A > 0``, ``r > 1 + eps_high``); ``"dual"`` where the dual clip bounds the loss (verl's
    ``actor/pg_clipfrac_lower``).

    Args:
        eps_low: lower clip range, ``r >= 1 - eps_low``; in (0, 1).
        eps_high: upper clip range, ``r <= 1 + eps_high``; ``None`` means ``eps_low`` (symmetric).
        dual_clip: constant ``c > 1`` bounding the loss of negative advantages at ``-A c``;
            ``None`` disables it.
    """

    needs = frozenset({Need.RATIO})

    def __init__(self, eps_low: float = 0.2, eps_high: float | None = None, dual_clip: float | None = None):
        if not 0.0 < eps_low < 1.0:
            raise ValueError(
                f"PPOClip eps_low={eps_low} must be in (0, 1): the lower bound 1 - eps_low must stay "
                "positive; typical values are 0.1-0.3."
            )
        if eps_high is not None:
            _check_eps("eps_high", eps_high, "PPOClip", "e.g. 0.28 for DAPO's clip-higher, or None for eps_low.")
        if dual_clip is not None and not dual_clip > 1.0:
            raise ValueError(
                f"PPOClip dual_clip={dual_clip} must be > 1 (the bound is -A * c with c > 1, e.g. 3.0), "
                "or None to disable dual-clip."
            )
        self.eps_low = eps_low
        self.eps_high = eps_low if eps_high is None else eps_high
        self.dual_clip = dual_clip

    def __call__(self, inputs: ClipInputs) -> ClipOutput:
        ratio, advantages = inputs.ratio, inputs.advantages  # [N, T]
        unclipped = -advantages * ratio  # [N, T]
        clipped = -advantages * torch.clamp(ratio, 1.0 - self.eps_low, 1.0 + self.eps_high)  # [N, T]
        loss = torch.maximum(unclipped, clipped)  # [N, T]
        valid = inputs.mask.bool()  # [N, T]
        fraction = (clipped > unclipped) & valid  # [N, T]
        negative = advantages < 0  # [N, T]
        if self.dual_clip is not None:
            bound = -advantages * self.dual_clip  # [N, T]
            dual = (loss > bound) & negative & valid  # [N, T]
            loss = torch.where(negative, torch.minimum(loss, bound), loss)  # [N, T]
        else:
            dual = torch.zeros_like(valid)  # [N, T]
        return ClipOutput(loss=loss, clipped={**_side_masks(fraction, advantages), "dual": dual})


class NoClip(Clip):
    """The unclipped surrogate ``-A r`` (REINFORCE, GPG with ``LogProb``); all clip masks are False."""

    clips = False

    def __call__(self, inputs: ClipInputs) -> ClipOutput:
        loss = -inputs.advantages * inputs.ratio  # [N, T]
        never = torch.zeros_like(loss, dtype=torch.bool)  # [N, T]
        return ClipOutput(loss=loss, clipped={"fraction": never, "lower": never, "upper": never, "dual": never})


class CISPO(Clip):
    """CISPO: clipped importance-sampling weight on the log-prob (MiniMax-M1, arXiv:2506.13585).

    ``loss = -sg[clip(r, 1 - eps_low, 1 + eps_high)] * A * log pi``: the ratio only weights the token
    (its gradient is stopped), so every token keeps a gradient ``-w A grad log pi``, unlike PPO's clip
    that zeroes it. The weight is the Ratio component's value: ``TokenRatio`` is verl's ``cispo``;
    ``SequenceRatio`` weights every token of a row by its clipped sequence ratio.

    verl's default range is ``eps_low = eps_high = 0.2`` (its ``ActorConfig``); the paper drops the lower
    bound and tunes the upper one, as verl's example does with ``eps_low=10`` (bound below 0: none) and
    ``eps_high=0.2``. ``clipped``: ``"fraction"`` where the weight was clipped (verl's
    ``actor/pg_clipfrac``), ``"lower"``/``"upper"`` by side of the range.

    Args:
        eps_low: the weight is at least ``1 - eps_low``; > 0 (``>= 1``: no lower bound above 0).
        eps_high: the weight is at most ``1 + eps_high``; > 0.
    """

    needs = frozenset({Need.RATIO})

    def __init__(self, eps_low: float = 0.2, eps_high: float = 0.2):
        _check_eps("eps_low", eps_low, "CISPO", "the weight's lower bound is 1 - eps_low; >= 1 disables it.")
        _check_eps("eps_high", eps_high, "CISPO", "the weight's upper bound is 1 + eps_high (e.g. 0.2-5).")
        self.eps_low = eps_low
        self.eps_high = eps_high

    def __call__(self, inputs: ClipInputs) -> ClipOutput:
        ratio = inputs.ratio.detach()  # [N, T]
        low, high = 1.0 - self.eps_low, 1.0 + self.eps_high
        weight = torch.clamp(ratio, low, high)  # [N, T]
        loss = -weight * inputs.advantages * inputs.log_prob  # [N, T]
        valid = inputs.mask.bool()  # [N, T]
        lower = (ratio < low) & valid  # [N, T]
        upper = (ratio > high) & valid  # [N, T]
        return ClipOutput(loss=loss, clipped={"fraction": lower | upper, "lower": lower, "upper": upper})


class SAPO(Clip):
    """SAPO: soft adaptive policy optimisation (Gao et al. 2025, arXiv:2511.20347).

    A smooth gate replaces the hard clip: ``loss = -A f_tau(r)`` with ``f_tau(r) = (4 / tau)
    sigmoid(tau (r - 1))``, ``tau = tau_pos`` where ``A > 0`` else ``tau_neg``. ``f'(1) = 1``: on-policy
    it is the plain policy gradient; far off-policy the gradient ``f'(r) = 4 s (1 - s)`` fades smoothly.
    verl forces ``seq-mean-token-mean`` aggregation for SAPO; in rlkit the aggregation stays its own
    component (the preset names ``SeqMeanTokenMean``). Defaults are verl's and the paper's (1.0, 1.05).
    No clip is active: ``clipped["fraction"]`` is all False.

    Args:
        tau_pos: gate temperature for positive advantages; > 0 (larger: a sharper trust region).
        tau_neg: gate temperature for zero and negative advantages; > 0.
    """

    needs = frozenset({Need.RATIO})
    clips = False

    def __init__(self, tau_pos: float = 1.0, tau_neg: float = 1.05):
        _check_eps("tau_pos", tau_pos, "SAPO", "the gate temperature for positive advantages (paper: 1.0).")
        _check_eps("tau_neg", tau_neg, "SAPO", "the gate temperature for negative advantages (paper: 1.05).")
        self.tau_pos = tau_pos
        self.tau_neg = tau_neg

    def __call__(self, inputs: ClipInputs) -> ClipOutput:
        advantages = inputs.advantages  # [N, T]
        tau = torch.where(advantages > 0, self.tau_pos, self.tau_neg).to(advantages.dtype)  # [N, T]
        gate = torch.sigmoid(tau * (inputs.ratio - 1.0)) * (4.0 / tau)  # [N, T]
        loss = -gate * advantages  # [N, T]
        return ClipOutput(loss=loss, clipped={"fraction": torch.zeros_like(inputs.mask, dtype=torch.bool)})


class DRO(Clip):
    """DRO: the surrogate with a quadratic log-ratio penalty instead of a clip (Richemond et al. 2024,
    "Offline Regularised RL for LLM Alignment", arXiv:2405.19107; verl's ``dro``).

    ``loss = -A r + (beta / 2) (log pi - log pi_old)^2``. With ``LogProb`` as the ratio (``r = log pi``)
    this is verl's ``dro`` loss ``-(A log pi - beta/2 (log pi - log pi_old)^2)``; with ``TokenRatio`` it
    is PPO's unclipped surrogate held near ``pi_old`` by the penalty. Nothing is clipped.

    Args:
        beta: weight of the penalty; > 0 (verl requires a positive ``dro_beta``; it has no default).
    """

    clips = False

    def __init__(self, beta: float = 0.1):
        _check_eps("beta", beta, "DRO", "the weight of the quadratic log-ratio penalty, e.g. 0.1.")
        self.beta = beta

    def __call__(self, inputs: ClipInputs) -> ClipOutput:
        log_ratio = inputs.log_prob - inputs.old_log_prob  # [N, T]
        loss = -inputs.advantages * inputs.ratio + 0.5 * self.beta * log_ratio.square()  # [N, T]
        return ClipOutput(loss=loss, clipped={"fraction": torch.zeros_like(inputs.mask, dtype=torch.bool)})
