"""The run's seed: one number (``seed_everything``) that every random stream of rlkit derives from."""

from __future__ import annotations

import os


def run_seed(seed: int | None) -> int:
    """``seed`` if given, else the run's ``seed_everything`` (Lightning puts it in ``PL_GLOBAL_SEED``), else 0.

    rlkit never draws from the global RNG (Lightning checkpoints hold no RNG state, so exact resume needs
    explicit generators); components that take a ``seed=None`` default follow ``--seed_everything`` through
    this function, so one flag changes every stream of a run.
    """
    if seed is not None:
        return int(seed)
    return int(os.environ.get("PL_GLOBAL_SEED", 0))
