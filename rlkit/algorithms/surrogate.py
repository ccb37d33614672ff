"""PolicyLoss: the clipped policy-gradient surrogate, shared by every family that trains a policy on advantages.

Per token ``clip(ratio(logp, logp_old), A) + kl_coef * kl(logp, logp_ref) - entropy_coef * H``, reduced by
``aggregation`` with the totals of the whole optimizer step. PolicyGradient minimises it alone, ActorCritic
adds its critic's value loss.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlkit.algorithms.loop import LossInputs
from rlkit.algorithms.metrics import StepMetrics
from rlkit.algorithms.policy import TokenScores
from rlkit.algorithms.reporting import settings
from rlkit.components.aggregation import Aggregation, StepTotals
from rlkit.components.clip import Clip
from rlkit.components.kl import KL
from rlkit.components.ratio import Ratio
from rlkit.errors import ConfigError


class PolicyLoss:
    """The policy's loss for one micro-batch, and the ratio/clip metrics of its tokens.

    Args:
        ratio: the importance ratio (``TokenRatio``; ``SequenceRatio`` for GSPO).
        clip: the clipped surrogate (``PPOClip``; ``NoClip``).
        aggregation: how per-token losses become the step's scalar (``TokenMean``, ...).
        kl: KL estimator against a frozen reference policy (None: no KL term).
        kl_coef: weight of the KL term in the loss.
        entropy_coef: weight of the entropy bonus (subtracted from the loss).
    """

    def __init__(
        self,
        ratio: Ratio,
        clip: Clip,
        aggregation: Aggregation,
        kl: KL | None = None,
        kl_coef: float = 0.0,
        entropy_coef: float = 0.0,
    ) -> None:
        if kl_coef < 0 or entropy_coef < 0:
            raise ConfigError("model.kl_coef and model.entropy_coef must be >= 0")
        if kl_coef > 0 and kl is None:
            raise ConfigError(f"model.kl_coef={kl_coef} but model.kl is null: name an estimator, e.g. --model.kl=K3")
        self.ratio = ratio
        self.clip = clip
        self.aggregation = aggregation
        self.kl = kl
        self.kl_coef = kl_coef
        self.entropy_coef = entropy_coef

    @property
    def needs_entropy(self) -> bool:
        """Whether the entropy enters the autograd graph (otherwise it is only a metric)."""
        return self.entropy_coef > 0

    def __call__(
        self, scores: TokenScores, inputs: LossInputs, mask: Tensor, totals: StepTotals, metrics: StepMetrics
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """``(loss, terms)``: the micro-batch's share of the step's policy loss and its named terms."""
        logprobs = scores.logprobs  # [n, T]
        ratio = self.ratio(logprobs, inputs.old_logprobs, mask)  # [n, T]
        clipped = self.clip(ratio, inputs.advantages, mask)
        loss_mat = clipped.loss  # [n, T]
        parts = {"loss/policy": clipped.loss}
        if self.kl is not None:
            kl_mat = self.kl(logprobs, inputs.ref_logprobs)  # [n, T]
            parts["loss/kl"] = kl_mat
            if self.kl_coef > 0:
                loss_mat = loss_mat + self.kl_coef * kl_mat  # [n, T]
        if self.entropy_coef > 0:
            parts["loss/entropy"] = scores.entropy
            loss_mat = loss_mat - self.entropy_coef * scores.entropy  # [n, T]
        loss = self.aggregation(loss_mat, mask, totals)
        terms = {name: self.aggregation(value.detach(), mask, totals) for name, value in parts.items()}
        ratio_metrics(metrics, ratio.detach(), logprobs.detach(), inputs.old_logprobs, mask, clipped.clipped)
        return loss, terms

    def settings(self) -> dict[str, object]:
        """The components and coefficients, for TensorBoard's HPARAMS tab."""
        params: dict[str, object] = {}
        for name in ("ratio", "clip", "aggregation", "kl"):
            params.update(settings(name, getattr(self, name)))
        params.update(kl_coef=self.kl_coef, entropy_coef=self.entropy_coef)
        return params


@torch.no_grad()
def ratio_metrics(metrics: StepMetrics, ratio: Tensor, logprobs: Tensor, old: Tensor, mask: Tensor, clipped: dict):
    """``ratio/*`` (mean, max, min, approx_kl) and ``clip/*`` fractions over the valid tokens of ``mask``."""
    valid = mask.bool()  # [n, T]
    weight = valid.sum()
    if not weight:
        return
    metrics.update("ratio/mean", ratio[valid].mean(), weight)
    metrics.update("ratio/max", ratio[valid].max(), reduce="max")
    metrics.update("ratio/min", ratio[valid].min(), reduce="min")
    # mean of log pi_old - log pi: verl's actor/ppo_kl
    metrics.update("ratio/approx_kl", (old - logprobs)[valid].mean(), weight)
    for name, where in clipped.items():
        metrics.update(f"clip/{name}", (where & valid).sum() / weight, weight)
