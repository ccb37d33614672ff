"""A study's variants, each parsed and instantiated by ``rlkit fit``'s own parser before anything runs.

Every value of every ``--vary`` (and, with ``--grid``, every combination) goes through
``build_cli(..., run=False)``: the same parser, links and component constructors as ``rlkit fit``, so an
unknown key, an unknown class, a value of the wrong type or one a component rejects fails here with the
message ``rlkit fit`` would print, before any run starts. The resolved configs also tell which value is
the base's own (see :mod:`rlkit.studies.plan`).
"""

from __future__ import annotations

import contextlib
import io
import itertools
import logging
import os
import re
import sys
import warnings

import yaml

from rlkit.errors import ConfigError, RLKitError
from rlkit.runs import run_name_suffix
from rlkit.studies.plan import BASE, Study, Variant

# Lightning's start-up lines ("GPU available", "Seed set to") would repeat for every parsed variant.
_QUIET_LOGGERS = ("lightning.pytorch", "lightning.fabric", "lightning_fabric")


def resolve(study: Study) -> list[Variant]:
    """Parse every variant; return the base followed by the variants that differ from it."""
    check = _Checker(study)
    base = check.resolved({}, "the base config")
    check.run_layout(base)
    levels: list[list[tuple[str, str]]] = []
    for factor in study.factors:
        own: list[tuple[str, str]] = []
        seen = [base]
        for value in factor.values:
            config = check.resolved({factor.key: value}, f"--vary {factor.key}={value}")
            if config == base:
                continue  # the base's own value
            if config in seen:
                print(f"rlkit ablate: --vary {factor.key}={value} repeats an earlier value; run once", file=sys.stderr)
                continue
            seen.append(config)
            own.append((factor.key, value))
        if not own:
            print(
                f"rlkit ablate: every value of --vary {factor.key} is the base's own: it varies nothing",
                file=sys.stderr,
            )
        levels.append(own)
    variants = [Variant(BASE)]
    if study.grid:
        for cell in itertools.product(*([None, *own] for own in levels)):
            changes = dict(change for change in cell if change is not None)
            if len(changes) > 1:  # single changes were parsed above
                check.resolved(changes, "the combination " + " ".join(f"{k}={v}" for k, v in changes.items()))
            if changes:
                variants.append(_named(changes))
    else:
        variants += [_named(dict([change])) for own in levels for change in own]
    names = [v.name for v in variants]
    for i, variant in enumerate(variants):
        if names.count(variant.name) > 1:  # a name cut at 120 characters
            variant.name = f"{variant.name}-{i}"
    return variants


def _named(changes: dict[str, str]) -> Variant:
    """``advantage=GroupNorm``: the name ``rlkit fit`` gives the change (``trainer.*`` keys keep their key)."""
    parts = []
    for key, value in changes.items():
        part = run_name_suffix([f"--{key}={_short(value)}"])
        parts.append(part or re.sub(r"[^\w=.,+-]", "_", f"{key.replace('.init_args', '')}={value}"))
    return Variant(",".join(parts)[:120], changes)


def _short(value: str) -> str:
    """A whole component given inline, ``{class_path: PPOClip, init_args: {eps_high: 0.28}}``, as
    ``PPOClip+eps_high=0.28``; other values as they are."""
    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError:
        return value
    if not isinstance(parsed, dict) or "class_path" not in parsed:
        return value
    init_args = parsed.get("init_args") or {}
    return "+".join([str(parsed["class_path"]).rsplit(".", 1)[-1], *(f"{k}={v}" for k, v in init_args.items())])


class _Checker:
    """Parses ``base + changes`` as ``rlkit fit`` would, quietly, and returns the resolved config."""

    def __init__(self, study: Study) -> None:
        self.study = study

    def resolved(self, changes: dict[str, str], what: str) -> dict:
        from rlkit.cli import build_cli

        args = [*(f"--config={c}" for c in self.study.configs), *self.study.overrides]
        args += [f"--{key}={value}" for key, value in changes.items()]
        # a fixed run name: the CLI would otherwise name each parse by its changes
        args += [f"--seed_everything={self.study.seeds[0]}", "--trainer.logger.init_args.name=study-check"]
        captured = io.StringIO()
        levels = {name: logging.getLogger(name).level for name in _QUIET_LOGGERS}
        seed_env = {name: os.environ.get(name) for name in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")}
        try:
            for name in _QUIET_LOGGERS:
                logging.getLogger(name).setLevel(logging.WARNING)
            with contextlib.redirect_stderr(captured), contextlib.redirect_stdout(captured), warnings.catch_warnings():
                # `rlkit ablate ...` is on sys.argv; these args are the ones meant
                warnings.filterwarnings("ignore", message=".*LightningCLI's args parameter.*")
                cli = build_cli(args, run=False)
        except SystemExit:  # the parser printed its error and exits 2, as `rlkit fit` does
            raise ConfigError(f"{what}: {_parser_message(captured.getvalue())}") from None
        except RLKitError as error:
            raise type(error)(f"{what}: {error}") from error
        except (FileNotFoundError, NotADirectoryError) as error:
            raise ConfigError(f"{what}: {error}") from error
        finally:
            for name, level in levels.items():
                logging.getLogger(name).setLevel(level)
            for name, value in seed_env.items():  # build_cli seeds this process; the runs seed themselves
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        return yaml.safe_load(cli.parser.dump(cli.config, skip_none=False, skip_validation=True))

    def run_layout(self, config: dict) -> None:
        """Each run needs its own TensorBoard folder and checkpoints; the study decides where they go."""
        logger = (config.get("trainer") or {}).get("logger")
        if not isinstance(logger, dict) or not str(logger.get("class_path", "")).endswith("TensorBoardLogger"):
            raise ConfigError(
                "a study reads each run's TensorBoard events: the base config's trainer.logger must be a "
                "TensorBoardLogger (the rlkit default)"
            )
        for callback in (config.get("trainer") or {}).get("callbacks") or []:
            init_args = callback.get("init_args") or {} if isinstance(callback, dict) else {}
            if init_args.get("dirpath"):
                name = str(callback.get("class_path", "")).rsplit(".", 1)[-1]
                raise ConfigError(
                    f"the base config gives {name} a fixed dirpath ({init_args['dirpath']}): every run of a study "
                    "would write there; remove dirpath so each run writes into its own folder"
                )


def _parser_message(output: str) -> str:
    """The ``error: ...`` part of jsonargparse's report (after the one-line usage)."""
    _, sep, message = output.partition("error: ")
    message = message if sep else output
    return " ".join(line.strip() for line in message.strip().splitlines()) or "invalid configuration"
