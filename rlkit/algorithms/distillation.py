"""Distillation: on-policy distillation of a frozen teacher into the policy (the student).

The student samples completions; the teacher scores every token of them; the student moves towards the
teacher on its own distribution, the states it will actually visit (Agarwal et al. 2024, GKD; Gu et al.
2024, MiniLLM; Thinking Machines 2025, "On-Policy Distillation"). As a policy-gradient signal, the
advantage of token ``t`` is minus its distillation loss (``A_t = -D_t``, the one line verl's distillation
turns on), run through the usual ratio and clip; as a supervised loss, ``D_t`` is backpropagated directly.

The machinery is shared with the other families: :class:`~rlkit.algorithms.policy.Policy`,
:class:`~rlkit.algorithms.loop.UpdateLoop`, :class:`~rlkit.algorithms.metrics.StepMetrics`,
:class:`~rlkit.algorithms.surrogate.PolicyLoss`, :class:`~rlkit.algorithms.sync.WeightSync` and
:class:`~rlkit.algorithms.evaluation.HeldOutEvaluation`.
"""

from __future__ import annotations

import time

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import Tensor

from rlkit.algorithms.evaluation import HeldOutEvaluation
from rlkit.algorithms.loop import LossInputs, UpdateLoop
from rlkit.algorithms.metrics import StepMetrics
from rlkit.algorithms.optim import adamw, check_max_grad_norm, lightning_optimizers, step_optimizer
from rlkit.algorithms.policy import Policy, TokenScores, load_policy_and_reference, score_in_micro_batches
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
from rlkit.algorithms.teacher import load_teacher
from rlkit.components.advantage import Advantage, AdvantageInputs
from rlkit.components.aggregation import Aggregation, StepTotals
from rlkit.components.clip import Clip
from rlkit.components.distill import DistillationLoss, DistillInputs
from rlkit.components.ratio import Ratio
from rlkit.data.batch import Rollout
from rlkit.errors import ConfigError
from rlkit.seeding import run_seed


