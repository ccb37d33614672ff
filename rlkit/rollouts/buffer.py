"""The replay buffer between generation and training: it holds scored groups, and may filter them."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass

from rlkit.data.prompts import Prompt
from rlkit.engines.base import Generation
from rlkit.errors import RLKitError


@dataclass
class Group:
    """The ``G`` scored completions of one prompt.

    Attributes:
        prompt: the prompt.
        prompt_ids: its tokens.
        generations: the ``G`` completions.
        scores: weighted total reward of each completion.
        terms: each reward function's scores, by name.
        texts: decoded completions.
        baseline: reward of the greedy completion (ReMax), if generated.
        iteration: the rollout iteration that generated the group.
        weights_version: the engine's weight version when it generated the group.
    """

    prompt: Prompt
    prompt_ids: list[int]
    generations: list[Generation]
    scores: list[float]
    terms: dict[str, list[float]]
    texts: list[str]
    baseline: float | None = None
    iteration: int = 0
    weights_version: int = 0

    def values(self, metric: str) -> list[float]:
        """Each completion's ``metric``: ``"score"`` (the weighted total), ``"length"`` (tokens) or a
        reward function's name."""
        if metric == "score":
            return list(self.scores)
        if metric == "length":
            return [float(len(g.token_ids)) for g in self.generations]
        if metric in self.terms:
            return list(self.terms[metric])
        raise KeyError(f"no metric {metric!r}: use 'score', 'length' or one of the reward names {sorted(self.terms)}")


class GroupFilter(ABC):
    """Decides which scored groups the replay buffer keeps for training (dynamic sampling).

    ``metric`` names the per-completion value the filter reads (see ``Group.values``); the data module
    checks at construction that it exists.
    """

    metric: str

    @abstractmethod
    def __call__(self, group: Group) -> bool:
        """True to keep ``group``."""


class DropConstantGroups(GroupFilter):
    """DAPO's dynamic sampling (Yu et al. 2025, eq. 11: ``0 < |{o_i : o_i correct}| < G``): drop a group
    whose completions all have the same ``metric``.

    Under group-relative advantages ``A_i = r_i - mean(r)`` such a group contributes zero advantage,
    hence zero gradient, while still counting in the loss's normaliser; dropping it and generating more
    keeps every step's batch full of groups that teach something. DAPO (and verl's
    ``algorithm.filter_groups.metric=acc``) filter on accuracy rather than the total reward, so that a
    length penalty alone does not keep a group.

    Args:
        metric: the per-completion value compared: ``"score"`` (the weighted total reward),
            ``"length"`` (tokens), or a reward function's name (e.g. ``"accuracy"``).
        tolerance: values within this distance of each other count as equal.
    """

    def __init__(self, metric: str = "score", tolerance: float = 0.0) -> None:
        if not metric:
            raise ValueError("DropConstantGroups: metric must name a value: 'score', 'length' or a reward's name.")
        if not tolerance >= 0:
            raise ValueError(f"DropConstantGroups: tolerance must be >= 0, got {tolerance}.")
        self.metric = metric
        self.tolerance = tolerance

    def __call__(self, group: Group) -> bool:
        values = [v for v in group.values(self.metric) if not math.isnan(v)]  # NaN: "does not apply"
        return len(values) > 1 and max(values) - min(values) > self.tolerance


class GenerationRoundsExceeded(RLKitError, RuntimeError):
    """Dynamic sampling ran out of generation rounds before a step's batch was full."""


class ReplayBuffer:
    """FIFO of scored groups, optionally filtered on the way in.

    On-policy presets put one step's groups and take them all in the same step, so the buffer is
    empty between steps and nothing stale is ever trained on (checkpoints need not hold it).

    Args:
        capacity: the most groups held; putting more is an error rather than a silent drop.
        group_filter: keeps only the groups it accepts (None keeps all).
    """

    def __init__(self, capacity: int = 4096, group_filter: GroupFilter | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"buffer capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.group_filter = group_filter
        self._groups: deque[Group] = deque()

    def __len__(self) -> int:
        return len(self._groups)

    def put(self, groups: list[Group]) -> int:
        """Add the groups the filter keeps; returns how many that is."""
        kept = groups if self.group_filter is None else [g for g in groups if self.group_filter(g)]
        if len(self._groups) + len(kept) > self.capacity:
            raise RuntimeError(
                f"replay buffer overflow: {len(self._groups)} + {len(kept)} groups > capacity {self.capacity}"
            )
        self._groups.extend(kept)
        return len(kept)

    def take(self, n: int) -> list[Group]:
        """Remove and return the ``n`` oldest groups (fewer if fewer are held)."""
        return [self._groups.popleft() for _ in range(min(n, len(self._groups)))]

    def clear(self) -> None:
        self._groups.clear()
