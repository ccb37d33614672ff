"""PolicyGradient: the critic-free family (GRPO, Dr.GRPO, GSPO, DAPO, RLOO, REINFORCE++, ReMax, OPO, GPG).

One ``training_step`` consumes one rollout: it recomputes the old log-probs with the trainer's policy,
computes advantages, then runs ``ppo_epochs x minibatches`` optimizer steps (manual optimization), each
accumulated over micro-batches that change memory only, never the maths: the aggregation receives the
optimizer step's totals.
"""

from __future__ import annotations

import copy
import math
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import Tensor
from torchmetrics import MaxMetric, MeanMetric, MinMetric

from rlkit.components.advantage import Advantage, AdvantageInputs
from rlkit.components.aggregation import Aggregation, StepTotals
from rlkit.components.clip import Clip
from rlkit.components.entropy import entropy_from_logits
from rlkit.components.kl import KL
from rlkit.components.logprobs import token_log_probs
from rlkit.components.ratio import Ratio
from rlkit.data.batch import Rollout
from rlkit.errors import ConfigError, NonFiniteError


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
            None builds rlkit's embedded tiny model, warmed up on single-digit arithmetic (cached).
        optimizer: the optimizer (default AdamW, lr 1e-6, no weight decay).
        lr_scheduler: optional schedule, stepped once per optimizer step.
        ppo_epochs: passes over each rollout.
        minibatches: optimizer steps per pass (the rollout's rows split into this many mini-batches).
        micro_batch_size: rows per forward/backward (memory only; None = the whole mini-batch).
        max_grad_norm: clip the gradient norm to this (None: no clipping).
        logprob_chunk_rows: rows of ``[rows, V]`` logits processed at once when computing log-probs.
        gradient_checkpointing: trade compute for memory in the policy's forward.
        trust_remote_code: allow a checkpoint's own Python code (off: only built-in architectures).
        samples_to_log: sample completions written to TensorBoard per rollout.
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
        samples_to_log: int = 4,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if ppo_epochs < 1:
            raise ConfigError(f"model.ppo_epochs must be >= 1, got {ppo_epochs}")
        if minibatches < 1:
            raise ConfigError(f"model.minibatches must be >= 1, got {minibatches}")
        if micro_batch_size is not None and micro_batch_size < 1:
            raise ConfigError(f"model.micro_batch_size must be >= 1 or null, got {micro_batch_size}")
        if max_grad_norm is not None and max_grad_norm <= 0:
            raise ConfigError(f"model.max_grad_norm must be > 0 or null (no clipping), got {max_grad_norm}")
        if kl_coef < 0 or entropy_coef < 0:
            raise ConfigError("model.kl_coef and model.entropy_coef must be >= 0")
        if kl_coef > 0 and kl is None:
            raise ConfigError(f"model.kl_coef={kl_coef} but model.kl is null: name an estimator, e.g. --model.kl=K3")
        if "values" in advantage.requires:
            raise ConfigError(
                f"{type(advantage).__name__} needs a critic's values; PolicyGradient is critic-free: "
                "choose an outcome estimator such as GroupNorm or GroupMean"
            )
        self.advantage = advantage
        self.ratio = ratio
        self.clip = clip
        self.aggregation = aggregation
        self.kl = kl
        self.kl_coef = kl_coef
        self.entropy_coef = entropy_coef
        self.checkpoint = checkpoint
        self.optimizer_factory = optimizer
        self.scheduler_factory = lr_scheduler
        self.ppo_epochs = ppo_epochs
        self.minibatches = minibatches
        self.micro_batch_size = micro_batch_size
        self.max_grad_norm = max_grad_norm
        self.logprob_chunk_rows = logprob_chunk_rows
        self.gradient_checkpointing = gradient_checkpointing
        self.trust_remote_code = trust_remote_code
        self.samples_to_log = samples_to_log
        self.seed = seed
        self.automatic_optimization = False
        self.policy: torch.nn.Module | None = None
        self.tokenizer = None
        self.checkpoint_dir: Path | None = None
        self._reference: list[torch.nn.Module] = []  # a list keeps it out of state_dict and checkpoints
        self._metrics: dict[str, MeanMetric] = {}

    # ---- model ----

    def configure_model(self) -> None:
        if self.policy is not None:
            return
        from rlkit.models import embedded_checkpoint, load_policy, load_tokenizer

        directory = embedded_checkpoint() if self.checkpoint is None else Path(self.checkpoint)
        self.checkpoint_dir = Path(directory)
        self.tokenizer = load_tokenizer(self.checkpoint_dir, trust_remote_code=self.trust_remote_code)
        self.policy = load_policy(self.checkpoint_dir, trust_remote_code=self.trust_remote_code).train()
        if self.gradient_checkpointing:
            self.policy.gradient_checkpointing_enable()
        if self.kl is not None:
            reference = copy.deepcopy(self.policy).eval().requires_grad_(False)
            self._reference = [reference]

    def configure_optimizers(self):
        optimizer = self.optimizer_factory(self.policy.parameters())
        if self.scheduler_factory is None:
            return optimizer
        scheduler = self.scheduler_factory(optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ---- the engine meets the trainer here ----

    def _attach_engine(self) -> None:
        datamodule = self.trainer.datamodule
        datamodule.wants_baselines = "baselines" in self.advantage.requires
        datamodule.attach(str(self.checkpoint_dir), self.tokenizer, trust_remote_code=self.trust_remote_code)
        for reference in self._reference:
            reference.to(self.device)
        # the engine starts from the checkpoint directory; after a resume the policy differs
        datamodule.push_weights(self.full_state_dict().items())

    def _fsdp_root(self):
        """The FSDP wrapper Lightning put around this module, if any (FSDP1)."""
        from torch.distributed.fsdp import FullyShardedDataParallel

        wrapper = getattr(self._trainer.strategy, "model", None) if self._trainer is not None else None
        return wrapper if isinstance(wrapper, FullyShardedDataParallel) else None

    def full_state_dict(self) -> dict[str, Tensor]:
        """The policy's whole weights under Hugging Face names, gathered if the policy is sharded.

        Collective under FSDP: every rank must call it. Lightning's FSDP wraps this whole module, so
        the policy's own parameters are shard views outside forward; ``summon_full_params`` on the
        wrapper makes them whole for the copy. DTensor parameters (FSDP2) are gathered with
        ``full_tensor()``.
        """
        root = self._fsdp_root()
        if root is not None:
            from torch.distributed.fsdp import FullyShardedDataParallel

            with FullyShardedDataParallel.summon_full_params(root, writeback=False):
                return {name: t.detach().clone() for name, t in self.policy.state_dict().items()}
        state = self.policy.state_dict()
        return {name: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach() for name, t in state.items()}

    def on_fit_start(self) -> None:
        datamodule = self.trainer.datamodule
        rows = datamodule.prompts_per_step // self.trainer.world_size * datamodule.samples_per_prompt
        if rows < self.minibatches:
            raise ConfigError(
                f"each rank holds {rows} completions per rollout, fewer than model.minibatches={self.minibatches}: "
                "lower model.minibatches or raise data.prompts_per_step / data.samples_per_prompt"
            )
        self._attach_engine()
        self._log_hparams()

    def on_train_start(self) -> None:
        # The held-out score before any update, so the curve in TensorBoard starts where RL starts.
        if self.global_step == 0 and self.logger is not None and self.trainer.limit_val_batches != 0:
            for batch in self.trainer.datamodule.val_dataloader():
                self.validation_step(batch, 0)
            values = self._flush("val/")
            if values:
                self.logger.log_metrics({k: v.item() for k, v in values.items()}, step=0)

    def on_validation_start(self) -> None:
        if self.trainer.state.fn == "validate":
            self._attach_engine()

    # ---- log-probs ----

    def _forward_logprobs(
        self, model: torch.nn.Module, rollout: Rollout, temperature: float, entropy: bool = False, raw: bool = False
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Per-token log-probs ``[n, T]`` of the completion under ``model`` at ``temperature``; with
        ``entropy``, the policy's entropy ``[n, T]``; with ``raw``, the untempered log-probs ``[n, T]``
        (what engines report) from the same forward."""
        T = rollout.completion_mask.shape[1]
        out = model(
            input_ids=rollout.input_ids,
            attention_mask=rollout.attention_mask,
            position_ids=rollout.position_ids,
            logits_to_keep=T + 1,
            use_cache=False,
        )
        logits = out.logits[:, :-1, :]  # [n, T, V]: position t predicts completion token t
        targets = rollout.input_ids[:, -T:]  # [n, T]
        chunk = self.logprob_chunk_rows
        logprobs = token_log_probs(logits, targets, chunk_rows=chunk, temperature=temperature)  # [n, T]
        untempered = None
        if raw:
            untempered = logprobs if temperature == 1.0 else token_log_probs(logits, targets, chunk_rows=chunk)
        ent = None
        if entropy:
            scaled = logits if temperature == 1.0 else logits / temperature  # [n, T, V]
            ent = entropy_from_logits(scaled, chunk_rows=chunk)  # [n, T]
        return logprobs, ent, untempered

    def _micro_batches(self, rows: Tensor) -> list[Tensor]:
        size = self.micro_batch_size or len(rows)
        return list(rows.split(size))

    @torch.no_grad()
    def _score_rollout(self, rollout: Rollout) -> tuple[Tensor, Tensor | None, Tensor]:
        """Old log-probs (trainer policy, at the sampling temperature), reference log-probs, and the
        untempered log-probs the engine reports, for the mismatch metrics; each ``[N, T]``."""
        old, ref, raw = [], [], []
        self.policy.eval()
        for rows in self._micro_batches(torch.arange(len(rollout), device=self.device)):
            micro = rollout.select(rows)
            lp, entropy, untempered = self._forward_logprobs(
                self.policy, micro, rollout.temperature, entropy=True, raw=True
            )
            old.append(lp)
            valid = micro.completion_mask.bool()  # [n, T]
            if valid.any():
                self._update("policy/entropy", entropy[valid].mean(), valid.sum())
            raw.append(untempered)
            if self._reference:
                ref.append(self._forward_logprobs(self._reference[0], micro, rollout.temperature)[0])
        self.policy.train()
        return torch.cat(old), torch.cat(ref) if ref else None, torch.cat(raw)

    # ---- the step ----

    def _totals(self, mask: Tensor, max_length: int) -> StepTotals:
        # sequences with at least one valid token (an empty completion must not dilute the others)
        counts = torch.stack([(mask.sum(-1) > 0).sum(), mask.sum()]).to(torch.float64)
        world_size = self.trainer.world_size if self._trainer is not None else 1
        if world_size > 1 and dist.is_available() and dist.is_initialized():
            dist.all_reduce(counts)
        return StepTotals(
            num_sequences=int(counts[0].item()),
            num_tokens=int(counts[1].item()),
            world_size=world_size,
            max_length=max_length,
        )

    def training_step(self, rollout: Rollout, batch_idx: int) -> None:
        timings = dict(rollout.timings)
        start = time.perf_counter()
        self._check_lag(rollout)
        mask = rollout.completion_mask  # [N, T]
        old_lp, ref_lp, raw_lp = self._score_rollout(rollout)  # [N, T] each
        inputs = AdvantageInputs.from_scores(rollout.scores, mask, rollout.group_ids, baselines=rollout.baselines)
        advantages, _ = self.advantage(inputs)  # [N, T]
        timings["logprob"] = time.perf_counter() - start
        self._log_rollout(rollout, advantages, raw_lp)

        start = time.perf_counter()
        optimizer = self.optimizers()
        scheduler = self.lr_schedulers()
        N = len(rollout)
        for epoch in range(self.ppo_epochs):
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + rollout.iteration * 101 + epoch)
            order = torch.randperm(N, generator=generator).to(self.device)  # [N]
            for rows in order.tensor_split(self.minibatches):
                totals = self._totals(mask[rows], rollout.max_new_tokens)
                optimizer.zero_grad(set_to_none=True)
                for micro_rows in self._micro_batches(rows):
                    self._backward_micro(rollout, micro_rows, old_lp, ref_lp, advantages, totals)
                self._optimizer_step(optimizer, scheduler)
        timings["update"] = time.perf_counter() - start
        timings["sync"] = self.trainer.datamodule.push_weights(self.full_state_dict().items())
        self._log_step(timings, rollout)

    def _backward_micro(self, rollout, rows, old_lp, ref_lp, advantages, totals) -> None:
        micro = rollout.select(rows)
        mask = micro.completion_mask  # [n, T]
        # the entropy enters the autograd graph only when it is in the loss; otherwise it is a metric
        logprobs, entropy, _ = self._forward_logprobs(
            self.policy, micro, rollout.temperature, entropy=self.entropy_coef > 0
        )
        ratio = self.ratio(logprobs, old_lp[rows], mask)  # [n, T]
        clipped = self.clip(ratio, advantages[rows], mask)
        loss_mat = clipped.loss  # [n, T]
        parts = {"loss/policy": clipped.loss}
        if self.kl is not None:
            kl_mat = self.kl(logprobs, ref_lp[rows])  # [n, T]
            parts["loss/kl"] = kl_mat
            if self.kl_coef > 0:
                loss_mat = loss_mat + self.kl_coef * kl_mat
        if self.entropy_coef > 0:
            parts["loss/entropy"] = entropy
            loss_mat = loss_mat - self.entropy_coef * entropy
        loss = self.aggregation(loss_mat, mask, totals)
        if not self._finite_everywhere(loss):
            bad = [name for name, value in parts.items() if not torch.isfinite(value[mask.bool()]).all()]
            raise NonFiniteError(
                f"the loss of rollout {rollout.iteration} is {loss.item()} (non-finite: {', '.join(bad) or 'loss'}). "
                "Lower the learning rate, check the rewards for NaN/inf, keep model.max_grad_norm set, or use "
                "fp32/bf16 rather than fp16; resume from the last checkpoint with --ckpt_path=last."
            )
        self.manual_backward(loss)

        with torch.no_grad():
            weight = mask.sum()
            # each micro-batch's aggregated value is its share of the step; per-step sums, averaged over steps
            # this micro-batch's share of the step; with W ranks each rank holds ~1/W of the rows and its
            # aggregated values carry the factor W, so its shares sum to ~W: the weighted mean is exact
            share = len(rows) * totals.world_size / totals.num_sequences
            for name, value in parts.items():
                self._update(name, self.aggregation(value.detach(), mask, totals) / share, share)
            self._update("loss/total", loss.detach() / share, share)
            valid = mask.bool()
            ratio_valid = ratio.detach()[valid]  # [tokens]
            if ratio_valid.numel():
                self._update("ratio/mean", ratio_valid.mean(), weight)
                self._update("ratio/max", ratio_valid.max(), 1.0, reduce="max")
                self._update("ratio/min", ratio_valid.min(), 1.0, reduce="min")
                # mean of log pi_old - log pi: verl's actor/ppo_kl
                self._update("ratio/approx_kl", (old_lp[rows] - logprobs.detach())[valid].mean(), weight)
            for name, where in clipped.clipped.items():
                if weight > 0:
                    self._update(f"clip/{name}", (where & valid).sum() / weight, weight)

    def _finite_everywhere(self, loss: Tensor) -> bool:
        """Whether the loss is finite on every rank (one flag all-reduced: all ranks stop together)."""
        bad = (~torch.isfinite(loss.detach())).to(torch.float32).reshape(1)  # [1]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return bad.item() == 0

    def _optimizer_step(self, optimizer, scheduler) -> None:
        root = self._fsdp_root()
        if root is not None:  # the norm over all shards, not this rank's
            norm = root.clip_grad_norm_(self.max_grad_norm if self.max_grad_norm is not None else math.inf)
        elif self.max_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.max_grad_norm)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in self.policy.parameters() if p.grad is not None])
        if not torch.isfinite(norm):
            raise NonFiniteError(
                f"the gradient norm is {norm.item()}: lower the learning rate or set model.max_grad_norm; "
                "resume from the last checkpoint with --ckpt_path=last."
            )
        self._update("grad/norm", norm, 1.0)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()

    def _check_lag(self, rollout: Rollout) -> None:
        """Zero policy lag: rollout k must come from the weights after update k-1."""
        lag = self.trainer.datamodule.weights_version - rollout.weights_version
        if lag != 0:
            raise RuntimeError(
                f"rollout {rollout.iteration} was generated with weights {lag} update(s) old; "
                "the rollout stream must be sized so Lightning does not prefetch it"
            )

    # ---- metrics ----

    _METRIC_KINDS = {"mean": MeanMetric, "max": MaxMetric, "min": MinMetric}

    def _metric(self, name: str, reduce: str):
        metric = self._metrics.get(name)
        if metric is None:
            metric = self._METRIC_KINDS[reduce]().to(self.device)
            metric.reduce = reduce
            self._metrics[name] = metric
        return metric

    def _update(self, name: str, value, weight=1.0, reduce: str = "mean") -> None:
        # Metric states must be normal tensors: validation runs under inference mode, training does not.
        with torch.inference_mode(False):
            metric = self._metric(name, reduce)
            value = torch.as_tensor(value, dtype=torch.float32, device=self.device)
            if reduce == "mean":
                metric.update(value, torch.as_tensor(weight, dtype=torch.float32, device=self.device))
            else:
                metric.update(value)

    def _flush(self, prefix: str | None = None) -> dict[str, Tensor]:
        """Compute (reduced over ranks) and reset the metrics whose names start with ``prefix``
        (None: all but ``val/``)."""

        def selected(name: str) -> bool:
            return not name.startswith("val/") if prefix is None else name.startswith(prefix)

        kinds = {name: m.reduce for name, m in self._metrics.items() if selected(name)}
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if distributed:
            # compute() is collective: every rank must reduce the same metrics in the same order
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, kinds)
            kinds = {name: kind for ranks_kinds in gathered for name, kind in ranks_kinds.items()}
        values = {}
        with torch.inference_mode(False):
            for name in sorted(kinds):
                metric = self._metric(name, kinds[name])
                if distributed or metric.update_called:
                    values[name] = metric.compute()
                metric.reset()
        return values

    def _log_rollout(self, rollout: Rollout, advantages: Tensor, raw_lp: Tensor) -> None:
        mask = rollout.completion_mask.bool()  # [N, T]
        lengths = rollout.completion_mask.sum(-1)  # [N]
        n = float(len(rollout))
        self._update("reward/mean", rollout.scores.mean(), n)
        self._update("reward/std", rollout.scores.std() if len(rollout) > 1 else 0.0, n)
        for name, values in rollout.reward_terms.items():
            self._update(f"reward/{name}", values.mean(), n)
        self._update("advantage/mean", advantages[mask].mean() if mask.any() else 0.0, mask.sum())
        self._update("advantage/std", advantages[mask].std() if mask.sum() > 1 else 0.0, mask.sum())
        self._update("advantage/max", advantages[mask].max() if mask.any() else 0.0, 1.0, reduce="max")
        self._update("advantage/min", advantages[mask].min() if mask.any() else 0.0, 1.0, reduce="min")
        self._update("completion/length", lengths.mean(), n)
        self._update("completion/length_max", lengths.max(), 1.0, reduce="max")
        self._update("completion/truncated_fraction", rollout.truncated.float().mean(), n)
        if mask.any():
            diff = rollout.engine_logprobs[mask] - raw_lp[mask]  # [tokens]
            self._update("mismatch/logprob_abs_diff", diff.abs().mean(), mask.sum())
            self._update("mismatch/logprob_abs_diff_max", diff.abs().max(), 1.0, reduce="max")
            # k3 estimate of KL(engine || trainer) on the engine's samples
            self._update("mismatch/kl", (torch.exp(-diff) - 1 + diff).mean(), mask.sum())
        experiment = getattr(self.logger, "experiment", None)
        if self.samples_to_log and self._should_log(rollout) and hasattr(experiment, "add_text"):
            # the first completion of each of the first groups: different prompts, not one prompt 4 times
            ids = rollout.group_ids  # [N]
            first = torch.cat([ids.new_ones(1, dtype=torch.bool), ids[1:] != ids[:-1]]).nonzero().flatten().tolist()
            rows = [
                f"**{i}** `{rollout.prompt_texts[i]!r}` → `{rollout.texts[i]!r}` "
                f"(reward {rollout.scores[i].item():.3g})"
                for i in first[: self.samples_to_log]
            ]
            experiment.add_text("samples", "\n\n".join(rows), self.global_step)

    def _log_step(self, timings: dict[str, float], rollout: Rollout) -> None:
        """Write this step's metrics straight to the logger.

        The values are already reduced over ranks by torchmetrics; routing ~40 scalars a step through
        ``self.log`` cost ~40 ms of Lightning bookkeeping per step (``benchmarks/step.py``), more than the
        tiny model's whole update. They still reach ``trainer.callback_metrics`` (for checkpoint monitors).
        """
        self.last_timings = dict(timings)
        values = {name: value.item() for name, value in self._flush().items()}
        total = sum(timings.values())
        values.update({f"time/{name}": seconds for name, seconds in timings.items()})
        values["time/step"] = total
        tokens = rollout.completion_mask.sum().item()
        values["perf/rollout_tokens_per_s"] = tokens / max(timings.get("generate", 0.0), 1e-9)
        values["perf/tokens_per_s"] = tokens / max(total, 1e-9)
        values["lr"] = self.optimizers().param_groups[0]["lr"]
        values["buffer/groups"] = float(rollout.group_ids.max().item() + 1)
        values["rollout/iteration"] = float(rollout.iteration)
        self.trainer.callback_metrics.update({name: torch.tensor(value) for name, value in values.items()})
        if self.logger is not None and self._should_log(rollout):
            self.logger.log_metrics(values, step=self.global_step)
        self.log("reward", values["reward/mean"], prog_bar=True, on_step=True, logger=False, batch_size=len(rollout))

    def _should_log(self, rollout: Rollout) -> bool:
        return rollout.iteration % max(self.trainer.log_every_n_steps, 1) == 0

    # ---- validation ----

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        n = float(len(batch["scores"]))
        if n == 0:  # this rank's share of the batch is empty
            return
        for name, values in batch.items():
            self._update(f"val/{name}" if name != "scores" else "val/reward", values.mean(), n)

    def on_validation_epoch_end(self) -> None:
        values = self._flush("val/")
        if values:
            self.log_dict(values, on_epoch=True, prog_bar=False)
            self.log("val_reward", values["val/reward"], prog_bar=True, logger=False)

    def _log_hparams(self) -> None:
        if self.logger is None:
            return
        names = {
            "advantage": self.advantage,
            "ratio": self.ratio,
            "clip": self.clip,
            "aggregation": self.aggregation,
            "kl": self.kl,
        }
        params = {key: type(value).__name__ if value is not None else "none" for key, value in names.items()}
        for key, value in names.items():
            for attr, setting in (vars(value) if value is not None else {}).items():
                if isinstance(setting, int | float | bool | str) and not attr.startswith("_"):
                    params[f"{key}.{attr}"] = setting
        params.update(
            kl_coef=self.kl_coef,
            entropy_coef=self.entropy_coef,
            ppo_epochs=self.ppo_epochs,
            minibatches=self.minibatches,
            checkpoint=str(self.checkpoint_dir),
        )
        self.logger.log_hyperparams(params, metrics={"reward/mean": math.nan, "val/reward": math.nan})
