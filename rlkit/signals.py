"""SIGINT (Ctrl-C) and SIGTERM during ``rlkit fit``: a checkpoint at the next safe point, then exit 130 / 143.

Lightning turns Ctrl-C into "Detected KeyboardInterrupt, attempting graceful shutdown" and exit 1, and
SIGTERM into ``SystemExit()`` (exit 0) at the end of the batch; neither saves the steps since the last
checkpoint. :class:`StopOnSignal` replaces both handlers while training. The first signal only sets a flag;
at the end of the rollout being trained on (``on_train_batch_end``: all of its ``ppo_epochs x minibatches``
optimizer steps done and the data side's counter advanced, the point every ModelCheckpoint save is taken
at, so the checkpoint resumes bitwise) the run's ``last.ckpt`` is written atomically and
:class:`Interrupted` ends the fit. The CLI prints the resume command and exits ``128 + signal``, the
shell's convention. A second SIGINT (Ctrl-C again) stops at once, without a checkpoint; a repeated SIGTERM
changes nothing (senders of SIGTERM follow it with SIGKILL, and a study's run gets two when the study dies).
Under data parallelism the ranks agree on the flag at every rollout's end (one all-reduce of one integer), so
all stop at the same step.
Before training starts and after it ends there is nothing new to save: a signal stops at once.
"""

from __future__ import annotations

import shlex
import signal
import sys
import threading
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Checkpoint

from rlkit.errors import RLKitError

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(RLKitError):
    """A fit stopped by a signal, with the checkpoint written on the way out (None: stopped at once).

    Args:
        signum: the signal received.
        step: the optimizer step the checkpoint holds.
        checkpoint: where it was written.
        resume_with: the ``--ckpt_path`` value that resumes it (``last``: found by ``--ckpt_path=last``).
    """

    def __init__(
        self, signum: int, step: int | None = None, checkpoint: Path | None = None, resume_with: str = "last"
    ) -> None:
        self.signum, self.step, self.checkpoint, self.resume_with = signum, step, checkpoint, resume_with
        self.quiet = False  # True on data-parallel ranks other than 0
        self.exit_code = 128 + signum
        name = signal.Signals(signum).name
        if checkpoint is None:
            said = f"stopped by {name} before the end of a rollout: no checkpoint written since the last one"
        else:
            said = f"stopped by {name} at step {step}: checkpoint written to {checkpoint}"
        super().__init__(said)

    def report(self, argv: list[str]) -> str:
        """The message and the command that resumes the run."""
        return f"rlkit: {self}\n  resume with: {resume_command(argv, self.resume_with)}"


def resume_command(argv: list[str], ckpt_path: str = "last") -> str:
    """``argv`` (the arguments after ``rlkit``) with ``--ckpt_path=<ckpt_path>`` in place of any ``--ckpt_path``."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--ckpt_path":
            skip = True
        elif not arg.startswith("--ckpt_path="):
            kept.append(arg)
    return shlex.join(["rlkit", *kept, f"--ckpt_path={ckpt_path}"])


class StopOnSignal(pl.Callback):
    """Stop a fit on SIGINT or SIGTERM at the end of the current rollout, with a checkpoint (module docstring)."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._training = False
        self._quiet = False
        self._previous: dict[int, object] = {}

    # ---- handlers ----

    def _install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # Python delivers signals to the main thread only
        for signum in SIGNALS:
            previous = signal.signal(signum, self._handle)
            self._previous.setdefault(signum, previous)

    def _restore(self) -> None:
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) == self._handle:
                signal.signal(signum, previous)
        self._previous = {}

    def _handle(self, signum: int, frame) -> None:
        if not self._training or (self.received is not None and signum == signal.SIGINT):
            raise Interrupted(signum)
        if self.received is not None:
            return  # a repeated SIGTERM (a study's child gets two when the study dies): already stopping
        self.received = signum
        if not self._quiet:
            print(
                f"\nrlkit: {signal.Signals(signum).name} received: stopping at the end of this rollout's updates "
                "with a checkpoint (Ctrl-C again: stop at once, without one)",
                file=sys.stderr,
                flush=True,
            )

    # ---- Lightning hooks ----

    # Installed from `setup` (the models load, the engine starts: a signal stops at once) and again from
    # `on_train_start`; given back in between, so that Lightning, which registers its SIGTERM handler after
    # `on_fit_start` and restores what it found when the fit ends, finds and restores the original handlers.

    def setup(self, trainer: pl.Trainer, module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self.received, self._quiet = None, not trainer.is_global_zero
            self._save_after_the_weights_push(trainer)
            self._install()

    def on_fit_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self._restore()

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self._training = True
        self._install()

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs, batch, batch_idx: int):
        signum = self._agreed(trainer)
        if signum is None:
            return
        self._training = False  # a signal while saving stops at once (the write is atomic)
        path = self.checkpoint_path(trainer)
        trainer.save_checkpoint(path, weights_only=False)  # the whole state: optimizer, loops, data
        # --ckpt_path=last finds a checkpoint callback's last.ckpt; without one, the file itself resumes
        resume_with = "last" if trainer.checkpoint_callbacks else str(path)
        stop = Interrupted(signum, trainer.global_step, path, resume_with)
        stop.quiet = not trainer.is_global_zero  # one report, from rank 0
        raise stop

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self._training = False
        self._restore()

    def teardown(self, trainer: pl.Trainer, module: pl.LightningModule, stage: str) -> None:
        self._training = False
        self._restore()

    def on_exception(self, trainer: pl.Trainer, module: pl.LightningModule, exception: BaseException) -> None:
        self._training = False
        self._restore()

    # ---- helpers ----

    def _save_after_the_weights_push(self, trainer: pl.Trainer) -> None:
        """Run after every callback but the checkpoint ones, as Lightning orders ModelCheckpoint: the save at
        ``on_train_batch_end`` then follows ``WeightSync``'s push at the same hook (a model callback, attached
        after the trainer's), so with ``data.max_staleness >= 1`` the checkpoint holds the latest weights
        version and the rollouts sampled ahead by older ones, and the resume is exact."""
        others = [callback for callback in trainer.callbacks if callback is not self]
        at = next((i for i, callback in enumerate(others) if isinstance(callback, Checkpoint)), len(others))
        trainer.callbacks = [*others[:at], self, *others[at:]]  # a new list: the hooks being called keep theirs

    def _agreed(self, trainer: pl.Trainer) -> int | None:
        """The signal any rank received (the ranks stop together), or None."""
        received = self.received or 0
        if trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            flag = torch.tensor([received], device=trainer.strategy.root_device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            received = int(flag.item())
        return received or None

    @staticmethod
    def checkpoint_path(trainer: pl.Trainer) -> Path:
        """The run's ``last.ckpt``: in the first checkpoint callback's folder (where ``--ckpt_path=last``
        looks), else in ``trainer.default_root_dir``."""
        directory = next((c.dirpath for c in trainer.checkpoint_callbacks if getattr(c, "dirpath", None)), None)
        return Path(directory or trainer.default_root_dir) / "last.ckpt"
