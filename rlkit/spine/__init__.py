"""The training spine: the machinery every algorithm family shares, behind one typed face.

:class:`Family` (a LightningModule) holds a :class:`Spine`: the policy (:class:`Policy`) and its frozen
models, the update loop (:class:`UpdateLoop`), the metrics sink and writer, the components' declared
needs, and the seam to the data side (:class:`WeightSync`, :class:`HeldOutEvaluation`). The settings every
family shares are :class:`PolicySettings`, :class:`LoopSettings` and :class:`Optimization`.
"""

from rlkit.rollouts.source import rollout_source
from rlkit.spine.evaluation import HeldOutEvaluation
from rlkit.spine.family import SPINE_PROVIDES, Family, OldLogProbs, Spine, Step
from rlkit.spine.loop import LossInputs, MicroBatch, UpdateLoop
from rlkit.spine.metrics import StepMetrics
from rlkit.spine.policy import Policy, TokenScores
from rlkit.spine.settings import LoopSettings, Optimization, PolicySettings
from rlkit.spine.sync import WeightSync

__all__ = [
    "SPINE_PROVIDES",
    "Family",
    "HeldOutEvaluation",
    "LoopSettings",
    "LossInputs",
    "MicroBatch",
    "OldLogProbs",
    "Optimization",
    "Policy",
    "PolicySettings",
    "Spine",
    "Step",
    "StepMetrics",
    "TokenScores",
    "UpdateLoop",
    "WeightSync",
    "rollout_source",
]
