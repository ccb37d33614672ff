"""Reward functions the reward tests send to worker processes or name by import path.

Kept free of torch and pytest, so that a worker process importing it starts quickly.
"""

import os
import time

from rlkit.data.prompts import Prompt
from rlkit.rewards import RewardFunction


def q(ground_truth=None):
    """A prompt with a ground truth."""
    return Prompt(prompt="what is it?", ground_truth=ground_truth)


class Scripted(RewardFunction):
    """Does what the completion says: ``hang`` spins in Python, ``sleep`` sleeps, ``swallow`` spins
    inside ``except Exception``, ``raise`` raises, ``exit`` ends its process, ``none`` does not apply,
    ``text`` returns a string, ``pid`` returns its process id; anything else scores 1."""

    def __init__(self, name: str = "scripted") -> None:
        self.name = name

    def __call__(self, completion, prompt):
        if completion == "hang":
            while True:
                pass
        if completion == "sleep":
            time.sleep(60)
        if completion == "swallow":
            try:
                while True:
                    pass
            except Exception:  # the time limit is not an Exception: this does not catch it
                return 1.0
        if completion == "raise":
            raise KeyError("boom")
        if completion == "exit":
            os._exit(3)
        if completion == "none":
            return None
        if completion == "text":
            return "yes"
        if completion == "pid":
            return float(os.getpid())
        return 1.0


# --- TRL's shape: fn(prompts, completions, **columns) -> list[float | None] ------------------------


def _text(completion):
    return completion if isinstance(completion, str) else completion[0]["content"]


def trl_accuracy(completions, solution, **kwargs):
    """TRL's usual accuracy reward: the dataset's `solution` column arrives by name."""
    return [float(_text(c).strip() == s) for c, s in zip(completions, solution, strict=True)]


def trl_echo(prompts, completions, **kwargs):
    """Scores 1 and records exactly what it was called with."""
    trl_echo.calls.append({"prompts": prompts, "completions": completions, **kwargs})
    return [1.0 for _ in completions]


trl_echo.calls = []


def trl_python_only(completions, language, **kwargs):
    """Applies to Python rows only: None elsewhere (TRL's "not applicable")."""
    pairs = zip(completions, language, strict=True)
    return [float(len(_text(c)) > 3) if lang == "python" else None for c, lang in pairs]


def trl_no_kwargs(completions, solution):
    """Takes no **kwargs: gets only the columns it names."""
    return [float(_text(c) == s) for c, s in zip(completions, solution, strict=True)]


def trl_scalar(completions, **kwargs):
    return 1.0  # wrong: TRL functions return one score per completion


def not_a_reward(x, y):
    return x + y


NOT_CALLABLE = 3


# --- verl's shape: compute_score(data_source, solution_str, ground_truth, extra_info) ----------------


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's default layout: a float."""
    bonus = 0.5 if (extra_info or {}).get("split") == "train" else 0.0
    return float(solution_str.strip() == ground_truth) + bonus if data_source == "openai/gsm8k" else 0.0


def compute_score_dict(data_source, solution_str, ground_truth, extra_info=None):
    """verl's other layout: a dict whose 'score' is the reward."""
    correct = solution_str.strip() == ground_truth
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": solution_str}


def compute_score_without_extra_info(data_source, solution_str, ground_truth):
    return float(solution_str == ground_truth)


def compute_score_bad_dict(data_source, solution_str, ground_truth, extra_info=None):
    return {"acc": 1.0}


# --- batched TRL functions: called once per scoring batch ------------------------------------------


def trl_counted(completions, solution, **kwargs):
    """trl_accuracy that records the size of each batch it is called with."""
    trl_counted.batches.append(len(completions))
    return [float(_text(c).strip() == s) for c, s in zip(completions, solution, strict=True)]


trl_counted.batches = []


def trl_drops_one(completions, **kwargs):
    """Wrong: one score short."""
    return [1.0 for _ in completions][1:]


def trl_batch_raises(completions, **kwargs):
    raise RuntimeError("reward model out of memory")


def trl_sleeps(completions, **kwargs):
    time.sleep(60)


def trl_text_on_second(completions, **kwargs):
    """A value that is not a number on row 1 only."""
    return ["yes" if j == 1 else 1.0 for j in range(len(completions))]
