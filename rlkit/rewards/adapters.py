"""Reward functions users already have, used as they are: TRL's batch shape and verl's ``compute_score``.

Both adapters take the function by import path, so a YAML or a command line can name it::

    --data.rewards='[{class_path: TRLReward, init_args: {function: my_rewards.accuracy}}]'
    --data.rewards='[{class_path: VerlReward, init_args: {function: path/to/score.py:compute_score}}]'
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlkit.data.prompts import Prompt
from rlkit.rewards.base import BatchedReward, RewardFunction


def load_function(spec: str, owner: str) -> Callable:
    """The callable an import path names: ``package.module.function``, ``package.module:function`` or
    ``path/to/file.py:function``. A ValueError naming ``owner`` and the fix when it cannot be loaded."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"{owner}: `function` must be an import path such as 'my_rewards.accuracy', got {spec!r}.")
    spec = spec.strip()
    if ":" in spec:
        module_name, _, attribute = spec.rpartition(":")
    else:
        module_name, _, attribute = spec.rpartition(".")
    if not module_name or not attribute:
        raise ValueError(
            f"{owner}: {spec!r} is not an import path. Write 'package.module.function', "
            f"'package.module:function' or 'path/to/file.py:function'."
        )
    if module_name.endswith(".py"):
        module = _module_from_file(Path(module_name), owner, spec)
    else:
        module = _import(module_name, owner, spec)
    try:
        function = getattr(module, attribute)
    except AttributeError:
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise ValueError(
            f"{owner}: module {module.__name__!r} has no attribute {attribute!r} (from {spec!r}); its functions "
            f"are {public[:20]}."
        ) from None
    if not callable(function) or inspect.isclass(function):
        raise ValueError(f"{owner}: {spec!r} is a {type(function).__name__}, not a function.")
    return function