class Distillation(pl.LightningModule):
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
        teacher: the teacher's local Hugging Face checkpoint directory; it must share the student's
            tokenizer. None: rlkit's embedded teacher (a wider model warmed up further, cached).
        checkpoint: the student's local Hugging Face checkpoint directory. None: rlkit's embedded model.
        optimizer: the optimizer (default AdamW, lr 1e-6, no weight decay).
        lr_scheduler: optional schedule, stepped once per optimizer step.
        ppo_epochs: passes over each rollout.
        minibatches: optimizer steps per pass.
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
        logprob_chunk_rows: rows of ``[rows, V]`` logits processed at once (log-probs, top-k).
        gradient_checkpointing: trade compute for memory in the student's forward.
        trust_remote_code: allow a checkpoint's own Python code (student and teacher).
        samples_every: rollouts between two sample tables in TensorBoard's TEXT tab.
        seed: the seed of the mini-batch shuffles (None: the run's ``seed_everything``).
    """

    def __init__(
        self,
        loss: DistillationLoss,
        ratio: Ratio,
        clip: Clip,
        aggregation: Aggregation,
        policy_gradient: bool = True,
        reward_weight: float = 0.0,
        advantage: Advantage | None = None,
        teacher: str | None = None,
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
        if reward_weight < 0:
            raise ConfigError(f"model.reward_weight must be >= 0, got {reward_weight}")
        if reward_weight > 0 and advantage is None:
            raise ConfigError(
                f"model.reward_weight={reward_weight} but model.advantage is null: name the task-reward "
                "estimator, e.g. --model.advantage=GroupNorm"
            )
        if advantage is not None and advantage.uses_values:
            raise ConfigError(f"{type(advantage).__name__} needs a critic's values: choose e.g. GroupNorm")
        self.loss = loss
        self.policy_loss = PolicyLoss(ratio, clip, aggregation)
        self.policy_gradient = policy_gradient
        self.reward_weight = reward_weight
        self.advantage = advantage
        self.teacher_checkpoint = teacher
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
        self.needs_greedy_baselines = advantage is not None and advantage.uses_greedy_baselines
        self.automatic_optimization = False
        self.policy: Policy | None = None
        self._teacher: list[Policy] = []  # a list keeps it out of state_dict and checkpoints
        self.metrics = StepMetrics()
        self.writer = StepWriter(samples_every)
        self.rollouts_done = 0

    # ---- set-up ----

    def configure_model(self) -> None:
        if self.policy is not None:
            return
        self.policy, _ = load_policy_and_reference(self, reference=False)
        self._teacher = [load_teacher(self.teacher_checkpoint, self.policy, trust_remote_code=self.trust_remote_code)]

    def configure_optimizers(self):
        return lightning_optimizers(
            self.policy.parameters(), self.optimizer_factory, self.scheduler_factory, max_steps=self.trainer.max_steps
        )

    def configure_callbacks(self) -> list[pl.Callback]:
        return [WeightSync(), HeldOutEvaluation()]

    def on_fit_start(self) -> None:
        data = self.trainer.datamodule
        self.loop.check_rows(data.prompts_per_step // self.trainer.world_size * data.samples_per_prompt)
        self.metrics.to(self.device)
        self._teacher[0].to(self.device)
        write_hparams(self.logger, self.hparams_for_logging())

    # ---- the step ----

    def training_step(self, rollout: Rollout, batch_idx: int) -> None:
        timings = dict(rollout.timings)
        start = time.perf_counter()
        micro = list(self.loop.micro_rollouts(rollout, torch.arange(len(rollout), device=self.device)))
        teacher = score_in_micro_batches(self._teacher[0], rollout, micro, top_k=self.loss.top_k)
        own = score_in_micro_batches(self.policy, rollout, micro, teacher.top_ids, entropy=True, raw=True)
        mask = rollout.completion_mask  # [N, T]
        distill = self.loss(_distill_inputs(own, teacher.logprobs, teacher.top_logprobs))  # [N, T]
        advantages = -distill * mask if self.policy_gradient else torch.zeros_like(mask)  # [N, T]
        if self.reward_weight > 0:
            task = AdvantageInputs.from_scores(rollout.scores, mask, rollout.group_ids, baselines=rollout.baselines)
            advantages = advantages + self.reward_weight * self.advantage(task)[0]  # [N, T]
        inputs = LossInputs(
            old_logprobs=own.logprobs,
            advantages=advantages,
            teacher_logprobs=teacher.logprobs,
            teacher_top_logprobs=teacher.top_logprobs,
            teacher_top_ids=teacher.top_ids,
        )
        timings["logprob"] = time.perf_counter() - start
        self._distill_metrics(own, teacher, distill, mask)
        rollout_metrics(self.metrics, rollout, advantages)
        forward_metrics(self.metrics, mask, rollout.engine_logprobs, own.entropy, own.raw_logprobs)

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
        mask = micro.completion_mask  # [n, T]
        # the teacher's top-k ids are scored only when the loss itself is backpropagated
        scores = self.policy(micro, micro.temperature, ids=None if self.policy_gradient else inputs.teacher_top_ids)
        loss, terms = torch.zeros((), device=mask.device), {}
        if self.policy_gradient or self.reward_weight > 0:
            loss, terms = self.policy_loss(scores, inputs, mask, totals, self.metrics)
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
        valid = mask.bool()  # [N, T]
        weight = valid.sum()
        if not weight:
            return
        log_ratio = (own.logprobs - teacher.logprobs)[valid]  # [tokens] log pi - log pi_T, y ~ pi
        self.metrics.update("distill/kl", log_ratio.mean(), weight)  # k1: unbiased reverse KL per token
        self.metrics.update("distill/kl_k3", (torch.expm1(-log_ratio) + log_ratio).mean(), weight)
        self.metrics.update("distill/teacher_logprob", teacher.logprobs[valid].mean(), weight)
        self.metrics.update("distill/loss", distill[valid].mean(), weight)
        if teacher.top_logprobs is not None:
            self.metrics.update("distill/teacher_top_mass", teacher.top_logprobs.exp().sum(-1)[valid].mean(), weight)
            self.metrics.update("distill/student_top_mass", own.logprobs_at_ids.exp().sum(-1)[valid].mean(), weight)

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
            **settings("loss", self.loss),
            **settings("advantage", self.advantage),
            **self.policy_loss.settings(),
            "policy_gradient": self.policy_gradient,
            "reward_weight": self.reward_weight,
            "teacher": "embedded" if self.teacher_checkpoint is None else str(self.teacher_checkpoint),
            **run_settings(self),
        }


def _distill_inputs(scores: TokenScores, teacher_logprobs: Tensor, teacher_top: Tensor | None) -> DistillInputs:
    return DistillInputs(scores.logprobs, teacher_logprobs, scores.logprobs_at_ids, teacher_top)
