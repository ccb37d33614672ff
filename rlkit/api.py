"""The Python API: ``rlkit.fit``, the ``rlkit fit`` command as a function call.

The same parser, presets, run folders and messages as the command line: the configs and keyword overrides
become the command line ``rlkit fit --config=... --key=value ...`` would get, and that command runs in this
process. Example (a notebook cell)::

    import rlkit

    result = rlkit.fit("drgrpo", trainer={"max_steps": 20}, **{"model.advantage": "GroupNorm"})
    result.module, result.run_dir  # the trained LightningModule and the run's folder (logs, checkpoints)
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlkit.errors import ConfigError


@dataclass(frozen=True)
class FitResult:
    """What :func:`fit` returns.

    Attributes:
        module: the trained ``LightningModule`` (the family, e.g. ``PolicyGradient``), weights after training.
        trainer: the Lightning ``Trainer`` that ran (``trainer.callback_metrics``, ``trainer.global_step``).
        run_dir: the run's folder (``config.yaml``, ``checkpoints/``, ``hf_export/``, ``samples.jsonl``; a
            TensorBoard or CSV logger's curves), whatever the logger (see :mod:`rlkit.run_folder`).
    """

    module: Any
    trainer: Any
    run_dir: Path


def fit(config_or_paths: str | os.PathLike | Sequence[str | os.PathLike] | None = None, **overrides: Any) -> FitResult:
    """Train as ``rlkit fit`` would, in this process, and return the trained module, the trainer and the run folder.

    Args:
        config_or_paths: a preset's name (``"drgrpo"``, see ``rlkit presets``), a config file, YAML text, or a
            list of these (later ones override earlier ones, as several ``--config`` flags do).
        **overrides: config keys, each as ``--key=value`` on the command line. Nested dicts name nested keys
            (``trainer={"max_steps": 3}`` is ``--trainer.max_steps=3``); dotted keys work as they are
            (``**{"model.advantage": "GroupNorm"}``). A dict with a ``class_path`` is one value (a component
            with its settings); lists, dicts, None and booleans are written as YAML (``null``, ``true``).

    Raises:
        ConfigError: a bad config or value, with the one-line message ``rlkit fit`` prints (not ``SystemExit``).

    Example::

        result = rlkit.fit("drgrpo", trainer={"max_steps": 3}, data={"prompts_per_step": 4})
    """
    from rlkit.cli import ParserError, build_cli

    args = ["fit", *(f"--config={c}" for c in _configs(config_or_paths)), *command_line(overrides)]
    try:
        cli = build_cli(args, run=True, raise_parser_errors=True)
    except ParserError as error:
        raise ConfigError(error.message) from None
    except (FileNotFoundError, NotADirectoryError) as error:  # what `rlkit` reports as a usage error (exit 2)
        raise ConfigError(str(error)) from error
    from rlkit.run_folder import run_dir

    return FitResult(cli.model, cli.trainer, run_dir(cli.trainer))


def _configs(config_or_paths) -> list[str]:
    if config_or_paths is None:
        return []
    if isinstance(config_or_paths, str | os.PathLike):
        return [os.fspath(config_or_paths)]
    if isinstance(config_or_paths, Sequence):
        return [os.fspath(c) for c in config_or_paths]
    raise ConfigError(
        f"rlkit.fit: config_or_paths must be a preset name, a config path or a list of them, got "
        f"{type(config_or_paths).__name__} {config_or_paths!r}; give the overrides as keyword arguments"
    )


def command_line(overrides: Mapping[str, Any], prefix: str = "") -> list[str]:
    """``overrides`` as ``--key=value`` options: nested dicts as dotted keys, a ``class_path`` dict as one value.

    ``command_line({"trainer": {"max_steps": 3}, "model.advantage": "GroupNorm"})`` gives
    ``["--trainer.max_steps=3", "--model.advantage=GroupNorm"]``.
    """
    out = []
    for key, value in overrides.items():
        if not isinstance(key, str) or not key:
            raise ConfigError(f"rlkit.fit: override keys are config keys such as 'trainer.max_steps', got {key!r}")
        name = f"{prefix}{key.removeprefix('--')}"
        if isinstance(value, Mapping) and value and "class_path" not in value:
            out.extend(command_line(value, prefix=f"{name}."))
        else:
            out.append(f"--{name}={_as_text(value)}")
    return out


def _as_text(value: Any) -> str:
    """A value as the command line writes it: text as it is, the rest as YAML (JSON is YAML)."""
    if isinstance(value, str):
        return value
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    try:
        return json.dumps(value, default=os.fspath)
    except TypeError as error:
        raise ConfigError(
            f"rlkit.fit: cannot write {type(value).__name__} {value!r:.60} as a config value; give text, a number, "
            f"a bool, None, a list or a dict (a component as {{'class_path': ..., 'init_args': {{...}}}})"
        ) from error