def _import(name: str, owner: str, spec: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        top = name.split(".")[0]
        cwd = os.getcwd()
        local = Path(cwd, f"{top}.py").is_file() or Path(cwd, top, "__init__.py").is_file()
        if e.name == top and local and cwd not in sys.path:
            # The console script does not put the working directory on sys.path, as `python -m` would.
            sys.path.append(cwd)
            return _import(name, owner, spec)
        raise ValueError(
            f"{owner}: cannot import {name!r} (from {spec!r}): {e}. Put the module's folder on PYTHONPATH, or "
            f"give the file itself, e.g. 'path/to/{top}.py:{spec.replace(':', '.').rpartition('.')[2]}'."
        ) from None
    except Exception as e:
        raise ValueError(f"{owner}: importing {name!r} (from {spec!r}) failed: {type(e).__name__}: {e}.") from e


def _module_from_file(path: Path, owner: str, spec: str):
    if not path.is_file():
        raise ValueError(f"{owner}: file {str(path)!r} not found (from {spec!r}). Check the path.")
    name = "rlkit_rewards_from_" + re.sub(r"\W", "_", path.resolve().with_suffix("").as_posix().strip("/"))
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise ValueError(f"{owner}: running {str(path)!r} failed: {type(e).__name__}: {e}.") from e
    return module


def _parameters(function: Callable) -> tuple[set[str], set[str], bool]:
    """(keyword-passable names, those without a default, whether it takes **kwargs)."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # some builtins have no signature: let the call decide
        return set(), set(), True
    named = {
        p.name
        for p in signature.parameters.values()
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    required = {
        p.name
        for p in signature.parameters.values()
        if p.default is inspect.Parameter.empty
        and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    positional_only = [
        p.name
        for p in signature.parameters.values()
        if p.kind is inspect.Parameter.POSITIONAL_ONLY and p.default is inspect.Parameter.empty
    ]
    if positional_only:
        raise ValueError(f"positional-only parameters {positional_only} cannot be passed by keyword")
    var_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
    return named, required, var_keyword


class _Adapter(RewardFunction):
    """Holds the import path; pickles as that path, so worker processes import the function themselves."""

    calls: str  # how its library calls such a function, for error messages
    needs: str  # the parameter that function cannot do without
    instead: str  # the other shape, and its adapter

    def __init__(self, function: str, name: str | None = None) -> None:
        owner = type(self).__name__
        self.function = function
        self.fn = load_function(function, owner)
        self.name = name if name is not None else getattr(self.fn, "__name__", "reward")
        try:
            self._named, self._required, self._var_keyword = _parameters(self.fn)
        except ValueError as e:
            raise ValueError(f"{owner}: {function!r} cannot be called by keyword: {e}.") from None
        if not (self._var_keyword or self.needs in self._named):
            raise ValueError(
                f"{owner}: {function!r} does not take these reward arguments: {self.calls}, and this function "
                f"has no `{self.needs}` parameter and no **kwargs. {self.instead}"
            )

    def __getstate__(self) -> dict:
        return {"function": self.function, "name": self.name}

    def __setstate__(self, state: dict) -> None:
        _Adapter.__init__(self, state["function"], state["name"])

    def _keywords(self, offered: dict[str, Any], where: str) -> dict[str, Any]:
        """The subset of ``offered`` the function accepts; a ValueError naming what it lacks."""
        missing = sorted(self._required - offered.keys())
        if missing:
            raise ValueError(
                f"{type(self).__name__}({self.function!r}) needs {missing}, which {where} does not provide; "
                f"it provides {sorted(offered)}. Give the prompt file those columns (PromptFile passes every "
                f"column but the prompt), or give the parameters defaults."
            )
        if self._var_keyword:
            return offered
        return {k: v for k, v in offered.items() if k in self._named}


class TRLReward(_Adapter, BatchedReward):
    """A TRL reward function, used as is: ``fn(prompts, completions, **columns) -> list[float | None]``.

    Called as TRL's ``GRPOTrainer`` calls it: once per scoring batch (``RewardScorer`` scores a whole
    rollout at once, so a batched reward model keeps its batching), in TRL's layout: ``prompts`` and
    ``completions`` lists with one entry per completion (for chat messages each completion is
    ``[{"role": "assistant", "content": ...}]``), and each other column of the prompts' rows as a list
    of the same length (``solution=[...]``; None where a row lacks the column). A function without
    ``**kwargs`` gets only the columns it names. A None score means "does not apply". The batch's time
    limit is the scorer's ``timeout_s`` per completion; a batch that raises or does not return one score
    per completion is one error naming the function and what it returned.

    Args:
        function: its import path: ``my_rewards.accuracy``, ``my_rewards:accuracy`` or
            ``path/to/file.py:accuracy``.
        name: the label of its curve (``reward/<name>``); None uses the function's ``__name__``, as TRL does.
        batched: True calls the function once per batch; False once per completion (each call with
            its own time limit and error policy; for a function that is slow on some inputs).
    """

    calls = "TRL calls fn(prompts=..., completions=..., **columns)"
    needs = "completions"
    instead = "For verl's compute_score(data_source, solution_str, ground_truth, extra_info) use VerlReward."

    def __init__(self, function: str, name: str | None = None, batched: bool = True) -> None:
        super().__init__(function, name)
        self.batched = bool(batched)

    def __getstate__(self) -> dict:
        return {**super().__getstate__(), "batched": self.batched}

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.batched = state.get("batched", True)

    def __call__(self, completion: str, prompt: Prompt) -> float | None:
        return self.score_batch([completion], [prompt])[0]  # RewardScorer checks that it is a number or None

    def score_batch(self, completions: list[str], prompts: list[Prompt]) -> list[float | None]:
        columns = list(dict.fromkeys(key for prompt in prompts for key in prompt.meta))
        offered = {key: [prompt.meta.get(key) for prompt in prompts] for key in columns}
        offered["prompts"] = [prompt.prompt for prompt in prompts]
        offered["completions"] = [
            [{"role": "assistant", "content": completion}] if isinstance(prompt.prompt, list) else completion
            for completion, prompt in zip(completions, prompts, strict=True)
        ]
        # a column the function needs must be in every row (the per-completion path refuses such a row too)
        lacking = {key for key in self._required & set(columns) if any(key not in p.meta for p in prompts)}
        where = "the prompt's row" if len(prompts) == 1 else "a row of the batch"
        keywords = self._keywords({k: v for k, v in offered.items() if k not in lacking}, where)
        scores = self.fn(**keywords)
        n = len(completions)
        if isinstance(scores, str | bytes | dict) or not hasattr(scores, "__len__") or len(scores) != n:
            count = "one completion" if n == 1 else f"{n} completions"
            raise ValueError(
                f"TRLReward({self.function!r}) returned {type(scores).__name__} {scores!r:.60} for {count}; a "
                f"TRL reward function returns a list with one float (or None) per completion."
            )
        return list(scores)


class VerlReward(_Adapter):
    """A verl reward function, used as is: ``compute_score(data_source, solution_str, ground_truth,
    extra_info) -> float | dict`` (a dict's ``"score"`` is the reward).

    Called by keyword, as verl's reward managers do, with ``solution_str`` the completion,
    ``ground_truth`` the prompt's ground truth (``reward_model.ground_truth`` in verl's layout) and
    ``data_source`` / ``extra_info`` the row's columns of those names (None when absent). A function
    that does not take ``extra_info`` or ``data_source`` is called without them.

    Args:
        function: its import path: ``my_rewards.compute_score``, ``my_rewards:compute_score`` or
            ``path/to/file.py:compute_score``.
        name: the label of its curve (``reward/<name>``); None uses the function's ``__name__``.
    """

    calls = "verl calls compute_score(data_source=..., solution_str=..., ground_truth=..., extra_info=...)"
    needs = "solution_str"
    instead = "For TRL's fn(prompts, completions, **columns) use TRLReward."

    def __call__(self, completion: str, prompt: Prompt) -> float | None:
        offered = {
            "data_source": prompt.meta.get("data_source"),
            "solution_str": completion,
            "ground_truth": prompt.ground_truth,
            "extra_info": prompt.meta.get("extra_info"),
        }
        result = self.fn(**self._keywords(offered, "verl's call"))
        if isinstance(result, dict):
            if "score" not in result:
                raise ValueError(
                    f"VerlReward({self.function!r}) returned a dict without 'score' (keys {sorted(result)}); "
                    f"verl reads the reward from result['score']."
                )
            result = result["score"]
        return result  # RewardScorer checks that it is a number
