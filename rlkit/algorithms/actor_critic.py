"""ActorCritic: PPO with a learned value function (Schulman et al. 2017; for LMs, Ouyang et al. 2022).

The module is its losses and what they need: the policy's clipped surrogate
(:class:`~rlkit.algorithms.surrogate.PolicyLoss`), a :class:`~rlkit.algorithms.critic.Critic` with its own
optimizer, values before the updates for GAE and value clipping, and a critic warm-up. The shared machinery
is the :class:`~rlkit.spine.family.Spine`.
"""

from __future__ import annotations

import lightning.pytorch as pl
from torch import Tensor

from rlkit.algorithms.critic import Critic, value_metrics
from rlkit.algorithms.shaping import KLInReward, advantage_inputs
from rlkit.algorithms.surrogate import PolicyLoss
from rlkit.components.advantage import Advantage
from rlkit.components.aggregation import Aggregation, StepTotals
from rlkit.components.base import Need
from rlkit.components.clip import Clip
from rlkit.components.kl import KL
from rlkit.components.kl_reward import KLPenalty
from rlkit.components.ratio import Ratio
from rlkit.components.value import ValueLoss
from rlkit.data.batch import Rollout
from rlkit.errors import ConfigError
from rlkit.spine.family import SPINE_PROVIDES, Family
from rlkit.spine.loop import LossInputs
from rlkit.spine.optim import build_optimizer, step_optimizer
from rlkit.spine.reporting import forward_metrics
from rlkit.spine.settings import Optimization


