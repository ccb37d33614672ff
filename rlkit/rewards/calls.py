"""One reward call and how it can end: a score, a ``Rejected`` 0, or a ``Failure``.

Shared by the scorer (in the training process) and its worker processes (``rlkit.rewards.pool``), which
import only this: kept free of torch, so a worker starts in a fraction of a second.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

from rlkit.data.prompts import Prompt
from rlkit.errors import RLKitError
from rlkit.rewards.base import BatchedReward, LengthAwareReward, RewardFunction


class RewardError(RLKitError, RuntimeError):
    """A reward function raised, returned something that is not a finite number, or hung."""


@dataclass(frozen=True)
class Failure:
    """One call that did not return a score: ``kind`` is ``"raised"``, ``"value"`` (not a number),
    ``"timeout"`` or ``"died"`` (its worker process ended)."""

    kind: str
    detail: str


class CallTimeout(BaseException):
    """Raised inside a reward call when its time is up.

    A ``BaseException``, so a reward function's own ``except Exception:`` does not swallow it.
    """


class Rejected(float):
    """A score of 0 given without reading the completion: it is beyond what the function will parse
    (too long, nested too deep, a number too large to compute; see ``rlkit.rewards.bounds``). A reward
    function returns ``Rejected(reason)``; ``RewardScorer`` counts these (``reward/rejected``)."""

    def __new__(cls, reason: str) -> Rejected:
        score = super().__new__(cls, 0.0)
        score.reason = reason
        return score

    def __reduce__(self):  # pickles with its reason (from reward worker processes)
        return (Rejected, (self.reason,))


def call_reward(fn: RewardFunction, completion: str, prompt: Prompt, length: int) -> float | Failure:
    """One reward call: its score (NaN for None, "does not apply"; a ``Rejected`` as it is), or the
    ``Failure`` it ended in."""
    try:
        if isinstance(fn, LengthAwareReward):
            value = fn(completion, prompt, length=int(length))
        else:
            value = fn(completion, prompt)
    except Exception as e:
        return Failure("raised", f"{type(e).__name__}: {e}")
    if isinstance(value, Rejected):
        return value
    try:
        return as_reward(value)
    except ValueError as e:
        return Failure("value", str(e))


def call_batch(
    fn: BatchedReward, completions: list[str], prompts: list[Prompt]
) -> list[float | Rejected | Failure] | Failure:
    """One batched call: each completion's score or ``Failure`` (a value that is not a number fails its row
    alone), or one ``Failure`` for the whole batch when the call raised or did not return one score per
    completion (``kind="batch"``, saying what it returned)."""
    try:
        values = fn.score_batch(completions, prompts)
    except Exception as e:
        return Failure("raised", f"{type(e).__name__}: {e}")
    if isinstance(values, str | bytes | dict) or not hasattr(values, "__len__") or len(values) != len(completions):
        got = f"{len(values)} values" if hasattr(values, "__len__") else "no list"
        return Failure(
            "batch",
            f"returned {type(values).__name__} {_shorten(repr(values))} ({got}) for {len(completions)} completions",
        )
    results: list[float | Rejected | Failure] = []
    for value in values:
        if isinstance(value, Rejected):
            results.append(value)
            continue
        try:
            results.append(as_reward(value))
        except ValueError as e:
            results.append(Failure("value", str(e)))
    return results


def call_item(fn: RewardFunction, rows, completions, prompts, lengths):
    """One scheduled call: ``rows`` an int (one completion: :func:`call_reward`) or a tuple of row indices
    (a batch: :func:`call_batch`, with ``completions`` and ``prompts`` lists of those rows)."""
    if isinstance(rows, tuple):
        return call_batch(fn, completions, prompts)
    return call_reward(fn, completions, prompts, lengths)


def as_reward(value: Any) -> float:
    """``value`` as a float (None as NaN); a ValueError saying what it is when it is not a finite number."""
    if value is None:
        return math.nan
    if hasattr(value, "numel") and hasattr(value, "item") and value.numel() == 1:  # a one-element tensor
        value = value.item()
    if not isinstance(value, numbers.Real):
        raise ValueError(f"returned {type(value).__name__} {_shorten(repr(value))}, which is not a number")
    if not math.isfinite(value):
        raise ValueError(f"returned {value}, which is not a finite number")
    return float(value)


def _shorten(text: str, width: int = 60) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."
