"""Scoring a batch of completions with several reward functions, safely."""

from __future__ import annotations

import math
import numbers
import threading
import time
from typing import Any

import torch
from torch import Tensor

from rlkit.data.prompts import Prompt
from rlkit.errors import RLKitError
from rlkit.rewards.base import LengthAwareReward, RewardFunction


class RewardError(RLKitError, RuntimeError):
    """A reward function raised, returned something that is not a finite number, or hung."""


class RewardScorer:
    """Scores completions with reward functions: ``total = sum_k weights[k] * reward_k``.

    All calls run in order on one worker thread per batch, watched by the caller: a call that takes
    longer than ``timeout_s`` stops scoring with a ``RewardError``. Python cannot kill a thread, so
    the hung call is abandoned on a daemon thread (it does not keep the process alive at exit) and
    the run stops with the error rather than waiting forever. A call that holds the GIL throughout
    (one long C operation: a catastrophically backtracking regex, a huge integer power) delays the
    check until it returns. A function that raises, or returns anything but a finite number (a
    one-element tensor is accepted), stops scoring with a ``RewardError`` too.

    Args:
        functions: the reward functions; their ``name``s label the ``reward/<name>`` curves and must
            be distinct.
        weights: one weight per function; None weighs each by 1.
        timeout_s: the longest one reward-function call may take, in seconds.
    """

    def __init__(
        self,
        functions: list[RewardFunction],
        weights: list[float] | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        if not functions:
            raise ValueError("RewardScorer: give at least one reward function.")
        for fn in functions:
            if not isinstance(fn, RewardFunction):
                raise ValueError(
                    f"RewardScorer: {fn!r} is not a RewardFunction; subclass "
                    f"rlkit.rewards.RewardFunction and implement __call__(completion, prompt) -> float."
                )
        names = [fn.name for fn in functions]
        for name in names:
            if not isinstance(name, str) or not name:
                raise ValueError(f"RewardScorer: reward names must be non-empty strings, got {name!r}.")
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(
                f"RewardScorer: reward names must be distinct (they label the reward/<name> curves), "
                f"but {duplicates} occur more than once in {names}. Give each function its own `name`."
            )
        if weights is None:
            weights = [1.0] * len(functions)
        if len(weights) != len(functions):
            raise ValueError(
                f"RewardScorer: {len(weights)} weights for {len(functions)} functions {names}; give one "
                f"weight per function, or none."
            )
        if not all(math.isfinite(w) for w in weights):
            raise ValueError(f"RewardScorer: weights must be finite numbers, got {weights}.")
        if not timeout_s > 0:
            raise ValueError(f"RewardScorer: timeout_s must be positive, got {timeout_s}.")
        self.functions = list(functions)
        self.names = names
        self.weights = torch.tensor(weights, dtype=torch.float32)  # [K]
        self.timeout_s = float(timeout_s)

    def score(
        self, completions: list[str], prompts: list[Prompt], lengths: list[int]
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Weighted total ``[N]`` and each function's scores ``[N]`` (float32), keyed by name.

        Args:
            completions: ``N`` decoded completions.
            prompts: the prompt of each completion (``N``, repeated ``G`` times per prompt).
            lengths: each completion's length in tokens (``N``), for ``LengthAwareReward``s.
        """
        n = len(completions)
        if len(prompts) != n or len(lengths) != n:
            raise ValueError(
                f"RewardScorer.score: {n} completions, {len(prompts)} prompts and {len(lengths)} "
                f"lengths; give one prompt and one length per completion."
            )
        pass_ = _ScoringPass(self.functions, completions, prompts, lengths)
        worker = threading.Thread(target=pass_.run, name="rlkit-reward-scoring", daemon=True)
        worker.start()
        while True:
            worker.join(timeout=min(0.05, self.timeout_s))
            if not worker.is_alive():
                break
            k, i, started = pass_.current
            if time.monotonic() - started > self.timeout_s:
                pass_.cancelled = True
                raise RewardError(
                    f"reward function {self.names[k]!r} took longer than timeout_s={self.timeout_s} s on "
                    f"{_row(i, prompts, completions)} and was abandoned (a Python thread "
                    f"cannot be stopped). Make the function faster, raise timeout_s, or give it its "
                    f"own time limit."
                )
        if pass_.error is not None:
            k, i, exc = pass_.error
            raise RewardError(
                f"reward function {self.names[k]!r} ({type(self.functions[k]).__name__}) raised "
                f"{type(exc).__name__}: {exc} on {_row(i, prompts, completions)}. Fix the function, or "
                f"wrap it to return a score for such input."
            ) from exc
        values = [[0.0] * n for _ in self.functions]
        for k, row in enumerate(pass_.values):
            for i, value in enumerate(row):
                try:
                    values[k][i] = _as_reward(value)
                except ValueError as e:
                    raise RewardError(
                        f"reward function {self.names[k]!r} returned {e} on {_row(i, prompts, completions)}. "
                        f"Return a finite float (e.g. 1.0 or 0.0)."
                    ) from None
        scores = torch.tensor(values, dtype=torch.float32).reshape(len(self.functions), n)  # [K, N]
        total = (self.weights[:, None] * scores).sum(dim=0)  # [N]
        return total, dict(zip(self.names, scores.unbind(0), strict=True))


class _ScoringPass:
    """One batch's calls, run on the worker thread; records which call is running and since when."""

    def __init__(
        self,
        functions: list[RewardFunction],
        completions: list[str],
        prompts: list[Prompt],
        lengths: list[int],
    ) -> None:
        self.functions, self.completions, self.prompts = functions, completions, prompts
        self.lengths = lengths
        self.values: list[list[Any]] = [[None] * len(completions) for _ in functions]
        self.current = (0, 0, time.monotonic())
        self.error: tuple[int, int, BaseException] | None = None
        self.cancelled = False

    def run(self) -> None:
        for k, fn in enumerate(self.functions):
            for i, (completion, prompt) in enumerate(zip(self.completions, self.prompts, strict=True)):
                if self.cancelled:
                    return
                self.current = (k, i, time.monotonic())
                try:
                    if isinstance(fn, LengthAwareReward):
                        self.values[k][i] = fn(completion, prompt, length=int(self.lengths[i]))
                    else:
                        self.values[k][i] = fn(completion, prompt)
                except Exception as e:  # reported, with the function and row, on the caller's thread
                    self.error = (k, i, e)
                    return


def _as_reward(value: Any) -> float:
    """``value`` as a float; a ValueError that says what it is when it is not a finite number."""
    if isinstance(value, Tensor) and value.numel() == 1:
        value = value.item()
    if not isinstance(value, numbers.Real):
        raise ValueError(f"{type(value).__name__} {_shorten(repr(value))}, which is not a number,")
    if not math.isfinite(value):
        raise ValueError(f"{value}, which is not a finite number,")
    return float(value)


def _row(i: int, prompts: list[Prompt], completions: list[str]) -> str:
    """Where in the batch: the row index, its prompt and its completion, shortened."""
    prompt = prompts[i].prompt
    text = prompt if isinstance(prompt, str) else prompt[-1]["content"]
    return f"row {i} of the batch (prompt {_shorten(text)!r}, completion {_shorten(completions[i])!r})"


def _shorten(text: str, width: int = 60) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."
