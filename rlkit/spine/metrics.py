"""StepMetrics: a step's metrics, weighted and reduced over data-parallel ranks."""

from __future__ import annotations

import math
import warnings
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor

Reduce = Literal["mean", "max", "min"]
_START = {"mean": 0.0, "max": -math.inf, "min": math.inf}


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class StepMetrics:
    """Named metrics accumulated over a step and reduced over ranks when read.

    ``update(name, value, weight)`` adds a weighted value (``mean``) or an extreme (``max``/``min``);
    ``compute(prefix)`` returns and resets the selected metrics. Under data parallelism ``compute`` is
    collective: the ranks first agree on the set of names (a metric updated on one rank only, e.g. a
    clip fraction of an empty micro-batch, is still reduced on all), then reduce all weighted sums and
    weights in one ``all_reduce``, all maxima in one and all minima in one. A non-finite value is left
    out of its metric with a warning (as torchmetrics' default ``nan_strategy``); a mean nothing was
    added to reads NaN.

    The sink is a few tensors per metric, not torchmetrics objects: ~25 metrics a step through
    torchmetrics cost more than the small model's whole update (``benchmarks/throughput.py --workload
    small``). States are created outside inference mode, so validation (inference mode) and training
    (autograd) can share the sink.

    Args:
        device: where the states live (the module's device; the collective backend needs it there).
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._kinds: dict[str, Reduce] = {}
        self._values: dict[str, Tensor] = {}  # weighted sum (mean) or extreme (max/min)
        self._weights: dict[str, Tensor] = {}  # total weight (mean)

    def to(self, device: torch.device | str) -> StepMetrics:
        self.device = torch.device(device)
        with torch.inference_mode(False):
            self._values = {name: v.to(self.device) for name, v in self._values.items()}
            self._weights = {name: w.to(self.device) for name, w in self._weights.items()}
        return self

    def update(self, name: str, value, weight=1.0, reduce: Reduce = "mean") -> None:
        known = self._kinds.setdefault(name, reduce)
        if known != reduce:
            raise ValueError(f"metric {name!r} is reduced by {known}, not {reduce}")
        with torch.inference_mode(False):
            value = torch.as_tensor(value, dtype=torch.float32, device=self.device).detach()
            if not bool(torch.isfinite(value)):
                warnings.warn(f"metric {name!r}: left out a non-finite value ({value.item()})", stacklevel=2)
                return
            if reduce == "mean":
                weight = torch.as_tensor(weight, dtype=torch.float32, device=self.device).detach()
                total = self._values.get(name)
                self._values[name] = value * weight if total is None else total + value * weight
                self._weights[name] = weight if name not in self._weights else self._weights[name] + weight
            else:
                extreme = self._values.get(name)
                pick = torch.maximum if reduce == "max" else torch.minimum
                self._values[name] = value if extreme is None else pick(extreme, value)

    def compute(self, prefix: str | None = None, exclude: str | None = None) -> dict[str, Tensor]:
        """Reduce (over ranks) and reset the metrics whose names start with ``prefix`` (None: all) and
        not with ``exclude``; each value is a 0-d float32 tensor."""

        def selected(name: str) -> bool:
            return (prefix is None or name.startswith(prefix)) and not (exclude and name.startswith(exclude))

        kinds = {name: kind for name, kind in self._kinds.items() if selected(name)}
        distributed = _distributed()
        if distributed:
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, kinds)
            kinds = {name: kind for rank_kinds in gathered for name, kind in rank_kinds.items()}
        values: dict[str, Tensor] = {}
        with torch.inference_mode(False):
            for kind in ("mean", "max", "min"):
                names = sorted(name for name, k in kinds.items() if k == kind)
                if not names:
                    continue
                start = torch.tensor(
                    _START[kind], dtype=torch.float32, device=self.device
                )  # not the default dtype: 64-true makes it float64
                stacked = torch.stack([self._values.get(name, start) for name in names])  # [K]
                if kind == "mean":
                    weights = torch.stack([self._weights.get(name, start) for name in names])  # [K]
                    stacked = torch.stack([stacked, weights])  # [2, K]
                if distributed:
                    op = {"mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[kind]
                    dist.all_reduce(stacked, op=op)
                if kind == "mean":
                    stacked = stacked[0] / stacked[1]  # [K]; 0 / 0 = NaN when nothing was added
                values.update(zip(names, stacked.unbind(), strict=True))
        for name in kinds:
            self._kinds.pop(name, None)
            self._values.pop(name, None)
            self._weights.pop(name, None)
        return values
