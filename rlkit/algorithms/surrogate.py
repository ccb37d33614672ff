"""PolicyLoss: the clipped policy-gradient surrogate, shared by every family that trains a policy on advantages.

Per token ``w * clip(ratio(logp, logp_old), logp, logp_old, A) + kl_coef * kl(logp, logp_ref) - entropy_coef * H``,
reduced by ``aggregation`` with the totals of the whole optimizer step; ``w`` is the rollout correction's weight
(1 without one). PolicyGradient minimises it alone, ActorCritic adds its critic's value loss.

Rollout correction (the ``rollout_correction`` component). Decoupled (the default): :func:`correct_rollout`
compares the trainer's recomputed old log-probs with the engine's once per rollout; the tokens it drops leave
the loss, the step's totals and the advantage's mask (verl's response mask). Bypass (``bypass=True``, verl's
bypass mode): the engine's log-probs are the old log-probs, the family skips the trainer's no-grad pass, and
the weights compare the current policy (detached) with the engine in each micro-batch; a token it drops gets
weight 0 but stays in the step's totals (they are fixed before the micro-batches run). Engines report
untempered log-probs, so a correction needs sampling temperature 1.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from rlkit.components.aggregation import Aggregation, StepTotals
from rlkit.components.clip import Clip, ClipInputs, SelectingClip
from rlkit.components.kl import KL
from rlkit.components.ratio import Ratio
from rlkit.components.rollout_correction import CorrectionOutput, RolloutCorrection
from rlkit.data.batch import Rollout
from rlkit.errors import ConfigError
from rlkit.spine.loop import LossInputs, PrepareStep, UpdateLoop
from rlkit.spine.metrics import StepMetrics
from rlkit.spine.policy import Policy, TokenScores, score_rollout


class PolicyLoss:
    """The policy's loss for one micro-batch, and the ratio/clip metrics of its tokens.

    Args:
        ratio: the importance ratio (``TokenRatio``; ``SequenceRatio`` for GSPO).
        clip: the clipped surrogate (``PPOClip``; ``NoClip``).
        aggregation: how per-token losses become the step's scalar (``TokenMean``, ...).
        kl: KL estimator against a frozen reference policy (None: no KL term).
        kl_coef: weight of the KL term in the loss.
        entropy_coef: weight of the entropy bonus (subtracted from the loss).
        rollout_correction: per-token weights for the engine/trainer mismatch (None: none); in bypass mode
            this loss computes them in each micro-batch.
    """

    def __init__(
        self,
        ratio: Ratio,
        clip: Clip,
        aggregation: Aggregation,
        kl: KL | None = None,
        kl_coef: float = 0.0,
        entropy_coef: float = 0.0,
        rollout_correction: RolloutCorrection | None = None,
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
        self.rollout_correction = rollout_correction

    @property
    def bypass(self) -> bool:
        """verl's bypass mode: the engine's log-probs are the old log-probs; no trainer pass before the update."""
        return self.rollout_correction is not None and self.rollout_correction.bypass

    @property
    def needs_entropy(self) -> bool:
        """Whether the entropy enters the autograd graph (otherwise it is only a metric)."""
        return self.entropy_coef > 0

    def __call__(
        self, scores: TokenScores, inputs: LossInputs, mask: Tensor, totals: StepTotals, metrics: StepMetrics
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """``(loss, terms)``: the micro-batch's share of the step's policy loss and its named terms."""
        logprobs = scores.logprobs  # [n, T]
        old = inputs.old_logprobs  # [n, T] the engine's in bypass mode
        ratio = self.ratio(logprobs, old, mask)  # [n, T]
        clipped = self.clip(ClipInputs(ratio, logprobs, old, inputs.advantages, mask, inputs.selected))
        weights = inputs.is_weights  # [n, T] or None
        if self.bypass:
            corrected = self.rollout_correction(logprobs.detach(), old, mask)
            correction_metrics(metrics, corrected, mask)
            weights = corrected.weights  # [n, T]
        policy_loss = clipped.loss if weights is None else clipped.loss * weights  # [n, T]
        loss_mat = policy_loss  # [n, T]
        parts = {"loss/policy": policy_loss}
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
        ratio_metrics(metrics, ratio.detach(), logprobs.detach(), old, mask, clipped.clipped)
        return loss, terms

    def step_selection(self, policy: Policy, rollout: Rollout, loop: UpdateLoop) -> PrepareStep | None:
        """For a :class:`SelectingClip`, the loop's ``prepare_step``: its selection over each optimizer step.

        The selection reads the current policy's log-probs of the step's rows. Before the rollout's first
        update they are the old log-probs (the same weights scored them); afterwards, and in bypass mode, one
        more no-grad pass over the step's rows computes them. Under data parallelism each rank selects over
        its own rows. The draw (Clip-Cov) is seeded by (loop seed, rollout, step): exact on resume.
        """
        if not isinstance(self.clip, SelectingClip):
            return None
        bypass = self.bypass

        def prepare(rows: Tensor, inputs: LossInputs, step: int) -> LossInputs:
            mask = rollout.completion_mask[rows]  # [n, T]
            old = inputs.old_logprobs[rows]  # [n, T]
            if step == 0 and not bypass:
                current = old  # [n, T]
            else:
                scores, _ = score_rollout(policy, rollout, loop.micro_rollouts(rollout, rows))
                current = scores.logprobs[rows]  # [n, T]
            ratio = self.ratio(current, old, mask).detach()  # [n, T]
            generator = torch.Generator().manual_seed(hash((loop.seed, rollout.iteration, step)) % 2**62)
            selected = torch.zeros_like(rollout.completion_mask, dtype=torch.bool)  # [N, T]
            selected[rows] = self.clip.select(ClipInputs(ratio, current, old, inputs.advantages[rows], mask), generator)
            return replace(inputs, selected=selected)

        return prepare


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


def correct_rollout(
    correction: RolloutCorrection | None, rollout: Rollout, old_logprobs: Tensor, metrics: StepMetrics
) -> tuple[Rollout, Tensor | None]:
    """Decoupled rollout correction, once per rollout: ``(rollout to train on, weights [N, T] or None)``.

    The weights compare the trainer's old log-probs with the engine's; the tokens the correction drops leave
    the returned rollout's completion mask, hence the loss, the step's totals and the advantage's mask. Without
    a correction, or in bypass mode (the loss computes its weights per micro-batch), the rollout is unchanged.
    """
    if correction is None or correction.bypass:
        return rollout, None
    mask = rollout.completion_mask  # [N, T]
    corrected = correction(old_logprobs, rollout.engine_logprobs, mask)
    correction_metrics(metrics, corrected, mask)
    return replace(rollout, completion_mask=mask * corrected.keep), corrected.weights


def check_temperature(correction: RolloutCorrection | None, rollout: Rollout) -> None:
    """A correction compares with the engine's log-probs, which engines report untempered."""
    if correction is not None and rollout.temperature != 1.0:
        raise ConfigError(
            f"model.rollout_correction compares the trainer's log-probs with the engine's, which engines report "
            f"untempered, but the rollout was sampled at temperature {rollout.temperature}: sample at "
            "data.engine.temperature=1.0, or set model.rollout_correction=null"
        )


@torch.no_grad()
def correction_metrics(metrics: StepMetrics, corrected: CorrectionOutput, mask: Tensor) -> None:
    """``rollout_correction/*``: token-weighted means, and the largest weight."""
    weight = mask.bool().sum()
    if not weight:
        return
    for name, value in corrected.metrics.items():
        if name == "weight_max":
            metrics.update(f"rollout_correction/{name}", value, reduce="max")
        else:
            metrics.update(f"rollout_correction/{name}", value, weight)
