"""PromptSchedule: which prompts each rollout trains on and the seed of every sample, from counters alone.

An epoch is one pass over the prompts in an order drawn from ``(seed, epoch)``; rollout ``k`` takes the
``k``-th slice of ``prompts_per_step`` of it. An extra generation round (dynamic sampling) draws its prompts
from ``(seed, rollout, round)``. A sample's seed comes from ``(seed, rollout, prompt position, round)``,
so generation does not depend on how prompts are batched or split over ranks, and a resumed run draws
exactly what an uninterrupted one draws: the schedule's whole state is the number of rollouts produced
(``iteration``, checkpointed by the data module).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlkit.data.prompts import PromptSource
from rlkit.errors import ConfigError

# Salt of the prompt order of extra generation rounds (dynamic sampling), apart from the epoch orders.
_EXTRA_ROUNDS = 0xD5A9


def stream_seed(seed: int, *parts: int) -> int:
    """A 63-bit seed derived from ``seed`` and ``parts`` (e.g. iteration, epoch): one stream per use."""
    value = seed & 0x7FFFFFFFFFFFFFFF
    for part in parts:
        value = (value * 1_000_003 + part + 0x9E3779B9) & 0x7FFFFFFFFFFFFFFF
    return value


class PromptSchedule:
    """The prompt order, the sampling seeds and the resume counter of one run's training stream.

    Args:
        prompts: the training prompts.
        prompts_per_step: prompts (groups) per rollout, ``B``.
        seed: the data side's seed.
    """

    def __init__(self, prompts: PromptSource, prompts_per_step: int, seed: int) -> None:
        self.prompts = prompts
        self.prompts_per_step = prompts_per_step
        self.seed = seed
        self.iteration = 0  # rollouts produced so far (checkpointed)
        self.kept: list[int] | None = None  # the prompts that fit, once filtered (see keep)

    def keep(self, fits: Callable[[int], bool]) -> int:
        """Train only on the prompts for which ``fits(index)`` holds (filtered once, up front, as verl's
        ``filter_overlong_prompts``: every step stays full and every rank's row count equal). Returns how
        many were dropped; fewer kept than a step needs is a config error."""
        kept = [i for i in range(len(self.prompts)) if fits(i)]
        if len(kept) < self.prompts_per_step:
            raise ConfigError(
                f"only {len(kept)} of {len(self.prompts)} prompts fit data.max_prompt_length, fewer than "
                f"data.prompts_per_step={self.prompts_per_step}: raise data.max_prompt_length"
            )
        self.kept = kept
        return len(self.prompts) - len(kept)

    @property
    def available(self) -> int:
        return len(self.prompts) if self.kept is None else len(self.kept)

    @property
    def steps_per_epoch(self) -> int:
        return self.available // self.prompts_per_step

    @property
    def position_in_epoch(self) -> int:
        return self.iteration % self.steps_per_epoch

    def prompt_indices(self, iteration: int, round_: int = 0) -> list[int]:
        """The prompts (indices into the source) of generation round ``round_`` of rollout ``iteration``."""
        if round_ == 0:
            epoch, position = divmod(iteration, self.steps_per_epoch)
            generator = torch.Generator().manual_seed(stream_seed(self.seed, epoch))
            order = torch.randperm(self.available, generator=generator)  # [available]
            start = position * self.prompts_per_step
            chosen = order[start : start + self.prompts_per_step].tolist()
        else:
            generator = torch.Generator().manual_seed(stream_seed(self.seed, _EXTRA_ROUNDS, iteration, round_))
            chosen = torch.randperm(self.available, generator=generator)[: self.prompts_per_step].tolist()  # [B]
        return chosen if self.kept is None else [self.kept[i] for i in chosen]

    def sample_seeds(self, iteration: int, positions: list[int], round_: int = 0) -> list[int]:
        """The seed of each prompt position's samples; round 0 keeps the seeds of a run without dynamic
        sampling."""
        return [stream_seed(self.seed, iteration, p, *([round_] if round_ else [])) for p in positions]

    def state_dict(self) -> dict:
        return {"iteration": self.iteration}

    def load_state_dict(self, state: dict) -> None:
        self.iteration = int(state["iteration"])
