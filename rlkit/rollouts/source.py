"""RolloutSource: what a data module gives the training spine, the one seam between the two.

The spine's :class:`~rlkit.spine.sync.WeightSync` hands it the policy's checkpoint and tokenizer
(:meth:`RolloutSource.attach`: the source starts its engine), pushes weights after every rollout's updates
and checks the weights version of every batch; :class:`~rlkit.spine.evaluation.HeldOutEvaluation` asks
it for held-out batches; the family reads the step's shape. Nothing else in rlkit reads
``trainer.datamodule``. A data module of one's own (``--data=my.module.MySource``) subclasses this.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
from torch import Tensor

from rlkit.errors import ConfigError


@dataclass(frozen=True)
class EngineRequest:
    """What the spine tells a source before the first rollout.

    Attributes:
        checkpoint_dir: the policy's checkpoint directory (the engine starts from it).
        tokenizer: the policy's tokenizer.
        trust_remote_code: whether the checkpoint's own code may run.
        greedy_baselines: also decode one greedy completion per prompt and score it (``Rollout.baselines``).
    """

    checkpoint_dir: str
    tokenizer: Any
    trust_remote_code: bool = False
    greedy_baselines: bool = False


@dataclass(frozen=True)
class StepShape:
    """How many prompts and completions one rollout holds (over all data-parallel ranks)."""

    prompts_per_step: int
    samples_per_prompt: int

    def groups_per_rank(self, world_size: int) -> int:
        return self.prompts_per_step // world_size

    def rows_per_rank(self, world_size: int) -> int:
        return self.groups_per_rank(world_size) * self.samples_per_prompt


@dataclass
class HeldOutBatch:
    """Greedy completions of held-out prompts, scored (this rank's share of one validation batch).

    Attributes:
        scores: ``[n]`` the weighted total reward of each completion.
        terms: each reward function's ``[n]`` scores (NaN where it does not apply), with several functions.
        lengths: ``[n]`` completion lengths in tokens.
        texts: the completions.
        prompts: the prompts' texts.
        episode: with a multi-turn environment, each episode's ``[n]`` ``turns``, ``tool_calls`` and
            ``tool_errors`` (logged as ``val/episode/*``); empty for single-turn completions.
    """

    scores: Tensor
    terms: dict[str, Tensor] = field(default_factory=dict)
    lengths: Tensor | None = None
    texts: list[str] = field(default_factory=list)
    prompts: list[str] = field(default_factory=list)
    episode: dict[str, Tensor] = field(default_factory=dict)


class RolloutSource(pl.LightningDataModule, ABC):
    """Base of data modules that stream rollouts to a family (see the module docstring).

    ``train_dataloader`` yields :class:`~rlkit.data.batch.Rollout` s, each generated with the weights of
    the latest push (its ``weights_version``), or at most :attr:`max_staleness` pushes older;
    ``val_dataloader`` yields :class:`HeldOutBatch` es.
    """

    #: the most weight pushes a rollout's sampling weights may lag the latest push (0: none)
    max_staleness: int = 0

    @abstractmethod
    def attach(self, request: EngineRequest) -> None:
        """Start generating for the policy ``request`` names (once; later calls update the request)."""

    @abstractmethod
    def push_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Give the engine the policy's weights (Hugging Face names); the weights version then rises by one."""

    @property
    @abstractmethod
    def weights_version(self) -> int:
        """How many weight pushes the engine has received."""

    @abstractmethod
    def step_shape(self) -> StepShape:
        """The prompts and completions per rollout."""

    @abstractmethod
    def held_out_batches(self) -> Iterable[HeldOutBatch]:
        """This rank's held-out batches, scored (none: no held-out prompts)."""

    def hparams_for_logging(self) -> dict[str, object]:
        """The data-side settings that tell two runs apart (TensorBoard's HPARAMS tab)."""
        return {}

    def constant_metrics(self) -> frozenset[str]:
        """Names of the data side's per-rollout counters that cannot move under its settings (not logged)."""
        return frozenset()


def rollout_source(trainer: pl.Trainer) -> RolloutSource:
    """The trainer's data module, which must be a :class:`~rlkit.rollouts.source.RolloutSource`."""
    data = trainer.datamodule
    if not isinstance(data, RolloutSource):
        raise ConfigError(
            f"the data module {type(data).__name__} is not a rlkit.rollouts.RolloutSource: an rlkit family trains "
            "on rollouts; use rlkit.rollouts.RolloutDataModule (the default) or subclass RolloutSource"
        )
    return data
