"""Critic losses: per-token value loss ``[N, T]``, reduced afterwards by an ``Aggregation``."""

from __future__ import annotations

from abc import abstractmethod

import torch
from torch import Tensor

from rlkit.components.base import Component
from rlkit.components.clip import ClipOutput


class ValueLoss(Component):
    """Base of every critic loss: ``__call__(values, returns, old_values) -> ClipOutput``, all ``[N, T]``.

    ``values`` carries the gradient; ``old_values`` are the critic's predictions at rollout time.
    """

    @abstractmethod
    def __call__(self, values: Tensor, returns: Tensor, old_values: Tensor) -> ClipOutput: ...


class ClippedValueLoss(ValueLoss):
    """PPO's clipped value loss (Schulman et al. 2017; verl ``compute_value_loss``).

    ``l_t = (1/2) max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)``; with ``clip_range=None``
    ``l_t = (1/2)(V - R)^2``. ``clipped["fraction"]`` marks where the clipped error is strictly
    larger (verl ``critic/vf_clipfrac``); restrict it to the mask when reporting.

    Args:
        clip_range: ``c``, how far the new value may move from the rollout-time value before the
            loss stops rewarding the move; ``None`` disables clipping.
    """

    def __init__(self, clip_range: float | None = 0.2):
        if clip_range is not None and not clip_range > 0:
            raise ValueError(
                f"ClippedValueLoss clip_range={clip_range} must be > 0 (e.g. 0.2, in the units of the "
                "returns), or None for the unclipped squared error."
            )
        self.clip_range = clip_range

    def __call__(self, values: Tensor, returns: Tensor, old_values: Tensor) -> ClipOutput:
        unclipped = (values - returns).square()  # [N, T]
        if self.clip_range is None:
            return ClipOutput(loss=0.5 * unclipped, clipped={"fraction": torch.zeros_like(unclipped, dtype=torch.bool)})
        moved = torch.clamp(values, old_values - self.clip_range, old_values + self.clip_range)  # [N, T]
        clipped = (moved - returns).square()  # [N, T]
        return ClipOutput(loss=0.5 * torch.maximum(unclipped, clipped), clipped={"fraction": clipped > unclipped})
