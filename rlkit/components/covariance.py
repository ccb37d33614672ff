"""Clip-Cov and KL-Cov: treat the few tokens whose log-prob covaries most with the advantage apart.

Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models"
(arXiv:2505.22617): entropy collapses through tokens with a large covariance
``cov_t = (A_t - mean A) (log pi_t - mean log pi)`` (means over the valid tokens). Clip-Cov removes a
random few of them from the loss; KL-Cov adds a KL penalty on the top few.

Which tokens are chosen depends on the whole batch (its means, its token count, its ranking). Both
are :class:`SelectingClip`: the caller runs ``select`` once on the whole optimizer step (current
log-probs, detached) and passes the rows' slice as ``ClipInputs.selected``, so the loss does not depend
on the micro-batching. verl selects within each micro-batch; given one micro-batch the two agree. Under
data parallelism each rank selects over its own share of the step (means and counts are per rank).
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlkit.components.base import Need
from rlkit.components.clip import ClipInputs, ClipOutput, SelectingClip, _check_eps, _side_masks

#: log-ratios at most this far from 0 count as 0 in KL-Cov's penalty (float rounding, not a policy change)
ROUNDING = 1e-5


def _covariance(inputs: ClipInputs) -> tuple[Tensor, Tensor]:
    """``cov_t`` on every token ``[N, T]`` (detached; means over the valid tokens) and the valid mask."""
    valid = inputs.mask.bool()  # [N, T]
    count = valid.sum().clamp(min=1)  # []
    advantages = inputs.advantages.detach()  # [N, T]
    log_prob = inputs.log_prob.detach()  # [N, T]
    mean_advantage = torch.where(valid, advantages, 0.0).sum() / count  # []
    mean_log_prob = torch.where(valid, log_prob, 0.0).sum() / count  # []
    return (advantages - mean_advantage) * (log_prob - mean_log_prob), valid  # [N, T], [N, T]


def _how_many(fraction: float, valid: Tensor) -> int:
    return max(int(fraction * int(valid.sum())), 1)


def _check_fraction(fraction: float, clip: str) -> None:
    if not 0.0 < fraction <= 1.0:
        raise ValueError(
            f"{clip} select_fraction={fraction} must be in (0, 1]: the share of the step's tokens chosen "
            "(the paper's default 2e-4)."
        )


class ClipCov(SelectingClip):
    """Clip-Cov (Cui et al. 2025; verl ``clip_cov``): PPO's clip, and a random few high-covariance
    tokens dropped from the loss.

    Candidates are the valid tokens PPO's clip left alone with ``cov_lower < cov_t < cov_upper``; of them
    ``max(1, int(select_fraction * valid tokens))`` are drawn uniformly (``torch.randperm`` with the
    given generator; without one, a generator seeded with ``seed``, which reproduces verl run under
    ``torch.manual_seed(seed)``). The rest get ``max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))`` (no
    dual clip, as verl). verl's ``clip_cov`` does not clamp the log-ratio: ``TokenRatio(max_abs_log_ratio=
    null)`` reproduces it. Defaults are verl's ``ActorConfig`` (2e-4, 1, 5).

    ``clipped``: ``"fraction"``/``"lower"``/``"upper"`` PPO's clip as in ``PPOClip``; ``"selected"`` the
    dropped tokens (verl's ``actor/pg_clipfrac``).

    Args:
        eps_low: PPO's lower clip range; in (0, 1).
        eps_high: PPO's upper clip range; > 0.
        select_fraction: share of the step's valid tokens dropped, in (0, 1].
        cov_lower: candidates have a covariance above this.
        cov_upper: candidates have a covariance below this.
        seed: seeds the draw when the caller passes no generator.
    """

    needs = frozenset({Need.OLD_LOGPROBS, Need.RATIO})

    def __init__(
        self,
        eps_low: float = 0.2,
        eps_high: float = 0.2,
        select_fraction: float = 2e-4,
        cov_lower: float = 1.0,
        cov_upper: float = 5.0,
        seed: int = 0,
    ):
        if not 0.0 < eps_low < 1.0:
            raise ValueError(f"ClipCov eps_low={eps_low} must be in (0, 1) so that 1 - eps_low stays positive.")
        _check_eps("eps_high", eps_high, "ClipCov", "PPO's upper clip range, e.g. 0.2.")
        _check_fraction(select_fraction, "ClipCov")
        if not cov_lower < cov_upper:
            raise ValueError(
                f"ClipCov cov_lower={cov_lower} must be below cov_upper={cov_upper}: candidates lie between them."
            )
        self.eps_low = eps_low
        self.eps_high = eps_high
        self.select_fraction = select_fraction
        self.cov_lower = cov_lower
        self.cov_upper = cov_upper
        self.seed = seed

    def _ppo(self, inputs: ClipInputs) -> tuple[Tensor, Tensor, Tensor]:
        unclipped = -inputs.advantages * inputs.ratio  # [N, T]
        clipped = -inputs.advantages * torch.clamp(inputs.ratio, 1.0 - self.eps_low, 1.0 + self.eps_high)  # [N, T]
        return unclipped, clipped, (clipped > unclipped) & inputs.mask.bool()  # [N, T] x 3

    def select(self, inputs: ClipInputs, generator: torch.Generator | None = None) -> Tensor:
        cov, valid = _covariance(inputs)  # [N, T]
        _, _, by_ppo = self._ppo(inputs)  # [N, T]
        candidates = (cov > self.cov_lower) & (cov < self.cov_upper) & valid & ~by_ppo.detach()  # [N, T]
        where = candidates.nonzero()  # [K, 2] in row-major order, as verl
        if generator is None:
            generator = torch.Generator().manual_seed(self.seed)
        order = torch.randperm(len(where), generator=generator).to(where.device)  # [K]
        chosen = where[order[: _how_many(self.select_fraction, valid)]]  # [k, 2]
        selected = torch.zeros_like(valid)  # [N, T]
        selected[chosen[:, 0], chosen[:, 1]] = True
        return selected

    def __call__(self, inputs: ClipInputs) -> ClipOutput:
        selected = self.select(inputs) if inputs.selected is None else inputs.selected.bool()  # [N, T]
        unclipped, clipped, by_ppo = self._ppo(inputs)  # [N, T]
        loss = torch.maximum(unclipped, clipped) * (~selected).to(unclipped.dtype)  # [N, T]
        return ClipOutput(
            loss=loss, clipped={**_side_masks(by_ppo, inputs.advantages), "selected": selected & inputs.mask.bool()}
        )


class KLCov(SelectingClip):
    """KL-Cov (Cui et al. 2025; verl ``kl_cov``): the unclipped surrogate ``-A r``, plus
    ``coef * |log pi - log pi_old|`` on the ``max(1, int(select_fraction * valid tokens))`` tokens of
    largest covariance.

    verl's ``kl_cov`` does not clamp the log-ratio: ``TokenRatio(max_abs_log_ratio=null)`` reproduces it.
    Defaults are verl's ``ActorConfig`` (``kl_cov_ratio`` 2e-4, ``ppo_kl_coef`` 0.1; the loss function's
    own fallback for the coefficient is 1.0). ``clipped``: ``"selected"`` the penalised tokens.

    Args:
        select_fraction: share of the step's valid tokens penalised, in (0, 1].
        coef: weight of the absolute log-ratio penalty; >= 0.
    """

    def __init__(self, select_fraction: float = 2e-4, coef: float = 0.1):
        _check_fraction(select_fraction, "KLCov")
        if coef < 0:
            raise ValueError(f"KLCov coef={coef} must be >= 0: the weight of |log pi - log pi_old| (verl: 0.1).")
        self.select_fraction = select_fraction
        self.coef = coef

    def select(self, inputs: ClipInputs, generator: torch.Generator | None = None) -> Tensor:
        cov, valid = _covariance(inputs)  # [N, T]
        flat_valid = valid.flatten().nonzero().squeeze(-1)  # [K] positions of valid tokens, row-major
        if flat_valid.numel() == 0:
            return valid  # no token to choose: all False
        top = torch.topk(cov.flatten()[flat_valid], _how_many(self.select_fraction, valid)).indices  # [k]
        selected = torch.zeros_like(valid).flatten()  # [N * T]
        selected[flat_valid[top]] = True
        return selected.view_as(valid)  # [N, T]

    def __call__(self, inputs: ClipInputs) -> ClipOutput:
        selected = self.select(inputs) if inputs.selected is None else inputs.selected.bool()  # [N, T]
        distance = (inputs.log_prob - inputs.old_log_prob).abs()  # [N, T]
        # On-policy the two log-probs differ only by rounding (two forward passes of other shapes), and the
        # gradient of |x| there would be the sign of that noise: a random +-coef * grad log pi. Below
        # ROUNDING the penalty and its gradient are 0 (a value at most coef * 1e-5 off verl's).
        penalty = self.coef * torch.where(distance > ROUNDING, distance, 0.0)  # [N, T]
        loss = -inputs.advantages * inputs.ratio + torch.where(selected, penalty, 0.0)  # [N, T]
        return ClipOutput(loss=loss, clipped={"selected": selected & inputs.mask.bool()})
