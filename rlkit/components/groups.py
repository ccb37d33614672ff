"""Per-group statistics of per-completion values, vectorised over any number of groups.

Completions of the same prompt share a group id. Ids are arbitrary int64 values (``7``, ``100``, …);
rows of a group need not be contiguous, and groups may have different sizes, including 1. Every
statistic is returned per row (``[N]``, the value of the row's group), which is what advantage
estimators subtract or divide by. The work is a handful of ``index_add_``/gather calls whatever
the number of groups: no Python loop over groups.
"""

from __future__ import annotations

import torch
from torch import Tensor


class Groups:
    """Group structure of a batch, computed once from ``group_ids [N]`` and reused per statistic.

    Args:
        group_ids: ``[N]`` integer id of each row's group (the prompt it answers).
    """

    def __init__(self, group_ids: Tensor) -> None:
        if group_ids.dim() != 1:
            raise ValueError(f"group_ids must be 1-D [N] (one id per completion), got shape {tuple(group_ids.shape)}.")
        if group_ids.is_floating_point() or group_ids.is_complex() or group_ids.dtype == torch.bool:
            raise ValueError(
                f"group_ids must be an integer tensor (int64 prompt ids), got {group_ids.dtype}; "
                "map prompt keys to integers with torch.unique(..., return_inverse=True) first."
            )
        unique, self.index = torch.unique(group_ids, return_inverse=True)  # [G], [N] in 0..G-1
        self.num_groups = unique.numel()
        sizes = torch.bincount(self.index, minlength=self.num_groups)  # [G]
        self.count = sizes[self.index]  # [N] size of each row's group

    def sum(self, x: Tensor) -> Tensor:
        """Sum of ``x [N]`` over each row's group, ``[N]``."""
        totals = x.new_zeros(self.num_groups).index_add_(0, self.index, x)  # [G]
        return totals[self.index]  # [N]

    def max(self, x: Tensor) -> Tensor:
        """Maximum of ``x [N]`` over each row's group, ``[N]``."""
        init = x.new_full((self.num_groups,), -torch.inf)  # [G]
        return init.scatter_reduce(0, self.index, x, reduce="amax")[self.index]  # [N]

    def mean(self, x: Tensor) -> Tensor:
        """Mean of ``x [N]`` over each row's group, ``[N]``."""
        return self.sum(x) / self.count  # [N]

    def std(self, x: Tensor) -> Tensor:
        """Unbiased (Bessel) standard deviation over each row's group, ``[N]``; 0 for a singleton.

        A singleton has no spread to estimate: the estimator decides what it means (GRPO uses 1).
        """
        centred = x - self.mean(x)  # [N] two-pass: subtract the mean first, as torch.std does
        dof = (self.count - 1).clamp(min=1)  # [N]
        return (self.sum(centred**2) / dof).sqrt()  # [N]

    def leave_one_out_mean(self, x: Tensor) -> Tensor:
        """Mean of ``x`` over the *other* rows of each row's group, ``[N]``; 0 for a singleton."""
        others = self.sum(x) - x  # [N]
        return others / (self.count - 1).clamp(min=1)  # [N]

    def weighted_mean(self, x: Tensor, weight: Tensor) -> Tensor:
        """``Σ w_i x_i / Σ w_i`` over each row's group, ``[N]``; 0 where the weights sum to 0."""
        total_weight = self.sum(weight)  # [N]
        return self.sum(weight * x) / total_weight.clamp(min=torch.finfo(x.dtype).tiny)  # [N]
