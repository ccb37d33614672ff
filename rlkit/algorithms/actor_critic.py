"""ActorCritic: PPO with a learned value function (Schulman et al. 2017; for LMs, Ouyang et al. 2022).

The module is its losses and what they need: the policy's clipped surrogate
(:class:`~rlkit.algorithms.surrogate.PolicyLoss`), a :class:`~rlkit.algorithms.critic.Critic` with its own
optimizer, values before the updates for GAE and value clipping, and a critic warm-up. The shared machinery
is composed in as in :class:`~rlkit.algorithms.policy_gradient.PolicyGradient`.
"""

from __future__ import annotations

import time

import lightning.pytorch as pl
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import Tensor

from rlkit.algorithms.critic import Critic, value_metrics
from rlkit.algorithms.lifecycle import family_callbacks, place_frozen_models, score_before_updates, start_fit
from rlkit.algorithms.loop import LossInputs, UpdateLoop
from rlkit.algorithms.metrics import StepMetrics
from rlkit.algorithms.optim import adamw, build_optimizer, check_max_grad_norm, step_optimizer
from rlkit.algorithms.policy import Policy, load_policy_and_reference
from rlkit.algorithms.reporting import StepWriter, forward_metrics, rollout_metrics, run_settings, settings
from rlkit.algorithms.shaping import KLInReward, advantage_inputs, kl_in_reward_settings
from rlkit.algorithms.surrogate import PolicyLoss
from rlkit.components.advantage import Advantage
from rlkit.components.aggregation import Aggregation, StepTotals
from rlkit.components.clip import Clip
from rlkit.components.kl import KL
from rlkit.components.kl_reward import KLPenalty
from rlkit.components.ratio import Ratio
from rlkit.components.value import ValueLoss
from rlkit.data.batch import Rollout
from rlkit.errors import ConfigError
from rlkit.seeding import run_seed


