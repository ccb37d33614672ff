"""HeldOutEvaluation: the greedy held-out reward, before the first update, during and after the run."""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from rlkit.rollouts.source import HeldOutBatch, rollout_source
from rlkit.spine.metrics import StepMetrics
from rlkit.spine.reporting import _code, write_samples, write_scalars, write_text

SAMPLES_SHOWN = 8


class HeldOutEvaluation(pl.Callback):
    """Score the held-out prompts greedily and log ``val/*`` at the number of rollouts trained on.

    Lightning's own validation runs every ``trainer.val_check_interval`` rollouts; this callback adds an
    evaluation before any update (step 0, where the curve must start) and one after the last update
    when Lightning's schedule did not end on it, so every run's final held-out score is measured.
    Values are reduced over data-parallel ranks. The greedy completions of the first prompts go to the
    TEXT tab, the logger's tables and ``samples.jsonl`` (:func:`~rlkit.spine.reporting.write_samples`).

    The module is a :class:`~rlkit.spine.family.Family` (its spine counts the rollouts trained on); its
    ``validation_step`` returns the batch, a :class:`~rlkit.rollouts.source.HeldOutBatch`.
    """

    def __init__(self) -> None:
        self.metrics = StepMetrics()
        self.last_step: int | None = None
        #: ``val/reward`` of the last evaluation during ``fit`` (after ``last_step`` rollouts), None before one
        self.last_reward: float | None = None
        self._shown: list[dict] = []
        self._pending_rows: list[dict] = []

    def setup(self, trainer: pl.Trainer, module: pl.LightningModule, stage: str) -> None:
        self.metrics.to(module.device)

    def _update(self, batch: HeldOutBatch) -> None:
        scores = batch.scores
        n = float(len(scores))
        if n == 0:  # this rank's share of the batch is empty
            return
        values = {"val/reward": scores, **{f"val/{name}": v for name, v in batch.terms.items()}}
        values.update({f"val/episode/{name}": v for name, v in batch.episode.items()})
        if batch.lengths is not None:
            values["val/length"] = batch.lengths
        for name, value in values.items():
            applies = ~value.float().isnan()  # a reward function returns None where it does not apply
            if applies.any():
                self.metrics.update(name, value.float()[applies].mean(), applies.sum())
        room = SAMPLES_SHOWN - len(self._shown)
        shown = zip(batch.prompts[:room], batch.texts[:room], scores[:room].tolist(), strict=True)
        for prompt, text, score in shown:
            self._shown.append({"prompt": prompt, "completion": text, "reward": score})

    def _compute(self) -> dict:
        """The reduced ``val/*`` values (collective under DDP); the metrics and the shown samples reset."""
        self._shown, shown = [], self._shown
        self._pending_rows = shown
        return {name: value.item() for name, value in self.metrics.compute().items()}

    def _write(self, trainer: pl.Trainer, module: pl.LightningModule) -> dict:
        values = self._compute()
        step = module.spine.rollouts_done
        self.last_step = step
        if values:
            self.last_reward = values["val/reward"]
            write_scalars(module, values, step)
            hp = {"hp/val_reward": values["val/reward"]}  # the HPARAMS metric, in its own sub-run
            module.trainer.callback_metrics.update({k: torch.tensor(v) for k, v in hp.items()})
            if module.spine.writer.hparams_run is not None:
                module.spine.writer.hparams_run.log(hp, step)
        if self._pending_rows:
            lines = [
                f"| `{_code(r['prompt'])}` | `{_code(r['completion'])}` | {r['reward']:.3g} |"
                for r in self._pending_rows
            ]
            table = "| prompt | greedy completion | reward |\n|---|---|---|\n" + "\n".join(lines)
            write_text(module, "validation", table, step)
            write_samples(module, "validation", self._pending_rows, step)
        return values

    def _run(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if trainer.limit_val_batches == 0:
            return
        for batch in rollout_source(trainer).held_out_batches():
            self._update(batch)
        self._write(trainer, module)

    def on_validation_batch_end(self, trainer, module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._update(batch)

    def on_validation_epoch_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        fitting = trainer.state.fn == "fit"
        values = self._write(trainer, module) if fitting else self._compute()
        if values:
            # through Lightning too: trainer.validate() returns (and `rlkit validate` prints) these; during
            # fit they are already logged at the rollout count, so Lightning only feeds the progress bar
            module.log_dict({k: v for k, v in values.items() if k.startswith("val/")}, logger=not fitting)
            module.log("val_reward", values["val/reward"], prog_bar=True, logger=False)

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if trainer.global_step == 0:
            self._run(trainer, module)

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if self.last_step != module.spine.rollouts_done:
            self._run(trainer, module)
