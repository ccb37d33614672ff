"""Distillation: on-policy distillation of a frozen teacher into the policy (the student).

The student samples completions; the teacher scores every token of them; the student moves towards the
teacher on its own distribution, the states it will actually visit (Agarwal et al. 2024, GKD; Gu et al.
2024, MiniLLM; Thinking Machines 2025, "On-Policy Distillation"). As a policy-gradient signal, the
advantage of token ``t`` is minus its distillation loss (``A_t = -D_t``, the one line verl's distillation
turns on), run through the usual ratio and clip; as a supervised loss, ``D_t`` is backpropagated directly.

The machinery is the :class:`~rlkit.spine.family.Spine` every family holds, and the policy-gradient
surrogate :class:`~rlkit.algorithms.surrogate.PolicyLoss`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlkit.algorithms.shaping import advantage_inputs
from rlkit.algorithms.surrogate import PolicyLoss
from rlkit.algorithms.teacher import load_teacher
from rlkit.components.advantage import Advantage
from rlkit.components.aggregation import Aggregation, StepTotals
from rlkit.components.base import Need
from rlkit.components.clip import Clip
from rlkit.components.distill import DistillationLoss, DistillInputs
from rlkit.components.ratio import Ratio
from rlkit.data.batch import Rollout
from rlkit.errors import ConfigError
from rlkit.models import ModelSource
from rlkit.spine.family import SPINE_PROVIDES, Family
from rlkit.spine.loop import LossInputs
from rlkit.spine.policy import TokenScores, score_in_micro_batches
from rlkit.spine.reporting import forward_metrics


class Distillation(Family):
    """On-policy distillation from a frozen teacher, optionally mixed with task rewards.

    Per token, with ``D_t`` the distillation loss of the rollout before the updates and ``A^task`` the
    task-reward advantage (the teacher scores at the rollout's sampling temperature, as the student):
    ``policy_gradient=True`` gives ``clip(ratio, A)`` with
    ``A = -D_t + reward_weight * A^task``; ``policy_gradient=False`` gives ``D_t(theta) +
    clip(ratio, reward_weight * A^task)``. Both are reduced by ``aggregation`` over the optimizer step.

    Args:
        loss: the per-token distillation loss (``ReverseKL`` with ``K1`` / ``K3``, ``TopKForwardKL``).
        ratio: the importance ratio of the policy-gradient surrogate (``TokenRatio``).
        clip: the clipped surrogate (``PPOClip``; ``NoClip``).
        aggregation: how per-token losses become the step's scalar (``TokenMean``, ...).
        policy_gradient: use ``-D_t`` as the advantage (True) or backpropagate ``D_t`` (False).
        reward_weight: weight of the task-reward advantage mixed in (0: pure distillation).
        advantage: the task-reward advantage estimator (e.g. ``GroupNorm``); needed when
            ``reward_weight > 0``.
        teacher: the teacher's local Hugging Face checkpoint directory, or a model source that builds one
            (``{class_path: rlkit.embedded.EmbeddedTeacher}``); it must share the student's tokenizer. Required.
        **shared: the settings every family shares (``policy``, the student's; ``loop``, ``optim``,
            ``samples_every``; see :class:`~rlkit.spine.family.Family`).
    """

    provides = SPINE_PROVIDES | {Need.TEACHER}

    def __init__(
        self,
        loss: DistillationLoss,
        ratio: Ratio,
        clip: Clip,
        aggregation: Aggregation,
        teacher: str | ModelSource | None = None,
        policy_gradient: bool = True,
        reward_weight: float = 0.0,
        advantage: Advantage | None = None,
        **shared,
    ) -> None:
        super().__init__(**shared)
        if reward_weight < 0:
            raise ConfigError(f"model.reward_weight must be >= 0, got {reward_weight}")
        if reward_weight > 0 and advantage is None:
            raise ConfigError(
                f"model.reward_weight={reward_weight} but model.advantage is null: name the task-reward "
                "estimator, e.g. --model.advantage=GroupNorm"
            )
        self.spine.declare(
            type(self), self.provides, loss=loss, ratio=ratio, clip=clip, aggregation=aggregation,
            advantage=advantage, policy_gradient=policy_gradient, reward_weight=reward_weight, teacher=teacher,
        )  # fmt: skip
        self.loss = loss
        self.policy_loss = PolicyLoss(ratio, clip, aggregation)
        self.policy_gradient = policy_gradient
        self.reward_weight = reward_weight
        self.advantage = advantage
        self.teacher = teacher

    def configure_family_models(self) -> None:
        trust = self.spine.policy_settings.trust_remote_code
        self.spine.frozen["teacher"] = load_teacher(self.teacher, self.policy, trust_remote_code=trust)

    def training_step(self, rollout: Rollout, batch_idx: int) -> None:
        spine = self.spine
        step = spine.begin(rollout)
        micro = list(spine.loop.micro_rollouts(rollout, torch.arange(len(rollout), device=self.device)))
        teacher = score_in_micro_batches(spine.frozen["teacher"], rollout, micro, top_k=self.loss.top_k)
        own = score_in_micro_batches(
            self.policy, rollout, micro, teacher.top_ids, entropy=True, raw=True,
            sum_pi_squared=Need.SUM_PI_SQUARED in spine.needs,
        )  # fmt: skip
        mask = rollout.completion_mask  # [N, T]
        distill = self.loss(_distill_inputs(own, teacher.logprobs, teacher.top_logprobs))  # [N, T]
        advantages = -distill * mask if self.policy_gradient else torch.zeros_like(mask)  # [N, T]
        if self.reward_weight > 0:
            task = advantage_inputs(self.advantage, rollout, spine.metrics, old_logprobs=own.logprobs, own=own)
            advantages = advantages + self.reward_weight * self.advantage(task)[0]  # [N, T]
        inputs = LossInputs(
            old_logprobs=own.logprobs,
            advantages=advantages,
            teacher_logprobs=teacher.logprobs,
            teacher_top_logprobs=teacher.top_logprobs,
            teacher_top_ids=teacher.top_ids,
        )
        step.lap("logprob")
        self._distill_metrics(own, teacher, distill, mask)
        forward_metrics(spine.metrics, mask, rollout.engine_logprobs, own.entropy, own.raw_logprobs)
        spine.update(self, rollout, inputs, self._micro_step)
        step.lap("update")
        spine.finish(self, step, advantages)

    def _micro_step(self, micro: Rollout, inputs: LossInputs, totals: StepTotals) -> tuple[Tensor, dict[str, Tensor]]:
        mask = micro.completion_mask  # [n, T]
        # the teacher's top-k ids are scored only when the loss itself is backpropagated
        scores = self.policy(micro, micro.temperature, ids=None if self.policy_gradient else inputs.teacher_top_ids)
        loss, terms = torch.zeros((), device=mask.device), {}
        if self.policy_gradient or self.reward_weight > 0:
            loss, terms = self.policy_loss(scores, inputs, mask, totals, self.spine.metrics)
        if not self.policy_gradient:
            current = _distill_inputs(scores, inputs.teacher_logprobs, inputs.teacher_top_logprobs)
            distill = self.policy_loss.aggregation(self.loss(current), mask, totals)  # D_t(theta) backpropagated
            loss, terms["loss/distill"] = loss + distill, distill.detach()
        if len(terms) > 1:
            terms["loss/total"] = loss.detach()
        return loss, terms

    @torch.no_grad()
    def _distill_metrics(self, own: TokenScores, teacher: TokenScores, distill: Tensor, mask: Tensor) -> None:
        """The rollout's distance to the teacher before the updates, per valid token."""
        metrics, valid = self.spine.metrics, mask.bool()  # [N, T]
        weight = valid.sum()
        if not weight:
            return
        log_ratio = (own.logprobs - teacher.logprobs)[valid]  # [tokens] log pi - log pi_T, y ~ pi
        metrics.update("distill/kl", log_ratio.mean(), weight)  # k1: unbiased reverse KL per token
        metrics.update("distill/kl_k3", (torch.expm1(-log_ratio) + log_ratio).mean(), weight)
        metrics.update("distill/teacher_logprob", teacher.logprobs[valid].mean(), weight)
        metrics.update("distill/loss", distill[valid].mean(), weight)
        if teacher.top_logprobs is not None:
            metrics.update("distill/teacher_top_mass", teacher.top_logprobs.exp().sum(-1)[valid].mean(), weight)
            metrics.update("distill/student_top_mass", own.logprobs_at_ids.exp().sum(-1)[valid].mean(), weight)


def _distill_inputs(scores: TokenScores, teacher_logprobs: Tensor, teacher_top: Tensor | None) -> DistillInputs:
    return DistillInputs(scores.logprobs, teacher_logprobs, scores.logprobs_at_ids, teacher_top)