class ActorCritic(pl.LightningModule):
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
        checkpoint: a local Hugging Face checkpoint directory (config.json + weights + tokenizer).
            None builds rlkit's embedded tiny model, warmed up on the embedded task (cached).
        optimizer: the policy's optimizer (default AdamW, lr 1e-6, no weight decay).
        lr_scheduler: the policy's optional schedule, stepped with the policy (not during the warm-up).
        critic_optimizer: the critic's optimizer (default AdamW, lr 1e-6, no weight decay).
        critic_lr_scheduler: the critic's optional schedule, stepped once per optimizer step.
        ppo_epochs: passes over each rollout.
        minibatches: optimizer steps per pass (the rollout's rows split into this many mini-batches).
        micro_batch_size: at most this many rows per forward/backward (None: no row limit).
        micro_batch_tokens: at most this many tokens per forward/backward, padding included (verl's
            ``use_dynamic_bsz``): rows sorted by length, each micro-batch cut to its own longest row, so
            little is spent on padding (None: no token limit; both None: the whole mini-batch at once).
            Memory and speed only, never the maths (see :class:`~rlkit.algorithms.loop.UpdateLoop`).
        pack_sequences: run the policy's forwards (and frozen models') on each micro-batch's real tokens
            packed into one row, no padding (verl's ``use_remove_padding``); ``micro_batch_tokens`` then
            counts real tokens. Exact (checked against a padded forward on first use); speed only.
        attn_implementation: the policy's attention (``sdpa``, ``eager``, ``flash_attention_2``, ...;
            None: transformers' default); ``flash_attention_2`` with ``pack_sequences`` skips padding and
            cross-sequence attention entirely.
        max_grad_norm: clip the policy's gradient norm to this (None: no clipping).
        critic_max_grad_norm: clip the critic's gradient norm to this (None: no clipping).
        logprob_chunk_rows: rows of ``[rows, V]`` logits processed at once when computing log-probs.
        gradient_checkpointing: trade compute for memory in the policy's forward.
        trust_remote_code: allow a checkpoint's own Python code (off: only built-in architectures).
        samples_every: rollouts between two sample tables (a whole group) in TensorBoard's TEXT tab.
        seed: the seed of the mini-batch shuffles (None: the run's ``seed_everything``).
    """

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
        checkpoint: str | None = None,
        optimizer: OptimizerCallable = adamw,
        lr_scheduler: LRSchedulerCallable | None = None,
        critic_optimizer: OptimizerCallable = adamw,
        critic_lr_scheduler: LRSchedulerCallable | None = None,
        ppo_epochs: int = 1,
        minibatches: int = 1,
        micro_batch_size: int | None = None,
        micro_batch_tokens: int | None = 1024,
        pack_sequences: bool = False,
        attn_implementation: str | None = None,
        max_grad_norm: float | None = 1.0,
        critic_max_grad_norm: float | None = 1.0,
        logprob_chunk_rows: int = 4096,
        gradient_checkpointing: bool = False,
        trust_remote_code: bool = False,
        samples_every: int = 10,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        check_max_grad_norm(max_grad_norm)
        check_max_grad_norm(critic_max_grad_norm, "model.critic_max_grad_norm")
        if not advantage.uses_values:
            raise ConfigError(
                f"ActorCritic trains a critic for an estimator that reads its values (GAE); "
                f"{type(advantage).__name__} does not: use --model.advantage=GAE, or PolicyGradient for "
                "critic-free estimators"
            )
        if not value_coef > 0:
            raise ConfigError(f"model.value_coef must be > 0, got {value_coef}")
        if critic_warmup_rollouts < 0:
            raise ConfigError(f"model.critic_warmup_rollouts must be >= 0, got {critic_warmup_rollouts}")
        self.advantage = advantage
        self.policy_loss = PolicyLoss(ratio, clip, aggregation, kl, kl_coef, entropy_coef)
        self.kl_in_reward = KLInReward(kl_in_reward) if kl_in_reward is not None else None
        self.critic = critic
        self.value_loss = value_loss
        self.value_aggregation = value_aggregation
        self.value_coef = value_coef
        self.critic_warmup_rollouts = critic_warmup_rollouts
        self.checkpoint = checkpoint
        self.factories = (optimizer, lr_scheduler, critic_optimizer, critic_lr_scheduler)
        self.loop = UpdateLoop(
            ppo_epochs, minibatches, micro_batch_size, run_seed(seed), micro_batch_tokens, pack_sequences
        )
        self.max_grad_norm = max_grad_norm
        self.critic_max_grad_norm = critic_max_grad_norm
        self.logprob_chunk_rows = logprob_chunk_rows
        self.gradient_checkpointing = gradient_checkpointing
        self.attn_implementation = attn_implementation
        self.trust_remote_code = trust_remote_code
        self.needs_greedy_baselines = advantage.uses_greedy_baselines
        self.automatic_optimization = False
        self.policy: Policy | None = None
        self._reference: list[Policy] = []  # a list keeps it out of state_dict and checkpoints
        self._schedulers: tuple = (None, None)
        self._warming_up = False
        self.metrics = StepMetrics()
        self.writer = StepWriter(samples_every)
        self.rollouts_done = 0

    # ---- set-up ----

    def configure_model(self) -> None:
        if self.policy is not None:
            return
        reference = self.policy_loss.kl is not None or self.kl_in_reward is not None
        self.policy, self._reference = load_policy_and_reference(self, reference)
        self.critic.configure(self.policy, self.trust_remote_code)

    def configure_optimizers(self):
        optimizer, scheduler, critic_optimizer, critic_scheduler = self.factories
        # the policy steps in every mini-batch after the warm-up: its schedule ends with the run
        warmup_steps = self.critic_warmup_rollouts * self.loop.ppo_epochs * self.loop.minibatches
        max_steps = self.trainer.max_steps
        policy = build_optimizer(
            self.policy.parameters(),
            optimizer,
            scheduler,
            max_steps=max(max_steps - warmup_steps, 1) if max_steps > 0 else -1,
        )
        critic = build_optimizer(
            self.critic.parameters(), critic_optimizer, critic_scheduler, max_steps=max_steps, prefix="critic_"
        )
        self._schedulers = (policy[1], critic[1])
        return [
            {"optimizer": opt, **({} if sched is None else {"lr_scheduler": {"scheduler": sched, "interval": "step"}})}
            for opt, sched in (policy, critic)
        ]

    def configure_callbacks(self) -> list[pl.Callback]:
        return family_callbacks()

    def on_fit_start(self) -> None:
        start_fit(self)

    def on_validation_start(self) -> None:
        place_frozen_models(self)

    # ---- the step ----

    def training_step(self, rollout: Rollout, batch_idx: int) -> None:
        timings = dict(rollout.timings)
        start = time.perf_counter()
        own, others = score_before_updates(self, rollout, critic=self.critic)
        values, reference = others["values"], others.get("ref_logprobs")  # [N, T], [N, T] or None
        adv_inputs = advantage_inputs(rollout, own.logprobs, reference, self.kl_in_reward, self.metrics, values=values)
        advantages, returns = self.advantage(adv_inputs)  # [N, T], [N, T]
        inputs = LossInputs(
            old_logprobs=own.logprobs, advantages=advantages, ref_logprobs=reference, returns=returns, old_values=values
        )
        timings["logprob"] = time.perf_counter() - start
        rollout_metrics(self.metrics, rollout, advantages)
        forward_metrics(self.metrics, rollout.completion_mask, rollout.engine_logprobs, own.entropy, own.raw_logprobs)
        value_metrics(self.metrics, values, returns, rollout.completion_mask)

        start = time.perf_counter()
        self._warming_up = rollout.iteration < self.critic_warmup_rollouts
        self.loop.run(
            self,
            rollout,
            inputs,
            self._micro_step,
            self._optimizer_step,
            self.metrics,
            self.trainer.world_size,
            prepare_step=self.policy_loss.step_selection(self.policy, rollout, self.loop),
        )
        timings["update"] = time.perf_counter() - start
        self.rollouts_done = rollout.iteration + 1
        lrs = {"lr": self.optimizers()[0].param_groups[0]["lr"], "value/lr": self.optimizers()[1].param_groups[0]["lr"]}
        self.writer.write(self, self.metrics, rollout, timings, advantages, lrs)

    def _micro_step(self, micro: Rollout, inputs: LossInputs, totals: StepTotals) -> tuple[Tensor, dict[str, Tensor]]:
        mask = micro.completion_mask  # [n, T]
        scores = self.policy(
            micro, micro.temperature, entropy=self.policy_loss.needs_entropy, hidden=self.critic.shares_policy
        )
        policy_loss, terms = self.policy_loss(scores, inputs, mask, totals, self.metrics)
        values = self.critic(micro, scores)  # [n, T]
        value = self.value_loss(values, inputs.returns, inputs.old_values)
        value_loss = self.value_aggregation(value.loss, mask, totals)
        valid = mask.bool()  # [n, T]
        if valid.any():
            self.metrics.update(
                "value/clip_fraction", (value.clipped["fraction"] & valid).sum() / valid.sum(), valid.sum()
            )
        # in the warm-up the policy's loss is weighted 0 rather than left out: under DDP every parameter must
        # take part in each backward
        loss = (0.0 if self._warming_up else 1.0) * policy_loss + self.value_coef * value_loss
        terms["loss/value"] = value_loss.detach()
        terms["loss/total"] = loss.detach()
        return loss, terms

    def _optimizer_step(self) -> None:
        policy, critic = self.optimizers()
        policy_scheduler, critic_scheduler = self._schedulers
        if self._warming_up:
            policy.zero_grad(set_to_none=True)
        else:
            # through the strategy, not the Lightning optimizer: only the critic's step counts as a global step
            norm = step_optimizer(
                policy.optimizer, policy_scheduler, self.policy.parameters(), self.max_grad_norm, self.trainer
            )
            self.metrics.update("grad/norm", norm)
        norm = step_optimizer(
            critic,
            critic_scheduler,
            self.critic.parameters(),
            self.critic_max_grad_norm,
            self.trainer,
            "model.critic_max_grad_norm",
        )
        self.metrics.update("value/grad_norm", norm)

    def validation_step(self, batch: dict, batch_idx: int) -> dict:
        return batch  # scored by the data module's engine; HeldOutEvaluation reduces and logs it

    # ---- reporting ----

    def hparams_for_logging(self) -> dict[str, object]:
        """Every component and setting that tells two runs apart, for TensorBoard's HPARAMS tab."""
        critic = self.trainer.optimizers[1].param_groups[0] if len(self.trainer.optimizers) > 1 else None
        return {
            **settings("advantage", self.advantage),
            **self.policy_loss.settings(),
            **kl_in_reward_settings(self.kl_in_reward),
            "critic": type(self.critic).__name__,
            **settings("value_loss", self.value_loss),
            "value_aggregation": type(self.value_aggregation).__name__,
            "value_coef": self.value_coef,
            "critic_warmup_rollouts": self.critic_warmup_rollouts,
            "critic_lr": critic.get("initial_lr", critic["lr"]) if critic is not None else "none",
            **run_settings(self),
        }
