"""What a component needs and provides, declared once as typed attributes and checked at construction.

A component reads the rollout and the current policy's forward; anything else it reads is a
:class:`Need`: a critic's values (GAE), a greedy completion's reward (ReMax), each reward function's score
(GDPO), the policy's log-probs or ``sum pi^2`` before the updates (the optimal token baseline, a
covariance selection, a decoupled rollout correction, the KL penalty in the reward), a frozen reference's
log-probs (a KL term), a ratio around 1 (a clip that bounds it). A family states what it provides, some
components provide for others (a ratio provides :attr:`Need.RATIO`, a decoupled rollout correction its
weights), and :func:`unmet_needs` lists what nothing provides, so a mismatch is a one-line config error at
construction rather than a failure at the first step.
"""

from __future__ import annotations

from abc import ABC
from collections.abc import Mapping
from enum import Enum


class Need(Enum):
    """An input a component reads besides the rollout and the current policy's forward (the value says it)."""

    VALUES = "a critic's values of each token's state"
    GREEDY_BASELINES = "the reward of one greedy completion per prompt"
    REWARD_TERMS = "each reward function's own score"
    OLD_LOGPROBS = "the policy's log-probs of the rollout before its updates (a scoring pass)"
    SUM_PI_SQUARED = "the policy's sum_v pi(v)^2 before its updates (a scoring pass)"
    IS_WEIGHTS = "rollout-correction weights computed before the updates"
    REFERENCE = "a frozen reference policy's log-probs"
    TEACHER = "a frozen teacher's log-probs (and its top-k) of the sampled tokens"
    RATIO = "an importance ratio around 1 (TokenRatio, SequenceRatio; LogProb passes log pi)"


#: Needs that mean "score the rollout with the policy before its updates".
BEFORE_UPDATES = frozenset({Need.OLD_LOGPROBS, Need.SUM_PI_SQUARED})


class Component(ABC):  # noqa: B024 - a nominal base: the axes' bases add the abstract methods
    """Base of every interchangeable component (advantage, ratio, clip, aggregation, KL, ...).

    Attributes:
        needs: the inputs it reads beyond the rollout and the current forward (an instance may set its own
            where a setting decides, e.g. ``OptimalTokenBaseline(use_is_weights=True)``).
        provides: what it gives the components beside it (a ratio: :attr:`Need.RATIO`).
    """

    needs: frozenset[Need] = frozenset()
    provides: frozenset[Need] = frozenset()


def unmet_needs(components: Mapping[str, object], available: frozenset[Need]) -> list[tuple[str, object, Need]]:
    """``(name, component, need)`` for every need of ``components`` (by config name; None entries and
    non-components ignored) that neither ``available`` nor another component provides."""
    present = {name: c for name, c in components.items() if isinstance(c, Component)}
    provided = set(available)
    for component in present.values():
        provided |= component.provides
    return [
        (name, component, need)
        for name, component in present.items()
        for need in sorted(component.needs, key=lambda n: n.name)
        if need not in provided
    ]


def all_needs(components: Mapping[str, object]) -> frozenset[Need]:
    """The union of what ``components`` need."""
    needs: set[Need] = set()
    for component in components.values():
        if isinstance(component, Component):
            needs |= component.needs
    return frozenset(needs)
