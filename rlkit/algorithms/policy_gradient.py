"""PolicyGradient: the critic-free family (GRPO, Dr.GRPO, GSPO, DAPO, RLOO, REINFORCE++, ReMax, OPO, GPG).

The module is its loss and what the loss needs; the machinery every family shares is composed in:
:class:`~rlkit.algorithms.policy.Policy` (the LM and its log-probs), :class:`~rlkit.algorithms.loop.UpdateLoop`
(epochs x mini-batches x micro-batches with the step totals), :class:`~rlkit.algorithms.metrics.StepMetrics`,
:class:`~rlkit.algorithms.sync.WeightSync` (the engine seam) and
:class:`~rlkit.algorithms.evaluation.HeldOutEvaluation`.
"""

from __future__ import annotations

import time
from dataclasses import replace

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import Tensor

from rlkit.algorithms.lifecycle import family_callbacks, place_frozen_models, score_before_updates, start_fit
from rlkit.algorithms.loop import LossInputs, UpdateLoop
from rlkit.algorithms.metrics import StepMetrics
from rlkit.algorithms.optim import adamw, check_max_grad_norm, lightning_optimizers, step_optimizer
from rlkit.algorithms.policy import Policy, load_policy_and_reference
from rlkit.algorithms.reporting import StepWriter, forward_metrics, rollout_metrics, run_settings, settings
from rlkit.algorithms.shaping import KLInReward, advantage_inputs, kl_in_reward_settings
from rlkit.algorithms.surrogate import PolicyLoss, check_temperature, correct_rollout
from rlkit.components.advantage import Advantage
from rlkit.components.aggregation import Aggregation, StepTotals
from rlkit.components.clip import Clip, SelectingClip
from rlkit.components.kl import KL
from rlkit.components.kl_reward import KLPenalty
from rlkit.components.ratio import Ratio
from rlkit.components.rollout_correction import RolloutCorrection
from rlkit.data.batch import Rollout
from rlkit.errors import ConfigError
from rlkit.seeding import run_seed


