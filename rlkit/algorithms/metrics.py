"""StepMetrics: a step's metrics, weighted and reduced over data-parallel ranks (torchmetrics)."""

from __future__ import annotations

import warnings
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor
from torchmetrics import MaxMetric, MeanMetric, MinMetric

Reduce = Literal["mean", "max", "min"]
_KINDS = {"mean": MeanMetric, "max": MaxMetric, "min": MinMetric}


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class StepMetrics:
    """Named metrics accumulated over a step and reduced over ranks when read.

    ``update(name, value, weight)`` adds a weighted value (``mean``) or an extreme (``max``/``min``);
    ``compute(prefix)`` returns and resets the selected metrics. Under data parallelism ``compute`` is
    collective: the ranks first agree on the set of names (a metric updated on one rank only, e.g. a
    clip fraction of an empty micro-batch, is still reduced on all), then reduce each in the same order.

    Metric states are plain tensors created outside inference mode, so validation (inference mode) and
    training (autograd) can share the sink.

    Args:
        device: where the states live (the module's device; the collective backend needs it there).
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._metrics: dict[str, MeanMetric | MaxMetric | MinMetric] = {}
        self._kinds: dict[str, Reduce] = {}

    def to(self, device: torch.device | str) -> StepMetrics:
        self.device = torch.device(device)
        with torch.inference_mode(False):
            for metric in self._metrics.values():
                metric.to(self.device)
        return self

    def _metric(self, name: str, reduce: Reduce):
        metric = self._metrics.get(name)
        if metric is None:
            metric = self._metrics[name] = _KINDS[reduce]().to(self.device)
            self._kinds[name] = reduce
        return metric

    def update(self, name: str, value, weight=1.0, reduce: Reduce = "mean") -> None:
        with torch.inference_mode(False):
            metric = self._metric(name, reduce)
            value = torch.as_tensor(value, dtype=torch.float32, device=self.device).detach()
            if reduce == "mean":
                metric.update(value, torch.as_tensor(weight, dtype=torch.float32, device=self.device))
            else:
                metric.update(value)

    def compute(self, prefix: str | None = None, exclude: str | None = None) -> dict[str, Tensor]:
        """Reduce (over ranks) and reset the metrics whose names start with ``prefix`` (None: all) and
        not with ``exclude``."""

        def selected(name: str) -> bool:
            return (prefix is None or name.startswith(prefix)) and not (exclude and name.startswith(exclude))

        kinds = {name: kind for name, kind in self._kinds.items() if selected(name)}
        distributed = _distributed()
        if distributed:
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, kinds)
            kinds = {name: kind for rank_kinds in gathered for name, kind in rank_kinds.items()}
        values = {}
        with torch.inference_mode(False), warnings.catch_warnings():
            # under DDP a metric another rank updated is computed here too (its state: the empty default)
            warnings.filterwarnings("ignore", message=".*was called before the ``update`` method.*")
            for name in sorted(kinds):
                metric = self._metric(name, kinds[name])
                if distributed or metric.update_called:
                    values[name] = metric.compute()
                metric.reset()
        return values