class ActorCritic(Family):
    """PPO: a policy and a critic trained together on each rollout.

    The loss per micro-batch is the policy's (``clip(ratio, A) + kl_coef * kl - entropy_coef * H``, reduced
    by ``aggregation``) plus ``value_coef`` times the critic's (``value_loss(V, returns, V_old)``, reduced by
    ``value_aggregation``). ``A`` and the returns come from ``advantage`` (``GAE``) on the critic's values
    before the updates. Each of actor and critic has its own optimizer. Every mini-batch steps the critic
    (``trainer.global_step`` counts these steps) and, after the first ``critic_warmup_rollouts`` rollouts,
    the policy.

    Args:
        advantage: an estimator that reads the critic's values (``GAE``).
        ratio: the importance ratio (``TokenRatio``).
        clip: the clipped surrogate (``PPOClip``).
        aggregation: how the policy's per-token losses become the step's scalar.
        critic: the value model, ``SeparateCritic`` (a checkpoint of its own) or ``ValueHead`` (on the policy).
        value_loss: the critic's per-token loss (``ClippedValueLoss``).
        value_aggregation: how the critic's per-token losses become the step's scalar (verl: ``TokenMean``).
        kl: KL estimator against a frozen reference policy, a term in the loss (None: no KL term).
        kl_coef: weight of the KL term in the loss.
        kl_in_reward: a KL penalty in the reward instead (``KLPenalty``; InstructGPT's PPO).
        entropy_coef: weight of the entropy bonus (subtracted from the loss).
        value_coef: weight of the value loss; with ``ValueHead`` it sets how much the value loss trains the
            shared backbone, with ``SeparateCritic`` it only scales the critic's gradient.
        critic_warmup_rollouts: rollouts at the start during which only the critic trains.
        critic_optim: the critic's optimizer, schedule and clipping (its schedule steps with every optimizer
            step; the policy's, in ``optim``, only after the warm-up).
        **shared: the settings every family shares (``policy``, ``loop``, ``optim``, ``samples_every``; see
            :class:`~rlkit.spine.family.Family`).
    """

    provides = SPINE_PROVIDES | {Need.VALUES}

    def __init__(
        self,
        advantage: Advantage,
        ratio: Ratio,
        clip: Clip,
        aggregation: Aggregation,
        critic: Critic,
        value_loss: ValueLoss,
        value_aggregation: Aggregation,
        kl: KL | None = None,
        kl_coef: float = 0.0,
        kl_in_reward: KLPenalty | None = None,
        entropy_coef: float = 0.0,
        value_coef: float = 1.0,
        critic_warmup_rollouts: int = 0,
        critic_optim: Optimization = Optimization(),  # noqa: B008 - frozen dataclass: safe to share
        **shared,
    ) -> None:
        super().__init__(**shared)
        if Need.VALUES not in advantage.needs:
            raise ConfigError(
                f"ActorCritic trains a critic for an estimator that reads its values (GAE); "
                f"{type(advantage).__name__} does not: use --model.advantage=GAE, or PolicyGradient for "
                "critic-free estimators"
            )
        if not value_coef > 0:
            raise ConfigError(f"model.value_coef must be > 0, got {value_coef}")
        if critic_warmup_rollouts < 0:
            raise ConfigError(f"model.critic_warmup_rollouts must be >= 0, got {critic_warmup_rollouts}")
        self.spine.declare(
            type(self), self.provides, advantage=advantage, ratio=ratio, clip=clip, aggregation=aggregation,
            critic=critic, value_loss=value_loss, value_aggregation=value_aggregation, kl=kl, kl_coef=kl_coef,
            kl_in_reward=kl_in_reward, entropy_coef=entropy_coef, value_coef=value_coef,
            critic_warmup_rollouts=critic_warmup_rollouts,
        )  # fmt: skip
        self.advantage = advantage
        self.policy_loss = PolicyLoss(ratio, clip, aggregation, kl, kl_coef, entropy_coef)
        self.kl_in_reward = KLInReward(kl_in_reward) if kl_in_reward is not None else None
        self.critic = critic
        self.value_loss = value_loss
        self.value_aggregation = value_aggregation
        self.value_coef = value_coef
        self.critic_warmup_rollouts = critic_warmup_rollouts
        self.critic_optim = critic_optim.check("model.critic_optim")
        self._schedulers: tuple = (None, None)
        self._warming_up = False

    def configure_family_models(self) -> None:
        self.critic.configure(self.policy, self.spine.policy_settings.trust_remote_code)

    def configure_optimizers(self):
        loop = self.spine.loop
        # the policy steps in every mini-batch after the warm-up: its schedule ends with the run
        warmup_steps = self.critic_warmup_rollouts * loop.ppo_epochs * loop.minibatches
        max_steps = self.trainer.max_steps
        policy_steps = max(max_steps - warmup_steps, 1) if max_steps > 0 else -1
        policy = build_optimizer(self.policy.parameters(), self.spine.optim, max_steps=policy_steps)
        critic = build_optimizer(
            self.critic.parameters(), self.critic_optim, max_steps=max_steps, key="model.critic_optim"
        )
        self._schedulers = (policy[1], critic[1])
        return [
            {"optimizer": opt, **({} if sched is None else {"lr_scheduler": {"scheduler": sched, "interval": "step"}})}
            for opt, sched in (policy, critic)
        ]

    def exported_models(self) -> dict[str, pl.LightningModule]:
        return {"critic": self.critic}

    def training_step(self, rollout: Rollout, batch_idx: int) -> None:
        spine = self.spine
        step = spine.begin(rollout)
        own, others = spine.score_before_updates(self, rollout, critic=self.critic)
        values, reference = others["values"], others.get("reference")  # [N, T], [N, T] or None
        inputs = advantage_inputs(
            self.advantage, rollout, spine.metrics, old_logprobs=own.logprobs, own=own, reference=reference,
            kl_in_reward=self.kl_in_reward, values=values,
        )  # fmt: skip
        advantages, returns = self.advantage(inputs)  # [N, T], [N, T]
        losses = LossInputs(
            old_logprobs=own.logprobs, advantages=advantages, ref_logprobs=reference, returns=returns, old_values=values
        )
        step.lap("logprob")
        mask = rollout.completion_mask  # [N, T]
        forward_metrics(spine.metrics, mask, rollout.engine_logprobs, own.entropy, own.raw_logprobs)
        value_metrics(spine.metrics, values, returns, mask)
        self._warming_up = rollout.iteration < self.critic_warmup_rollouts
        selection = self.policy_loss.step_selection(self.policy, rollout, spine.loop)
        spine.update(self, rollout, losses, self._micro_step, self._optimizer_step, prepare_step=selection)
        step.lap("update")
        spine.finish(self, step, advantages, {"value/lr": spine.lrs_used[1]})  # the critic's, as used

    def _micro_step(self, micro: Rollout, inputs: LossInputs, totals: StepTotals) -> tuple[Tensor, dict[str, Tensor]]:
        mask = micro.completion_mask  # [n, T]
        scores = self.policy(
            micro, micro.temperature, entropy=self.policy_loss.needs_entropy, hidden=self.critic.shares_policy
        )
        policy_loss, terms = self.policy_loss(scores, inputs, mask, totals, self.spine.metrics)
        values = self.critic(micro, scores)  # [n, T]
        value = self.value_loss(values, inputs.returns, inputs.old_values)
        value_loss = self.value_aggregation(value.loss, mask, totals)
        valid = mask.bool()  # [n, T]
        if valid.any():
            fraction = (value.clipped["fraction"] & valid).sum() / valid.sum()
            self.spine.metrics.update("value/clip_fraction", fraction, valid.sum())
        # in the warm-up the policy's loss is weighted 0 rather than left out: under DDP every parameter must
        # take part in each backward
        loss = (0.0 if self._warming_up else 1.0) * policy_loss + self.value_coef * value_loss
        terms["loss/value"] = value_loss.detach()
        terms["loss/total"] = loss.detach()
        return loss, terms

    def _optimizer_step(self) -> None:
        policy, critic = self.optimizers()
        policy_scheduler, critic_scheduler = self._schedulers
        metrics = self.spine.metrics
        if self._warming_up:
            policy.zero_grad(set_to_none=True)
        else:
            # through the strategy, not the Lightning optimizer: only the critic's step counts as a global step
            norm = step_optimizer(
                policy.optimizer, policy_scheduler, self.policy.parameters(), self.spine.optim.max_grad_norm,
                self.trainer,
            )  # fmt: skip
            metrics.update("grad/norm", norm)
        norm = step_optimizer(
            critic, critic_scheduler, self.critic.parameters(), self.critic_optim.max_grad_norm, self.trainer,
            "model.critic_optim.max_grad_norm",
        )  # fmt: skip
        metrics.update("value/grad_norm", norm)

    def hparams_for_logging(self) -> dict[str, object]:
        critic = self.trainer.optimizers[1].param_groups[0] if len(self.trainer.optimizers) > 1 else None
        return {
            **super().hparams_for_logging(),
            "critic_lr": critic.get("initial_lr", critic["lr"]) if critic is not None else "none",
        }
