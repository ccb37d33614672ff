"""PolicyGradient: the critic-free family (GRPO, Dr.GRPO, GSPO, DAPO, RLOO, REINFORCE++, ReMax, OPO, GPG).

The module is its loss and what the loss needs; the machinery every family shares is the
:class:`~rlkit.spine.family.Spine` (policy, update loop, metrics, the engine seam, held-out evaluation).
"""

from __future__ import annotations

from dataclasses import replace

from torch import Tensor

from rlkit.algorithms.shaping import KLInReward, advantage_inputs
from rlkit.algorithms.surrogate import PolicyLoss, check_temperature, correct_rollout
from rlkit.components.advantage import Advantage
from rlkit.components.aggregation import Aggregation, StepTotals
from rlkit.components.clip import Clip
from rlkit.components.kl import KL
from rlkit.components.kl_reward import KLPenalty
from rlkit.components.ratio import Ratio
from rlkit.components.rollout_correction import RolloutCorrection
from rlkit.data.batch import Rollout
from rlkit.spine.family import Family
from rlkit.spine.loop import LossInputs
from rlkit.spine.reporting import forward_metrics


class PolicyGradient(Family):
    """Critic-free policy-gradient training of a causal LM from scored rollouts.

    The loss per token is ``w * clip(ratio(logp, logp_old), logp, logp_old, A) + kl_coef * kl(logp, logp_ref)
    - entropy_coef * H``, reduced by ``aggregation`` over the whole optimizer step; ``w`` is the rollout
    correction's weight (see :mod:`rlkit.algorithms.surrogate` for decoupled and bypass mode).

    Args:
        advantage: the advantage estimator (e.g. ``GroupNorm`` for GRPO, ``GroupMean`` for Dr.GRPO).
        ratio: the importance ratio (``TokenRatio``; ``SequenceRatio`` for GSPO).
        clip: the clipped surrogate (``PPOClip``; ``NoClip``).
        aggregation: how per-token losses become the step's scalar (``TokenMean``, ...).
        kl: KL estimator against a frozen reference policy, a term in the loss (None: no KL term).
        kl_coef: weight of the KL term in the loss.
        kl_in_reward: a KL penalty in the reward instead (``KLPenalty``: estimator and fixed or adaptive
            coefficient, InstructGPT / verl ``use_kl_in_reward``). A reference model is loaded when either is set.
        entropy_coef: weight of the entropy bonus (subtracted from the loss).
        rollout_correction: per-token weights for the engine/trainer mismatch (``TruncatedIS``, ``IcePop``,
            ``MaskedIS``; ``NoCorrection(bypass=true)`` for verl's bypass PPO-clip); None: none.
        **shared: the settings every family shares (``policy``, ``loop``, ``optim``, ``samples_every``; see
            :class:`~rlkit.spine.family.Family`).
    """

    def __init__(
        self,
        advantage: Advantage,
        ratio: Ratio,
        clip: Clip,
        aggregation: Aggregation,
        kl: KL | None = None,
        kl_coef: float = 0.0,
        kl_in_reward: KLPenalty | None = None,
        entropy_coef: float = 0.0,
        rollout_correction: RolloutCorrection | None = None,
        **shared,
    ) -> None:
        super().__init__(**shared)
        self.spine.declare(
            type(self), self.provides, advantage=advantage, ratio=ratio, clip=clip, aggregation=aggregation, kl=kl,
            kl_coef=kl_coef, kl_in_reward=kl_in_reward, entropy_coef=entropy_coef,
            rollout_correction=rollout_correction,
        )  # fmt: skip
        self.advantage = advantage
        self.policy_loss = PolicyLoss(ratio, clip, aggregation, kl, kl_coef, entropy_coef, rollout_correction)
        self.kl_in_reward = KLInReward(kl_in_reward) if kl_in_reward is not None else None

    def training_step(self, rollout: Rollout, batch_idx: int) -> None:
        spine, correction = self.spine, self.policy_loss.rollout_correction
        step = spine.begin(rollout)
        check_temperature(correction, rollout)
        own, frozen = spine.score_before_updates(self, rollout)
        if own is not None:
            mask = rollout.completion_mask  # [N, T]
            forward_metrics(spine.metrics, mask, rollout.engine_logprobs, own.entropy, own.raw_logprobs)
        old = spine.old_logprobs_of(rollout, own)  # [N, T]; None: the update's own forward gives them
        reference = frozen.get("reference")  # [N, T] or None
        trained, is_weights = correct_rollout(correction, rollout, old, spine.metrics)
        # Each outcome reward stays on its completion's last token even when a correction drops it, so a
        # dropped completion still counts in its group's baseline (as verl).
        inputs = advantage_inputs(
            self.advantage, rollout, spine.metrics, old_logprobs=rollout.engine_logprobs if own is None else old,
            own=own, reference=reference, kl_in_reward=self.kl_in_reward, mask=trained.completion_mask,
            is_weights=is_weights,
        )  # fmt: skip
        advantages = self.advantage(inputs)[0]  # [N, T]
        step.lap("logprob")
        losses = LossInputs(old_logprobs=old, advantages=advantages, ref_logprobs=reference, is_weights=is_weights)
        selection = self.policy_loss.step_selection(self.policy, trained, spine.loop)
        spine.update(self, trained, losses, self._micro_step, prepare_step=selection)
        step.lap("update")
        spine.finish(self, step, advantages)

    def _micro_step(self, micro: Rollout, inputs: LossInputs, totals: StepTotals) -> tuple[Tensor, dict[str, Tensor]]:
        on_policy = inputs.old_logprobs is None  # no scoring pass: this forward gives the old log-probs
        # the entropy enters the autograd graph only when it is in the loss; otherwise it is a metric
        in_loss = self.policy_loss.needs_entropy
        scores = self.policy(
            micro, micro.temperature, entropy=in_loss or on_policy, raw=on_policy, entropy_grad=in_loss
        )
        if on_policy:
            entropy, raw = scores.entropy.detach(), scores.raw_logprobs.detach()  # [n, T] each
            forward_metrics(self.spine.metrics, micro.completion_mask, micro.engine_logprobs, entropy, raw)
            inputs = replace(inputs, old_logprobs=scores.logprobs.detach())  # ratio 1, the gradient of logp
        loss, terms = self.policy_loss(scores, inputs, micro.completion_mask, totals, self.spine.metrics)
        if len(terms) > 1:
            terms["loss/total"] = loss.detach()
        return loss, terms
