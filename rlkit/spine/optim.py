"""Optimizers and schedules for a family's parameter groups, with configuration errors in one line."""

from __future__ import annotations

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import Tensor

from rlkit.errors import ConfigError
from rlkit.spine.policy import clip_gradients
from rlkit.spine.settings import Optimization


def adamw(params) -> torch.optim.Optimizer:
    """The families' default optimizer: AdamW, lr 1e-6, no weight decay (configs set their own)."""
    return torch.optim.AdamW(params, lr=1e-6, weight_decay=0.0)


def build_optimizer(parameters, optim: Optimization, *, max_steps: int = -1, key: str = "model.optim"):
    """``(optimizer, scheduler or None)`` for ``parameters``, as ``optim`` (at config key ``key``) says.

    The factories are LightningCLI callables (``optimizer(params)``, ``lr_scheduler(optimizer)``); a value
    they reject (a negative learning rate, an unknown argument) is reported as a configuration error
    naming ``{key}.optimizer`` or ``{key}.lr_scheduler``. A schedule with ``total_steps=None``
    (:class:`~rlkit.schedules.LinearDecay`) is given the run's length, ``max_steps``.
    """
    try:
        optimizer = (optim.optimizer or adamw)(parameters)
    except (ValueError, TypeError) as error:
        raise ConfigError(f"{key}.optimizer: {error}") from error
    if optim.lr_scheduler is None:
        return optimizer, None
    try:
        scheduler = optim.lr_scheduler(optimizer)
    except (ValueError, TypeError) as error:
        raise ConfigError(f"{key}.lr_scheduler: {error}") from error
    if getattr(scheduler, "total_steps", 0) is None:
        if max_steps is None or max_steps < 1:
            raise ConfigError(
                f"{key}.lr_scheduler {type(scheduler).__name__} takes its length from trainer.max_steps, which is "
                f"not set ({max_steps}): set --trainer.max_steps or the schedule's total_steps"
            )
        scheduler.total_steps = max_steps
        scheduler.follows_run = True  # a resume with another max_steps extends it (LinearDecay.load_state_dict)
    return optimizer, scheduler


def step_optimizer(
    optimizer, scheduler, parameters, max_grad_norm: float | None, trainer, what: str = "model.optim.max_grad_norm"
) -> Tensor:
    """Clip the gradients of ``parameters`` to ``max_grad_norm`` (None: only measure; ``what`` names it in
    errors), step ``optimizer`` and ``scheduler``, zero the gradients; return the norm before clipping.

    ``optimizer`` is a Lightning optimizer (its step counts as a ``trainer.global_step``) or a plain torch
    optimizer, stepped through the strategy so that precision plugins still apply without counting a step.
    """
    norm = clip_gradients(parameters, max_grad_norm, trainer, what=what)
    if isinstance(optimizer, LightningOptimizer):
        optimizer.step()
    else:
        trainer.strategy.optimizer_step(optimizer, closure=_no_closure)
    optimizer.zero_grad(set_to_none=True)
    if scheduler is not None:
        scheduler.step()
    return norm


def _no_closure() -> None:
    return None


def lightning_optimizers(parameters, optim: Optimization, *, max_steps: int = -1, key: str = "model.optim"):
    """What ``configure_optimizers`` returns for one parameter group: the optimizer, and its schedule
    stepped once per optimizer step (see :func:`build_optimizer`)."""
    optimizer, scheduler = build_optimizer(parameters, optim, max_steps=max_steps, key=key)
    if scheduler is None:
        return optimizer
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
