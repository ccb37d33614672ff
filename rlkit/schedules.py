"""Learning-rate schedules whose length is the run's: ``trainer.max_steps`` unless given."""

from __future__ import annotations

import sys

from lightning.fabric.utilities.rank_zero import rank_zero_only
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


class LinearDecay(LambdaLR):
    """Linear warm-up from 0 over ``warmup_steps``, then linear decay to ``end_factor`` x lr at the last step.

    ``total_steps=None`` (the default) takes the run's length, ``trainer.max_steps`` (optimizer steps),
    when the module builds its optimizers: the schedule ends where the run ends whatever
    ``--trainer.max_steps`` says. Such a schedule follows the run also on resume: ``--ckpt_path=last
    --trainer.max_steps=8`` after a 5-step run stretches it to 8 steps, as if the run had been 8 steps
    long from the start, and the lr goes on from that schedule's value at step 5 (one line says so)
    instead of staying at the restored schedule's end (0, with the default ``end_factor``).

    Args:
        optimizer: the optimizer (given by the module).
        warmup_steps: optimizer steps of linear warm-up from 0 (0: none).
        end_factor: the lr at the last step, as a fraction of the initial lr.
        total_steps: optimizer steps of the whole schedule; None = ``trainer.max_steps``.
    """

    def __init__(
        self, optimizer: Optimizer, warmup_steps: int = 0, end_factor: float = 0.0, total_steps: int | None = None
    ) -> None:
        if warmup_steps < 0:
            raise ValueError(f"LinearDecay warmup_steps={warmup_steps} must be >= 0")
        if not 0.0 <= end_factor <= 1.0:
            raise ValueError(f"LinearDecay end_factor={end_factor} must lie in [0, 1] (0: decay to zero)")
        if total_steps is not None and total_steps <= warmup_steps:
            raise ValueError(f"LinearDecay total_steps={total_steps} must exceed warmup_steps={warmup_steps}")
        self.warmup_steps = warmup_steps
        self.end_factor = end_factor
        self.total_steps = total_steps
        self.follows_run = False  # True when total_steps was taken from trainer.max_steps
        super().__init__(optimizer, self.factor)

    def factor(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        if self.total_steps is None:
            return 1.0
        progress = min((step - self.warmup_steps) / max(self.total_steps - self.warmup_steps, 1), 1.0)
        return 1.0 + (self.end_factor - 1.0) * progress

    def state_dict(self) -> dict:
        # the bound method self.factor must not be pickled; everything it reads is a plain attribute
        return {k: v for k, v in self.__dict__.items() if k not in ("optimizer", "lr_lambdas")}

    def load_state_dict(self, state_dict: dict) -> None:
        length, follows_run = self.total_steps, self.follows_run
        self.__dict__.update({k: v for k, v in state_dict.items() if k != "lr_lambdas"})
        if not follows_run or length == self.total_steps:
            return
        # the run's length changed on resume: keep the new one and set the lr the next step uses from it
        # (Lightning restores the optimizer, with the old schedule's last lr, before its schedule)
        old, self.total_steps, self.follows_run = self.total_steps, length, True
        lrs = [base * self.factor(self.last_epoch) for base in self.base_lrs]
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        self._last_lr = lrs
        if getattr(rank_zero_only, "rank", 0) == 0:  # once, not by every rank of a data-parallel run
            print(
                f"rlkit: {type(self).__name__} schedule stretched from {old} to {length} optimizer steps "
                f"(trainer.max_steps): the lr goes on at {lrs[0]:.3g} from step {self.last_epoch}",
                file=sys.stderr,
            )
