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

from rlkit.algorithms.evaluation import HeldOutEvaluation
from rlkit.algorithms.loop import LossInputs, UpdateLoop
from rlkit.algorithms.metrics import StepMetrics
from rlkit.algorithms.optim import build_optimizer, step_optimizer
from rlkit.algorithms.policy import Policy, score_rollout
from rlkit.algorithms.reporting import (
    StepWriter,
    forward_metrics,
    rollout_metrics,
    run_settings,
    settings,
    write_hparams,
)
from rlkit.algorithms.surrogate import PolicyLoss
from rlkit.algorithms.sync import WeightSync
from rlkit.components.advantage import Advantage, AdvantageInputs
from rlkit.components.aggregation import Aggregation, StepTotals
from rlkit.components.clip import Clip
from rlkit.components.kl import KL
from rlkit.components.ratio import Ratio
from rlkit.data.batch import Rollout
from rlkit.errors import ConfigError
from rlkit.seeding import run_seed


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-6, weight_decay=0.0)


class PolicyGradient(pl.LightningModule):
    """Critic-free policy-gradient training of a causal LM from scored rollouts.

    The loss per token is ``clip(ratio(logp, logp_old), A) + kl_coef * kl(logp, logp_ref)
    - entropy_coef * H``, reduced by ``aggregation`` over the whole optimizer step.

    Args:
        advantage: the advantage estimator (e.g. ``GroupNorm`` for GRPO, ``GroupMean`` for Dr.GRPO).
        ratio: the importance ratio (``TokenRatio``; ``SequenceRatio`` for GSPO).
        clip: the clipped surrogate (``PPOClip``; ``NoClip``).
        aggregation: how per-token losses become the step's scalar (``TokenMean``, ...).
        kl: KL estimator against a frozen reference policy (None: no reference model is loaded).
        kl_coef: weight of the KL term in the loss.
        entropy_coef: weight of the entropy bonus (subtracted from the loss).
        checkpoint: a local Hugging Face checkpoint directory (config.json + weights + tokenizer).
            None builds rlkit's embedded tiny model, warmed up on the embedded task (cached).
        optimizer: the optimizer (default AdamW, lr 1e-6, no weight decay).
        lr_scheduler: optional schedule, stepped once per optimizer step (``LinearDecay`` ends with the run).
        ppo_epochs: passes over each rollout.
        minibatches: optimizer steps per pass (the rollout's rows split into this many mini-batches).
        micro_batch_size: rows per forward/backward (memory only; None = the whole mini-batch).
        micro_batch_tokens: instead of ``micro_batch_size``, a token budget per forward/backward: rows
            sorted by length, each micro-batch cut to its own longest row (memory and speed only; see
            :class:`~rlkit.algorithms.loop.UpdateLoop`).
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
        entropy_coef: float = 0.0,
        checkpoint: str | None = None,
        optimizer: OptimizerCallable = _adamw,
        lr_scheduler: LRSchedulerCallable | None = None,
        ppo_epochs: int = 1,
        minibatches: int = 1,
        micro_batch_size: int | None = None,
        micro_batch_tokens: int | None = None,
        max_grad_norm: float | None = 1.0,
        logprob_chunk_rows: int = 4096,
        gradient_checkpointing: bool = False,
        trust_remote_code: bool = False,
        samples_every: int = 10,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        if max_grad_norm is not None and max_grad_norm <= 0:
            raise ConfigError(f"model.max_grad_norm must be > 0 or null (no clipping), got {max_grad_norm}")
        if advantage.uses_values:
            raise ConfigError(
                f"{type(advantage).__name__} needs a critic's values; PolicyGradient is critic-free: choose an "
                "outcome estimator such as GroupNorm or GroupMean, or the actor-critic family (PPO)"
            )
        self.advantage = advantage
        self.policy_loss = PolicyLoss(ratio, clip, aggregation, kl, kl_coef, entropy_coef)
        self.checkpoint = checkpoint
        self.optimizer_factory = optimizer
        self.scheduler_factory = lr_scheduler
        self.loop = UpdateLoop(ppo_epochs, minibatches, micro_batch_size, run_seed(seed), micro_batch_tokens)
        self.max_grad_norm = max_grad_norm
        self.logprob_chunk_rows = logprob_chunk_rows
        self.gradient_checkpointing = gradient_checkpointing
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
        self.policy = Policy.load(
            self.checkpoint,
            trust_remote_code=self.trust_remote_code,
            gradient_checkpointing=self.gradient_checkpointing,
            chunk_rows=self.logprob_chunk_rows,
        )
        if self.policy_loss.kl is not None:
            self._reference = [self.policy.frozen_copy()]

    def configure_optimizers(self):
        optimizer, scheduler = build_optimizer(
            self.policy.parameters(), self.optimizer_factory, self.scheduler_factory, max_steps=self.trainer.max_steps
        )
        if scheduler is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def configure_callbacks(self) -> list[pl.Callback]:
        return [WeightSync(), HeldOutEvaluation()]

    def on_fit_start(self) -> None:
        data = self.trainer.datamodule
        self.loop.check_rows(data.prompts_per_step // self.trainer.world_size * data.samples_per_prompt)
        self.metrics.to(self.device)
        for reference in self._reference:
            reference.to(self.device)
        write_hparams(self.logger, self.hparams_for_logging())

    def on_validation_start(self) -> None:
        for reference in self._reference:
            reference.to(self.device)

    # ---- the step ----

    def training_step(self, rollout: Rollout, batch_idx: int) -> None:
        timings = dict(rollout.timings)
        start = time.perf_counter()
        frozen = {"ref_logprobs": self._reference[0]} if self._reference else {}
        # With one optimizer step per rollout the policy that scores the rollout is the one being
        # updated: its old log-probs are the update's own, detached (ratio 1), and the no-grad pass
        # over the policy is skipped (as verl does); its metrics come from the update's forward.
        score_first = not self.loop.on_policy
        own, others = None, {}
        if score_first or frozen:
            every_row = torch.arange(len(rollout), device=self.device)
            micro_batches = self.loop.micro_rollouts(rollout, every_row)
            own, others = score_rollout(self.policy, rollout, micro_batches, frozen, own=score_first)
        mask = rollout.completion_mask  # [N, T]
        if own is not None:
            forward_metrics(self.metrics, mask, rollout.engine_logprobs, own.entropy, own.raw_logprobs)
        adv_inputs = AdvantageInputs.from_scores(rollout.scores, mask, rollout.group_ids, baselines=rollout.baselines)
        advantages, _ = self.advantage(adv_inputs)  # [N, T]
        old = None if own is None else own.logprobs  # [N, T]; None: the update's own, detached
        inputs = LossInputs(old_logprobs=old, advantages=advantages, ref_logprobs=others.get("ref_logprobs"))
        timings["logprob"] = time.perf_counter() - start
        rollout_metrics(self.metrics, rollout, advantages)

        start = time.perf_counter()
        self.loop.run(
            self, rollout, inputs, self._micro_step, self._optimizer_step, self.metrics, self.trainer.world_size
        )
        timings["update"] = time.perf_counter() - start
        self.rollouts_done = rollout.iteration + 1
        self.writer.write(
            self, self.metrics, rollout, timings, advantages, {"lr": self.optimizers().param_groups[0]["lr"]}
        )

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
        return {**settings("advantage", self.advantage), **self.policy_loss.settings(), **run_settings(self)}
