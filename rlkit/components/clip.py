"""Clipped surrogate objectives: per-token policy loss from ratio and advantage."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class ClipOutput:
    """Per-token loss ``[N, T]`` plus ``[N, T]`` boolean masks of where each clip was active.

    The masks let the caller report fractions over the whole optimizer step (mask-weighted),
    so the metric is correct however the step is split into micro-batches.
    """

    loss: Tensor
    clipped: dict[str, Tensor] = field(default_factory=dict)


class Clip(ABC):
    """Base of every clip. ``__call__(ratio, advantages, mask) -> ClipOutput``, all ``[N, T]``."""

    @abstractmethod
    def __call__(self, ratio: Tensor, advantages: Tensor, mask: Tensor) -> ClipOutput: ...


class PPOClip(Clip):
    """PPO's clipped surrogate (Schulman et al. 2017), with clip-higher and dual-clip.

    ``loss = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))``; clip-higher (DAPO, Yu et al. 2025)
    is ``eps_high > eps_low``. Dual-clip (Ye et al. 2020) bounds the loss of negative advantages:
    ``loss = min(loss, -A c)`` where ``A < 0``.

    ``clipped`` masks: ``"fraction"`` where the clipped term is strictly larger (verl's
    ``actor/pg_clipfrac``), split into ``"lower"`` (``A < 0``, ``r < 1 - eps_low``) and ``"upper"``
    (``A > 0``, ``r > 1 + eps_high``); ``"dual"`` where the dual clip bounds the loss (verl's
    ``actor/pg_clipfrac_lower``).

    Args:
        eps_low: lower clip range, ``r >= 1 - eps_low``; in (0, 1).
        eps_high: upper clip range, ``r <= 1 + eps_high``; ``None`` means ``eps_low`` (symmetric).
        dual_clip: constant ``c > 1`` bounding the loss of negative advantages at ``-A c``;
            ``None`` disables it.
    """

    def __init__(self, eps_low: float = 0.2, eps_high: float | None = None, dual_clip: float | None = None):
        if not 0.0 < eps_low < 1.0:
            raise ValueError(
                f"PPOClip eps_low={eps_low} must be in (0, 1): the lower bound 1 - eps_low must stay "
                "positive; typical values are 0.1-0.3."
            )
        if eps_high is not None and not eps_high > 0.0:
            raise ValueError(
                f"PPOClip eps_high={eps_high} must be > 0 (e.g. 0.28 for DAPO's clip-higher), "
                "or None for the symmetric clip eps_high = eps_low."
            )
        if dual_clip is not None and not dual_clip > 1.0:
            raise ValueError(
                f"PPOClip dual_clip={dual_clip} must be > 1 (the bound is -A * c with c > 1, e.g. 3.0), "
                "or None to disable dual-clip."
            )
        self.eps_low = eps_low
        self.eps_high = eps_low if eps_high is None else eps_high
        self.dual_clip = dual_clip

    def __call__(self, ratio: Tensor, advantages: Tensor, mask: Tensor) -> ClipOutput:
        unclipped = -advantages * ratio  # [N, T]
        clipped = -advantages * torch.clamp(ratio, 1.0 - self.eps_low, 1.0 + self.eps_high)  # [N, T]
        loss = torch.maximum(unclipped, clipped)  # [N, T]
        valid = mask.bool()  # [N, T]
        fraction = (clipped > unclipped) & valid  # [N, T]
        negative = advantages < 0  # [N, T]
        if self.dual_clip is not None:
            bound = -advantages * self.dual_clip  # [N, T]
            dual = (loss > bound) & negative & valid  # [N, T]
            loss = torch.where(negative, torch.minimum(loss, bound), loss)  # [N, T]
        else:
            dual = torch.zeros_like(valid)  # [N, T]
        return ClipOutput(
            loss=loss,
            clipped={
                "fraction": fraction,
                "lower": fraction & negative,
                "upper": fraction & (advantages > 0),
                "dual": dual,
            },
        )


class NoClip(Clip):
    """The unclipped surrogate ``-A r`` (REINFORCE, GPG with ``LogProb``); all clip masks are False."""

    def __call__(self, ratio: Tensor, advantages: Tensor, mask: Tensor) -> ClipOutput:
        loss = -advantages * ratio  # [N, T]
        never = torch.zeros_like(loss, dtype=torch.bool)  # [N, T]
        return ClipOutput(loss=loss, clipped={"fraction": never, "lower": never, "upper": never, "dual": never})