class PolicyGradient(pl.LightningModule):
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
        checkpoint: a local Hugging Face checkpoint directory (config.json + weights + tokenizer).
            None builds rlkit's embedded tiny model, warmed up on the embedded task (cached).
        optimizer: the optimizer (default AdamW, lr 1e-6, no weight decay).
        lr_scheduler: optional schedule, stepped once per optimizer step (``LinearDecay`` ends with the run).
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
        max_grad_norm: clip the gradient norm to this (None: no clipping).
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
        kl: KL | None = None,
        kl_coef: float = 0.0,
        kl_in_reward: KLPenalty | None = None,
        entropy_coef: float = 0.0,
        rollout_correction: RolloutCorrection | None = None,
        checkpoint: str | None = None,
        optimizer: OptimizerCallable = adamw,
        lr_scheduler: LRSchedulerCallable | None = None,
        ppo_epochs: int = 1,
        minibatches: int = 1,
        micro_batch_size: int | None = None,
        micro_batch_tokens: int | None = 1024,
        pack_sequences: bool = False,
        attn_implementation: str | None = None,
        max_grad_norm: float | None = 1.0,
        logprob_chunk_rows: int = 4096,
        gradient_checkpointing: bool = False,
        trust_remote_code: bool = False,
        samples_every: int = 10,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        check_max_grad_norm(max_grad_norm)
        if advantage.uses_values:
            raise ConfigError(
                f"{type(advantage).__name__} needs a critic's values; PolicyGradient is critic-free: choose an "
                "outcome estimator such as GroupNorm or GroupMean, or the actor-critic family (PPO)"
            )
        bypass = rollout_correction is not None and rollout_correction.bypass
        if advantage.uses_is_weights and (rollout_correction is None or bypass):
            raise ConfigError(
                f"{type(advantage).__name__}(use_is_weights=true) needs rollout-correction weights before the "
                "update: set model.rollout_correction (not in bypass mode), or use_is_weights=false"
            )
        if advantage.uses_sum_pi_squared and bypass:
            raise ConfigError(
                f"{type(advantage).__name__} needs the trainer's log-prob pass, which bypass mode skips: "
                "set model.rollout_correction.init_args.bypass=false or choose another advantage"
            )
        self.advantage = advantage
        self.policy_loss = PolicyLoss(ratio, clip, aggregation, kl, kl_coef, entropy_coef, rollout_correction)
        self.kl_in_reward = KLInReward(kl_in_reward) if kl_in_reward is not None else None
        self.checkpoint = checkpoint
        self.optimizer_factory = optimizer
        self.scheduler_factory = lr_scheduler
        self.loop = UpdateLoop(
            ppo_epochs, minibatches, micro_batch_size, run_seed(seed), micro_batch_tokens, pack_sequences
        )
        self.max_grad_norm = max_grad_norm
        self.logprob_chunk_rows = logprob_chunk_rows
        self.gradient_checkpointing = gradient_checkpointing
        self.attn_implementation = attn_implementation
        self.trust_remote_code = trust_remote_code
        self.needs_greedy_baselines = advantage.uses_greedy_baselines
        self.automatic_optimization = False
        self.policy: Policy | None = None
        self._reference: list[Policy] = []  # a list keeps it out of state_dict and checkpoints
        self.metrics = StepMetrics()
        self.writer = StepWriter(samples_every)
        self.rollouts_done = 0

    # ---- set-up ----

    def configure_model(self) -> None:
        if self.policy is not None:
            return
        reference = self.policy_loss.kl is not None or self.kl_in_reward is not None
        self.policy, self._reference = load_policy_and_reference(self, reference)

    def configure_optimizers(self):
        return lightning_optimizers(
            self.policy.parameters(), self.optimizer_factory, self.scheduler_factory, max_steps=self.trainer.max_steps
        )

    def configure_callbacks(self) -> list[pl.Callback]:
        return family_callbacks()

    def on_fit_start(self) -> None:
        start_fit(self)

    def on_validation_start(self) -> None:
        place_frozen_models(self)

    # ---- the step ----

    @property
    def needs_scoring_pass(self) -> bool:
        """Whether the policy scores the rollout (no grad) before its updates.

        With one optimizer step per rollout the policy being updated is the one whose log-probs the ratio
        divides by: the update's own forward, detached, gives them (ratio 1, as verl does) and its
        entropy and engine/trainer mismatch metrics. A pass first is needed with several optimizer
        steps per rollout, or when something reads the old log-probs before the update: a decoupled
        rollout correction, an advantage on the policy's probabilities, a step-level clip selection, the
        KL penalty in the reward.
        """
        loss = self.policy_loss
        return (
            not self.loop.on_policy
            or (loss.rollout_correction is not None and not loss.bypass)
            or self.advantage.uses_sum_pi_squared
            or isinstance(loss.clip, SelectingClip)
            or self.kl_in_reward is not None
        )

    def training_step(self, rollout: Rollout, batch_idx: int) -> None:
        timings = dict(rollout.timings)
        start = time.perf_counter()
        check_temperature(self.policy_loss.rollout_correction, rollout)
        own, others = score_before_updates(
            self,
            rollout,
            own=self.needs_scoring_pass and not self.policy_loss.bypass,
            sum_pi_squared=self.advantage.uses_sum_pi_squared,
        )
        if own is not None:
            mask = rollout.completion_mask  # [N, T]
            forward_metrics(self.metrics, mask, rollout.engine_logprobs, own.entropy, own.raw_logprobs)
            old = own.logprobs  # [N, T]
        elif self.policy_loss.bypass:
            old = rollout.engine_logprobs  # [N, T] bypass mode: the engine's log-probs are the old ones
        else:
            old = None  # the update's own forward gives them, detached (see needs_scoring_pass)
        reference = others.get("ref_logprobs")
        trained, is_weights = correct_rollout(self.policy_loss.rollout_correction, rollout, old, self.metrics)
        advantages = self._advantages(rollout, trained.completion_mask, own, is_weights, reference)  # [N, T]
        inputs = LossInputs(old_logprobs=old, advantages=advantages, ref_logprobs=reference, is_weights=is_weights)
        timings["logprob"] = time.perf_counter() - start
        rollout_metrics(self.metrics, rollout, advantages)

        start = time.perf_counter()
        self.loop.run(
            self,
            trained,
            inputs,
            self._micro_step,
            self._optimizer_step,
            self.metrics,
            self.trainer.world_size,
            prepare_step=self.policy_loss.step_selection(self.policy, trained, self.loop),
        )
        timings["update"] = time.perf_counter() - start
        self.rollouts_done = rollout.iteration + 1
        self.writer.write(
            self, self.metrics, rollout, timings, advantages, {"lr": self.optimizers().param_groups[0]["lr"]}
        )

    def _advantages(
        self, rollout: Rollout, mask: Tensor, own, is_weights: Tensor | None, reference: Tensor | None = None
    ) -> Tensor:
        """The advantage estimator's ``[N, T]`` output over ``mask`` (the tokens a correction kept), given
        only the optional inputs it uses, with the KL penalty in the reward (``kl_in_reward``: the old
        log-probs, the engine's in bypass mode, against ``reference``) on those tokens. Each outcome reward
        stays on its completion's last token even when a correction drops it, so a dropped completion still
        counts in its group's baseline (as verl)."""
        extra = {}
        if self.advantage.uses_reward_terms:
            terms = list(rollout.reward_terms.values())
            extra["reward_terms"] = torch.stack(terms, -1) if terms else rollout.scores.unsqueeze(-1)  # [N, K]
        if self.advantage.uses_sum_pi_squared:
            extra.update(old_log_probs=own.logprobs, sum_pi_squared=own.sum_pi_squared)
        if self.advantage.uses_is_weights:
            extra["is_weights"] = is_weights
        old = rollout.engine_logprobs if own is None else own.logprobs  # [N, T]
        inputs = advantage_inputs(rollout, old, reference, self.kl_in_reward, self.metrics, mask=mask, **extra)
        return self.advantage(inputs)[0]

    def _micro_step(self, micro: Rollout, inputs: LossInputs, totals: StepTotals) -> tuple[Tensor, dict[str, Tensor]]:
        on_policy = inputs.old_logprobs is None  # no scoring pass: this forward gives the old log-probs
        # the entropy enters the autograd graph only when it is in the loss; otherwise it is a metric
        in_loss = self.policy_loss.needs_entropy
        scores = self.policy(
            micro, micro.temperature, entropy=in_loss or on_policy, raw=on_policy, entropy_grad=in_loss
        )
        if on_policy:
            entropy, raw = scores.entropy.detach(), scores.raw_logprobs.detach()  # [n, T] each
            forward_metrics(self.metrics, micro.completion_mask, micro.engine_logprobs, entropy, raw)
            inputs = replace(inputs, old_logprobs=scores.logprobs.detach())  # ratio 1, the gradient of logp
        loss, terms = self.policy_loss(scores, inputs, micro.completion_mask, totals, self.metrics)
        if len(terms) > 1:
            terms["loss/total"] = loss.detach()
        return loss, terms

    def _optimizer_step(self) -> None:
        norm = step_optimizer(
            self.optimizers(), self.lr_schedulers(), self.policy.parameters(), self.max_grad_norm, self.trainer
        )
        self.metrics.update("grad/norm", norm)

    def validation_step(self, batch: dict, batch_idx: int) -> dict:
        return batch  # scored by the data module's engine; HeldOutEvaluation reduces and logs it

    # ---- reporting ----

    def hparams_for_logging(self) -> dict[str, object]:
        """Every component and setting that tells two runs apart, for TensorBoard's HPARAMS tab."""
        return {
            **settings("advantage", self.advantage),
            **self.policy_loss.settings(),
            **kl_in_reward_settings(self.kl_in_reward),
            **run_settings(self),
        }
