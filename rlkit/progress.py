"""The progress bar of a run: rollouts done out of the run's total, with the reward and val_reward."""

from __future__ import annotations

import math
import sys

from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm

from rlkit.spine.evaluation import HeldOutEvaluation
from rlkit.spine.family import Family


class RolloutProgressBar(TQDMProgressBar):
    """One bar over the whole run, counted in rollouts.

    Lightning's bar counts batches of an epoch and shows ``Epoch 0/-2`` when only ``max_steps`` is set
    (and ``v_num``); here the total is the run's rollouts, ``max_steps`` optimizer steps divided by the
    optimizer steps each rollout makes (``ppo_epochs x minibatches``), and the postfix is the module's
    progress-bar metrics (``reward``, ``val_reward``).
    """

    @property
    def train_description(self) -> str:
        return "rollouts"

    @staticmethod
    def _steps_per_rollout(module) -> int:
        loop = module.spine.loop if isinstance(module, Family) else None
        return loop.ppo_epochs * loop.minibatches if loop is not None else 1

    def _total_rollouts(self, trainer, module) -> int | None:
        if trainer.max_steps is None or trainer.max_steps < 0:
            return None
        return math.ceil(trainer.max_steps / self._steps_per_rollout(module))

    def on_train_start(self, trainer, module) -> None:
        self.train_progress_bar = Tqdm(
            desc=self.train_description,
            total=self._total_rollouts(trainer, module),
            initial=trainer.global_step // self._steps_per_rollout(module),  # a resumed run starts where it was
            position=2 * self.process_position,
            disable=self.is_disabled,
            leave=True,
            dynamic_ncols=True,
            file=sys.stdout,
            smoothing=0,
            bar_format=self.BAR_FORMAT,
        )

    def on_train_epoch_start(self, trainer, *_) -> None:
        pass  # one bar for the whole run, not one per pass over the prompts

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        bar = self.train_progress_bar
        bar.n = module.spine.rollouts_done if isinstance(module, Family) else bar.n + 1
        self._show(trainer, module)

    def _show(self, trainer, module) -> None:
        """New postfix, drawn now, except on a finished bar: closing it draws it (once, not three times)."""
        bar = self.train_progress_bar
        bar.set_postfix(self.get_metrics(trainer, module), refresh=False)
        if bar.total is None or bar.n < bar.total:
            bar.refresh()

    def on_train_epoch_end(self, trainer, module) -> None:
        self.train_progress_bar.set_postfix(self.get_metrics(trainer, module), refresh=False)

    def on_train_end(self, trainer, module) -> None:
        pass  # the held-out evaluation after the last update runs in on_train_end: the bar closes after it

    def on_fit_end(self, trainer, module) -> None:
        if self.train_progress_bar is not None:
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, module), refresh=False)
            self.train_progress_bar.close()  # draws the final line

    def teardown(self, trainer, module, stage: str) -> None:
        if stage == "fit" and self.train_progress_bar is not None:
            self.train_progress_bar.close()  # a failed fit has no on_fit_end; closing twice is a no-op

    def on_validation_batch_start(self, trainer, module, batch, batch_idx, dataloader_idx=0) -> None:
        if trainer.state.fn == "validate":
            super().on_validation_batch_start(trainer, module, batch, batch_idx, dataloader_idx)

    def on_validation_batch_end(self, trainer, module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if trainer.state.fn == "validate":
            super().on_validation_batch_end(trainer, module, outputs, batch, batch_idx, dataloader_idx)

    def on_validation_start(self, trainer, module) -> None:
        if trainer.state.fn == "validate":
            super().on_validation_start(trainer, module)

    def on_validation_end(self, trainer, module) -> None:
        if trainer.state.fn == "validate":
            super().on_validation_end(trainer, module)
        elif self.train_progress_bar is not None:
            self._show(trainer, module)

    def get_metrics(self, trainer, module) -> dict:
        """Lightning's progress-bar metrics, without ``v_num``, with ``val_reward`` from the last held-out
        evaluation of this fit (also the one before the first update and the one after the last, which
        Lightning's validation loop does not run, so a run shorter than ``val_check_interval`` shows it)."""
        metrics = super().get_metrics(trainer, module)
        metrics.pop("v_num", None)
        evaluation = next((c for c in trainer.callbacks if isinstance(c, HeldOutEvaluation)), None)
        if trainer.state.fn == "fit" and evaluation is not None and evaluation.last_reward is not None:
            metrics["val_reward"] = evaluation.last_reward
        return metrics
