"""The replay buffer between generation and training: it holds scored groups."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from rlkit.data.prompts import Prompt
from rlkit.engines.base import Generation


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


class ReplayBuffer:
    """FIFO of scored groups.

    On-policy presets put one step's groups and take them all in the same step, so the buffer is
    empty between steps and nothing stale is ever trained on (checkpoints need not hold it).

    Args:
        capacity: the most groups held; putting more is an error rather than a silent drop.
    """

    def __init__(self, capacity: int = 4096) -> None:
        if capacity < 1:
            raise ValueError(f"buffer capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._groups: deque[Group] = deque()

    def __len__(self) -> int:
        return len(self._groups)

    def put(self, groups: list[Group]) -> None:
        if len(self._groups) + len(groups) > self.capacity:
            raise RuntimeError(
                f"replay buffer overflow: {len(self._groups)} + {len(groups)} groups > capacity {self.capacity}"
            )
        self._groups.extend(groups)

    def take(self, n: int) -> list[Group]:
        """Remove and return the ``n`` oldest groups (fewer if fewer are held)."""
        return [self._groups.popleft() for _ in range(min(n, len(self._groups)))]
