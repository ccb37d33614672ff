"""Masked statistics over the tokens of a batch: mean, variance and whitening.

Only positions where ``mask`` is 1 enter the statistics; values elsewhere (padding, tool output) are
never read, even if they are NaN. Semantics follow verl's ``masked_mean`` / ``masked_var`` /
``masked_whiten``: the variance is unbiased (Bessel) by default and whitening is
``(x - mean) * rsqrt(var + eps)``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over the positions where ``mask`` is 1 (all of them, or along ``dim``).

    An empty mask gives 0, not NaN.
    """
    mask = mask.to(x.dtype)
    total = torch.where(mask.bool(), x, 0.0) * mask  # NaNs outside the mask never reach the sum
    if dim is None:
        return total.sum() / mask.sum().clamp(min=1e-8)  # []
    return total.sum(dim) / mask.sum(dim).clamp(min=1e-8)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of ``x`` over all positions where ``mask`` is 1; a scalar.

    Raises:
        ValueError: if ``unbiased`` and fewer than two positions are in the mask (Bessel's
            correction divides by ``count - 1``).
    """
    mask = mask.to(x.dtype)
    mean = masked_mean(x, mask)  # []
    var = masked_mean((x - mean) ** 2, mask)  # []
    return _bessel(var, mask.sum()) if unbiased else var


def _bessel(var: Tensor, count: Tensor) -> Tensor:
    if count < 2:
        raise ValueError(
            f"masked_var(unbiased=True) needs at least 2 unmasked elements, got {count.item():g}: "
            "whitening over the batch is undefined for a single token. Use a batch with more "
            "completion tokens, or unbiased=False."
        )
    return var * count / (count - 1)


def _sum_over_ranks(values: Tensor) -> Tensor:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        values = values.clone()
        dist.all_reduce(values)
    return values


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Whiten ``x`` with the mean and unbiased variance of its masked positions.

    ``(x - mean) / sqrt(var + eps)``, plus ``mean`` again if ``shift_mean`` is False (rescale only).
    Every position is transformed, masked or not; multiply by the mask to zero the rest.

    Under data parallelism (``torch.distributed`` initialised with several ranks) the batch is the whole
    step: mean and variance are taken over every rank's tokens (two all-reduces; every rank must call it),
    so a DDP run whitens exactly as one process does.
    """
    mask = mask.to(x.dtype)
    inside = torch.where(mask.bool(), x, 0.0)  # same shape as x; NaNs outside the mask never reach a sum
    sums = _sum_over_ranks(torch.stack([(inside * mask).sum(), mask.sum()]))  # [2]
    count = sums[1]  # []
    mean = sums[0] / count.clamp(min=1e-8)  # []
    var = _sum_over_ranks(((inside - mean) ** 2 * mask).sum()) / count.clamp(min=1e-8)  # []
    whitened = (x - mean) * torch.rsqrt(_bessel(var, count) + eps)  # same shape as x
    if not shift_mean:
        whitened = whitened + mean
    return whitened
