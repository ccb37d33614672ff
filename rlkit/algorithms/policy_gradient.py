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
from rlkit.algorithms.optim import build_optimizer
from rlkit.algorithms.policy import Policy, clip_gradients, score_rollout
from rlkit.algorithms.reporting import StepWriter, rollout_metrics, settings, write_hparams
from rlkit.algorithms.sync import WeightSync
from rlkit.components.advantage import Advantage, AdvantageInputs
from rlkit.components.aggregation import Aggregation, StepTotals
from rlkit.components.clip import Clip, ClipInputs, SelectingClip
from rlkit.components.kl import KL
from rlkit.components.ratio import Ratio
from rlkit.components.rollout_correction import CorrectionOutput, RolloutCorrection
from rlkit.data.batch import Rollout
from rlkit.errors import ConfigError


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-6, weight_decay=0.0)


class PolicyGradient(pl.LightningModule):
    """Critic-free policy-gradient training of a causal LM from scored rollouts.

    The loss per token is ``w * clip(ratio(logp, logp_old), logp, logp_old, A) + kl_coef * kl(logp, logp_ref)
    - entropy_coef * H``, reduced by ``aggregation`` over the whole optimizer step; ``w`` is the rollout
    correction's weight (1 without one).

    Rollout correction (``rollout_correction``): decoupled (the default), the weights compare the
    trainer's recomputed old log-probs with the engine's, once per rollout, and the tokens it drops leave
    the step's totals and the advantage's mask (as verl). With ``bypass=True`` the engine's log-probs are
    the old log-probs, the trainer's no-grad pass is skipped (no ``policy/entropy`` and ``mismatch/*``
    curves then), and the weights compare the current policy with the engine in each micro-batch; a token
    it drops gets weight 0 but stays in the step's totals (they are fixed before the micro-batches run).
    Engines report untempered log-probs, so a correction needs ``temperature = 1``.

    Args:
        advantage: the advantage estimator (e.g. ``GroupNorm`` for GRPO, ``GroupMean`` for Dr.GRPO).
        ratio: the importance ratio (``TokenRatio``; ``SequenceRatio`` for GSPO).
        clip: the clipped surrogate (``PPOClip``; ``NoClip``).
        aggregation: how per-token losses become the step's scalar (``TokenMean``, ...).
        kl: KL estimator against a frozen reference policy (None: no reference model is loaded).
        kl_coef: weight of the KL term in the loss.
        entropy_coef: weight of the entropy bonus (subtracted from the loss).
        rollout_correction: per-token weights for the engine/trainer mismatch (``TruncatedIS``,
            ``IcePop``, ``MaskedIS``; ``NoCorrection(bypass=true)`` for verl's bypass PPO-clip); None: none.
        checkpoint: a local Hugging Face checkpoint directory (config.json + weights + tokenizer).
            None builds rlkit's embedded tiny model, warmed up on the embedded task (cached).
        optimizer: the optimizer (default AdamW, lr 1e-6, no weight decay).
        lr_scheduler: optional schedule, stepped once per optimizer step (``LinearDecay`` ends with the run).
        ppo_epochs: passes over each rollout.
        minibatches: optimizer steps per pass (the rollout's rows split into this many mini-batches).
        micro_batch_size: rows per forward/backward (memory only; None = the whole mini-batch).
        max_grad_norm: clip the gradient norm to this (None: no clipping).
        logprob_chunk_rows: rows of ``[rows, V]`` logits processed at once when computing log-probs.
        gradient_checkpointing: trade compute for memory in the policy's forward.
        trust_remote_code: allow a checkpoint's own Python code (off: only built-in architectures).
        samples_every: rollouts between two sample tables (a whole group) in TensorBoard's TEXT tab.
        seed: the seed of the mini-batch shuffles.
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
        rollout_correction: RolloutCorrection | None = None,
        checkpoint: str | None = None,
        optimizer: OptimizerCallable = _adamw,
        lr_scheduler: LRSchedulerCallable | None = None,
        ppo_epochs: int = 1,
        minibatches: int = 1,
        micro_batch_size: int | None = None,
        max_grad_norm: float | None = 1.0,
        logprob_chunk_rows: int = 4096,
        gradient_checkpointing: bool = False,
        trust_remote_code: bool = False,
        samples_every: int = 10,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if max_grad_norm is not None and max_grad_norm <= 0:
            raise ConfigError(f"model.max_grad_norm must be > 0 or null (no clipping), got {max_grad_norm}")
        if kl_coef < 0 or entropy_coef < 0:
            raise ConfigError("model.kl_coef and model.entropy_coef must be >= 0")
        if kl_coef > 0 and kl is None:
            raise ConfigError(f"model.kl_coef={kl_coef} but model.kl is null: name an estimator, e.g. --model.kl=K3")
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
        self.ratio = ratio
        self.clip = clip
        self.aggregation = aggregation
        self.kl = kl
        self.kl_coef = kl_coef
        self.entropy_coef = entropy_coef
        self.rollout_correction = rollout_correction
        self.checkpoint = checkpoint
        self.optimizer_factory = optimizer
        self.scheduler_factory = lr_scheduler
        self.loop = UpdateLoop(ppo_epochs, minibatches, micro_batch_size, seed)
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
        if self.kl is not None:
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
        correction = self.rollout_correction
        bypass = correction is not None and correction.bypass
        if correction is not None and rollout.temperature != 1.0:
            raise ConfigError(
                f"model.rollout_correction compares the trainer's log-probs with the engine's, which engines report "
                f"untempered, but the rollout was sampled at temperature {rollout.temperature}: sample at "
                "data.engine.temperature=1.0, or set model.rollout_correction=null"
            )
        frozen = {"ref_logprobs": self._reference[0]} if self._reference else {}
        own, others = score_rollout(
            self.policy,
            rollout,
            self.loop.micro_batches(torch.arange(len(rollout), device=self.device)),
            frozen,
            own=not bypass,
            sum_pi_squared=self.advantage.uses_sum_pi_squared,
        )
        mask = rollout.completion_mask  # [N, T]
        valid = mask.bool()  # [N, T]
        if own is not None and valid.any():
            self.metrics.update("policy/entropy", own.entropy[valid].mean(), valid.sum())
        old = rollout.engine_logprobs if own is None else own.logprobs  # [N, T]
        trained, is_weights = rollout, None
        if correction is not None and not bypass:
            corrected = correction(old, rollout.engine_logprobs, mask)
            self._correction_metrics(corrected, mask)
            # tokens it drops leave the loss, the step's totals and the advantage's mask (verl's response mask)
            trained = replace(rollout, completion_mask=mask * corrected.keep)
            is_weights = corrected.weights  # [N, T]
        advantages = self._advantages(trained, own, is_weights)  # [N, T]
        inputs = LossInputs(
            old_logprobs=old, advantages=advantages, ref_logprobs=others.get("ref_logprobs"), is_weights=is_weights
        )
        timings["logprob"] = time.perf_counter() - start
        rollout_metrics(self.metrics, rollout, advantages, None if own is None else own.raw_logprobs)

        start = time.perf_counter()
        prepare = self._step_selection(trained, bypass) if isinstance(self.clip, SelectingClip) else None
        self.loop.run(
            self,
            trained,
            inputs,
            self._micro_step,
            self._optimizer_step,
            self.metrics,
            self.trainer.world_size,
            prepare_step=prepare,
        )
        timings["update"] = time.perf_counter() - start
        self.rollouts_done = rollout.iteration + 1
        self.writer.write(
            self, self.metrics, rollout, timings, advantages, {"lr": self.optimizers().param_groups[0]["lr"]}
        )

    def _advantages(self, rollout: Rollout, own, is_weights: Tensor | None) -> Tensor:
        """The advantage estimator's ``[N, T]`` output, given only the inputs it uses."""
        extra = {}
        if self.advantage.uses_reward_terms:
            terms = list(rollout.reward_terms.values())
            extra["reward_terms"] = torch.stack(terms, -1) if terms else rollout.scores.unsqueeze(-1)  # [N, K]
        if self.advantage.uses_sum_pi_squared:
            extra.update(old_log_probs=own.logprobs, sum_pi_squared=own.sum_pi_squared)
        if self.advantage.uses_is_weights:
            extra["is_weights"] = is_weights
        inputs = AdvantageInputs.from_scores(
            rollout.scores, rollout.completion_mask, rollout.group_ids, baselines=rollout.baselines, **extra
        )
        return self.advantage(inputs)[0]

    def _step_selection(self, rollout: Rollout, bypass: bool):
        """``prepare_step`` for a SelectingClip: its selection over each optimizer step's rows.

        The selection reads the current policy's log-probs of the step's rows. Before the rollout's first
        update they are the old log-probs (the same weights scored them); afterwards, and in bypass mode,
        one more no-grad pass over the step's rows computes them. Under data parallelism each rank selects
        over its own rows.
        """

        def prepare(rows: Tensor, inputs: LossInputs, step: int) -> LossInputs:
            mask = rollout.completion_mask[rows]  # [n, T]
            old = inputs.old_logprobs[rows]  # [n, T]
            if step == 0 and not bypass:
                current = old  # [n, T]
            else:
                current = score_rollout(self.policy, rollout, self.loop.micro_batches(rows))[0].logprobs  # [n, T]
            step_inputs = ClipInputs(
                self.ratio(current, old, mask).detach(), current, old, inputs.advantages[rows], mask
            )
            generator = torch.Generator().manual_seed(hash((self.loop.seed, rollout.iteration, step)) % 2**62)
            selected = torch.zeros_like(rollout.completion_mask, dtype=torch.bool)  # [N, T]
            selected[rows] = self.clip.select(step_inputs, generator)
            return replace(inputs, selected=selected)

        return prepare

    def _micro_step(self, micro: Rollout, inputs: LossInputs, totals: StepTotals) -> tuple[Tensor, dict[str, Tensor]]:
        mask = micro.completion_mask  # [n, T]
        # the entropy enters the autograd graph only when it is in the loss; otherwise it is a metric
        scores = self.policy(micro, micro.temperature, entropy=self.entropy_coef > 0)
        logprobs = scores.logprobs  # [n, T]
        old = inputs.old_logprobs  # [n, T]
        ratio = self.ratio(logprobs, old, mask)  # [n, T]
        clipped = self.clip(ClipInputs(ratio, logprobs, old, inputs.advantages, mask, inputs.selected))
        weights = inputs.is_weights  # [n, T] or None
        if self.rollout_correction is not None and self.rollout_correction.bypass:
            corrected = self.rollout_correction(logprobs.detach(), old, mask)  # old = the engine's here
            self._correction_metrics(corrected, mask)
            weights = corrected.weights  # [n, T]
        policy_loss = clipped.loss if weights is None else clipped.loss * weights  # [n, T]
        loss_mat = policy_loss  # [n, T]
        parts = {"loss/policy": policy_loss}
        if self.kl is not None:
            kl_mat = self.kl(logprobs, inputs.ref_logprobs)  # [n, T]
            parts["loss/kl"] = kl_mat
            if self.kl_coef > 0:
                loss_mat = loss_mat + self.kl_coef * kl_mat
        if self.entropy_coef > 0:
            parts["loss/entropy"] = scores.entropy
            loss_mat = loss_mat - self.entropy_coef * scores.entropy
        loss = self.aggregation(loss_mat, mask, totals)
        terms = {name: self.aggregation(value.detach(), mask, totals) for name, value in parts.items()}
        if len(terms) > 1:
            terms["loss/total"] = loss.detach()
        self._ratio_metrics(ratio.detach(), logprobs.detach(), old, mask, clipped.clipped)
        return loss, terms

    @torch.no_grad()
    def _correction_metrics(self, corrected: CorrectionOutput, mask: Tensor) -> None:
        """``rollout_correction/*``: token-weighted means, and the largest weight."""
        weight = mask.bool().sum()
        if not weight:
            return
        for name, value in corrected.metrics.items():
            if name == "weight_max":
                self.metrics.update(f"rollout_correction/{name}", value, reduce="max")
            else:
                self.metrics.update(f"rollout_correction/{name}", value, weight)

    @torch.no_grad()
    def _ratio_metrics(self, ratio: Tensor, logprobs: Tensor, old: Tensor, mask: Tensor, clipped: dict) -> None:
        valid = mask.bool()  # [n, T]
        weight = valid.sum()
        if not weight:
            return
        self.metrics.update("ratio/mean", ratio[valid].mean(), weight)
        self.metrics.update("ratio/max", ratio[valid].max(), reduce="max")
        self.metrics.update("ratio/min", ratio[valid].min(), reduce="min")
        # mean of log pi_old - log pi: verl's actor/ppo_kl
        self.metrics.update("ratio/approx_kl", (old - logprobs)[valid].mean(), weight)
        for name, where in clipped.items():
            self.metrics.update(f"clip/{name}", (where & valid).sum() / weight, weight)

    def _optimizer_step(self) -> None:
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        self.metrics.update("grad/norm", clip_gradients(self.policy.parameters(), self.max_grad_norm, self.trainer))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()

    def validation_step(self, batch: dict, batch_idx: int) -> dict:
        return batch  # scored by the data module's engine; HeldOutEvaluation reduces and logs it

    # ---- reporting ----

    def _first_param_group(self) -> dict | None:
        return self.trainer.optimizers[0].param_groups[0] if self.trainer.optimizers else None

    def hparams_for_logging(self) -> dict[str, object]:
        """Every component and setting that tells two runs apart, for TensorBoard's HPARAMS tab."""
        params: dict[str, object] = {}
        for name in ("advantage", "ratio", "clip", "aggregation", "kl", "rollout_correction"):
            params.update(settings(name, getattr(self, name)))
        params.update(
            kl_coef=self.kl_coef,
            entropy_coef=self.entropy_coef,
            ppo_epochs=self.loop.ppo_epochs,
            minibatches=self.loop.minibatches,
            max_grad_norm=self.max_grad_norm if self.max_grad_norm is not None else "none",
            lr=group.get("initial_lr", group["lr"]) if (group := self._first_param_group()) else "none",
            optimizer=type(self.trainer.optimizers[0]).__name__ if self.trainer.optimizers else "none",
            model="embedded" if self.checkpoint is None else str(self.checkpoint),
            max_steps=self.trainer.max_steps,
        )
        describe = getattr(self.trainer.datamodule, "hparams_for_logging", None)
        if describe is not None:
            params.update(describe())
        return params
