"""How often each reward function applies, rollout by rollout: a function that silently stops applying
(returns None, TRL's "does not apply", for every completion) is said once and, if it goes on, stops the run.

A TRL-style function that reads a column the data does not have, or a regex that never matches, returns
None everywhere; its term then adds 0 to every total, and a run with it alone trains on reward 0. Kept
free of torch: it takes each function's scores as any sequence of floats (NaN where it did not apply).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence

from rlkit.rewards.calls import RewardError

log = logging.getLogger(__name__)


class RewardCoverage:
    """Counts, per reward function, the share of a rollout's completions it scored (did not return None).

    :meth:`update` returns ``reward/<name>/applied_fraction`` for each function, to log. A function whose
    share falls below ``warn_below`` in a rollout is warned about once (naming it); one that applies to
    no completion of ``stop_after`` rollouts in a row stops the run with a ``RewardError`` naming it.

    Args:
        names: the reward functions' names (``RewardScorer.names``).
        warn_below: warn (once per function) when a rollout's applied fraction is below this; 0 never warns.
        stop_after: rollouts in a row on which a function applies to nothing before the run stops; 0 never
            stops.
        kinds: each function's class name, for messages (optional, by name).
    """

    def __init__(
        self,
        names: Sequence[str],
        warn_below: float = 0.1,
        stop_after: int = 20,
        kinds: Mapping[str, str] | None = None,
    ) -> None:
        if not 0.0 <= warn_below <= 1.0:
            raise ValueError(f"RewardCoverage: warn_below must be in [0, 1], got {warn_below}.")
        if stop_after < 0:
            raise ValueError(
                f"RewardCoverage: stop_after must be >= 0 (0: never stop), got {stop_after} "
                "(data.reward_none_patience)."
            )
        self.names = list(names)
        self.warn_below = warn_below
        self.stop_after = stop_after
        self.kinds = dict(kinds or {})
        self.idle = dict.fromkeys(self.names, 0)  # rollouts in a row on which each applied to nothing
        self._warned: set[str] = set()

    def update(self, terms: Mapping[str, Sequence[float]]) -> dict[str, float]:
        """One rollout's scores of each function (NaN: did not apply): ``{"reward/<name>/applied_fraction": f}``.

        Raises ``RewardError`` once a function has applied to nothing for ``stop_after`` rollouts in a row.
        """
        stats = {}
        for name in self.names:
            values = [float(v) for v in terms[name]]
            applied = sum(not math.isnan(v) for v in values) / len(values) if values else 1.0
            stats[f"reward/{name}/applied_fraction"] = applied
            self.idle[name] = self.idle[name] + 1 if applied == 0.0 else 0
            if self.stop_after and self.idle[name] >= self.stop_after:
                raise RewardError(
                    f"reward function {self._label(name)} returned None (does not apply) for every completion of "
                    f"the last {self.idle[name]} rollouts: it scores nothing, and the run trains as if it were "
                    "not there (on reward 0 if it is the only one). Check what it reads (the columns a TRL "
                    "function takes by name, e.g. `solution`; its pattern), or raise data.reward_none_patience "
                    "(0: never stop)"
                )
            if applied < self.warn_below and name not in self._warned:
                self._warned.add(name)
                log.warning(
                    "reward function %s applied to %.0f%% of this rollout's completions (returned None for the "
                    "rest): its term adds 0 to their rewards. Logged as reward/%s/applied_fraction; the run stops "
                    "if it applies to none for %d rollouts in a row (data.reward_none_patience). Shown once.",
                    self._label(name),
                    100 * applied,
                    name,
                    self.stop_after,
                )
        return stats

    def _label(self, name: str) -> str:
        return f"{name!r} ({self.kinds[name]})" if name in self.kinds else repr(name)
