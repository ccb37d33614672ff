"""The rollout pipeline: a prompt schedule, a group producer, a pure collate, and a thin Lightning shell.

``PromptSchedule`` (which prompts, which seeds, the resume counter) -> ``GroupProducer`` (engine, rewards,
dynamic-sampling filter; timings and counters returned as values) -> ``collate`` (scored groups -> the
typed ``Rollout``) -> ``RolloutDataModule`` (a :class:`RolloutSource`: the one seam the training spine
talks to).
"""

from rlkit.rollouts.buffer import DropConstantGroups, GenerationRoundsExceeded, Group, GroupFilter, ReplayBuffer
from rlkit.rollouts.collate import collate
from rlkit.rollouts.datamodule import RolloutDataModule
from rlkit.rollouts.producer import GroupProducer, ProducedStep
from rlkit.rollouts.schedule import PromptSchedule
from rlkit.rollouts.source import EngineRequest, HeldOutBatch, RolloutSource, StepShape

__all__ = [
    "DropConstantGroups",
    "EngineRequest",
    "GenerationRoundsExceeded",
    "Group",
    "GroupFilter",
    "GroupProducer",
    "HeldOutBatch",
    "ProducedStep",
    "PromptSchedule",
    "ReplayBuffer",
    "RolloutDataModule",
    "RolloutSource",
    "StepShape",
    "collate",
]
