"""Run folders and command-line messages: what a run is called, where it resumes, what a typo meant."""

from __future__ import annotations

import difflib
import importlib
import inspect
import re
import sys
import types
import typing
from pathlib import Path

#: Option prefixes whose values name a run (an ablation's change); trainer options and files do not.
_NAMING_PREFIXES = ("--model.", "--data.", "--seed_everything")


def expand_config_defaults(args: list[str]) -> list[str]:
    """Expand ``defaults:`` lists in ``--config`` files, so an experiment composes rather than copies.

    An experiment such as ``experiments/grpo.yaml`` may begin with
    ``defaults: [../configs/algorithms/grpo.yaml, ../configs/tasks/embedded.yaml]`` (paths relative to the
    file); ``--config experiments/grpo.yaml`` then reads as ``--config <preset> --config <task>
    --config <the rest of the experiment>``: later files override earlier ones key by key, exactly as
    several ``--config`` flags do. Defaults may have defaults of their own. A value that is not a file may
    name a preset that ships with rlkit (``--config drgrpo``, see :mod:`rlkit.presets`).
    """
    import yaml

    from rlkit.presets import resolve

    expanded: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in ("--config", "-c") and i + 1 < len(args):
            expanded.extend(_expand_one(Path(resolve(args[i + 1])), yaml, seen=()))
            i += 2
            continue
        if arg.startswith("--config="):
            expanded.extend(_expand_one(Path(resolve(arg.split("=", 1)[1])), yaml, seen=()))
        else:
            expanded.append(arg)
        i += 1
    return expanded


def _expand_one(path: Path, yaml, seen: tuple[Path, ...]) -> list[str]:
    if not path.is_file():
        return [f"--config={path}"]  # the parser reports the missing file
    try:
        content = yaml.safe_load(path.read_text())
    except yaml.YAMLError:
        return [f"--config={path}"]  # the parser reports the syntax error with the file's name
    if not isinstance(content, dict) or "defaults" not in content:
        return [f"--config={path}"]
    from rlkit.errors import ConfigError

    resolved = path.resolve()
    if resolved in seen:
        raise ConfigError(f"{path}: its defaults include itself ({' -> '.join(map(str, (*seen, resolved)))})")
    defaults = content.pop("defaults")
    if not isinstance(defaults, list) or not all(isinstance(d, str) for d in defaults):
        raise ConfigError(f"{path}: defaults must be a list of config file paths, got {defaults!r}")
    out = []
    for default in defaults:
        target = path.parent / default
        if not target.is_file():
            raise ConfigError(f"{path}: default {default!r} not found (looked for {target})")
        out.extend(_expand_one(target, yaml, (*seen, resolved)))
    if content:
        out.append("--config=" + yaml.safe_dump(content, sort_keys=False))
    return out


#: Entry-point group through which an installed package registers its components (``[project.entry-points]``).
ENTRY_POINTS = "rlkit.components"


def import_user_modules(args: list[str]) -> list[str]:
    """Import the modules a run names, before parsing, so their classes resolve by short name.

    They come from ``imports:`` in any ``--config`` (a list of module names), ``--imports=[a,b]`` and the
    shorthand ``--import=a`` (rewritten to ``--imports+=a``, so the saved config keeps it), and from every
    installed package's ``rlkit.components`` entry points. A module that cannot be imported is a config error
    naming it. Returns ``args`` with the shorthand rewritten.
    """
    import importlib.metadata

    import yaml

    out, names = [], []
    for arg in args:
        if arg.startswith("--import="):
            names.append(arg.split("=", 1)[1])
            out.append(f"--imports+={arg.split('=', 1)[1]}")
            continue
        out.append(arg)
        if arg.startswith("--imports="):
            names.extend(_as_list(yaml.safe_load(arg.split("=", 1)[1])))
        elif arg.startswith("--imports+="):
            names.append(arg.split("=", 1)[1])
        elif arg.startswith("--config="):
            value = arg.split("=", 1)[1]
            try:
                content = yaml.safe_load(Path(value).read_text() if Path(value).is_file() else value)
            except (OSError, yaml.YAMLError, ValueError):
                continue  # the parser reports it
            if isinstance(content, dict):
                names.extend(_as_list(content.get("imports")))
    for entry in importlib.metadata.entry_points(group=ENTRY_POINTS):
        names.append(entry.value.split(":", 1)[0])
    from rlkit.errors import ConfigError

    for name in dict.fromkeys(names):
        try:
            importlib.import_module(name)
        except ImportError as error:
            raise ConfigError(
                f"imports: could not import {name!r} ({error}): install it, or put its directory on PYTHONPATH"
            ) from error
    return out


def _as_list(value) -> list[str]:
    if value is None:
        return []
    return [str(v) for v in value] if isinstance(value, list) else [str(value)]


def nulls_as_configs(args: list[str]) -> list[str]:
    """``--model.optim.max_grad_norm=null`` (a null below ``model`` or ``data``) as the equivalent config
    fragment, ``--config=model: {init_args: {optim: {max_grad_norm: null}}}``, in the same place.

    jsonargparse 4.53 hands a nested option's value to the class's own parser as text, and None becomes
    ``"None"``, which no ``X | None`` type accepts; a config fragment carries a real null.
    """
    import yaml

    out = []
    for arg in args:
        key, equals, value = arg.partition("=")
        top, _, rest = key.removeprefix("--").partition(".")
        if not (equals and top in ("model", "data") and rest and value.strip() in ("null", "None", "~")):
            out.append(arg)
            continue
        parts = [part for part in rest.split(".") if part]
        if parts[0] != "init_args":
            parts.insert(0, "init_args")
        tree: object = None
        for part in reversed(parts):
            tree = {part: tree}
        out.append("--config=" + yaml.safe_dump({top: tree}, default_flow_style=True).strip())
    return out


def experiment_name(args: list[str]) -> str | None:
    """The file name (without suffix) of the last ``--config`` given: ``experiments/grpo.yaml`` names ``grpo``."""
    name = None
    for i, arg in enumerate(args):
        if arg.startswith("--config="):
            name = Path(arg.split("=", 1)[1]).stem
        elif arg in ("--config", "-c") and i + 1 < len(args):
            name = Path(args[i + 1]).stem
    return name


def run_name_suffix(args: list[str]) -> str:
    """The part of a run's name that says what the command line changed, e.g. ``advantage=GroupNorm``.

    ``--model.advantage=GroupNorm --model.clip.init_args.eps_high=0.28`` gives
    ``advantage=GroupNorm,clip.eps_high=0.28``; ``--seed_everything=3`` gives ``seed=3``. Options that
    are not about the algorithm or the data (``--trainer.*``, ``--config``) do not name the run.
    """
    parts = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg.startswith(_NAMING_PREFIXES):
            if "=" in arg:
                key, value = arg.split("=", 1)
            elif i + 1 < len(args) and not args[i + 1].startswith("--"):
                key, value = arg, args[i + 1]
                i += 1
            else:
                key, value = arg, "true"
            key = key.removeprefix("--").removeprefix("model.").removeprefix("data.").replace(".init_args", "")
            key = "seed" if key == "seed_everything" else key
            classes = re.findall(r"class_path['\"]?\s*:\s*['\"]?([\w.]+)", value)
            if re.fullmatch(r"[\w.]+\.[A-Z]\w*", value):  # a class path: its class name
                value = value.rsplit(".", 1)[-1]
            elif classes:  # a config fragment, e.g. [{class_path: MathAnswer}]: its classes
                value = "+".join(c.rsplit(".", 1)[-1] for c in classes)
            elif "/" in value:  # a file: its name
                value = Path(value).name
            parts.append(re.sub(r"[^\w=.,+-]", "_", f"{key}={value}"))
        i += 1
    return short_run_name(parts)


#: the longest run-name suffix written out in full; a longer one keeps its first parts and a hash of all
MAX_NAME = 100


def short_run_name(parts: list[str], limit: int = MAX_NAME) -> str:
    """``parts`` (``key=value``) joined by commas, or, when that is longer than ``limit``, the components
    swapped (a class name as value) and then the other parts in order while they fit, followed by
    ``+N-<hash>``: how many parts were left out and the first 6 hex digits of the sha256 of all parts
    (sorted, so the order of the flags does not matter). Same options, same name; no value is cut."""
    joined = ",".join(parts)
    if len(joined) <= limit:
        return joined
    import hashlib

    digest = hashlib.sha256(",".join(sorted(parts)).encode()).hexdigest()[:6]
    swaps = [p for p in parts if re.fullmatch(r"[\w.]+=[A-Z][\w+]*", p)]
    ordered = swaps + [p for p in parts if p not in swaps]
    kept: list[str] = []
    for part in ordered:
        if len(",".join([*kept, part])) + len(f",+{len(parts)}-{digest}") <= limit:
            kept.append(part)
    return ",".join([*kept, f"+{len(parts) - len(kept)}-{digest}"])


def resolve_resume(config, runs: Path) -> str | None:
    """``--ckpt_path=last``: resume the newest run of this name, in its own folder, or say none exists.

    Lightning looks for ``last`` only in the checkpoint directory of the *new* run (a new version
    folder) and otherwise trains from scratch after a hint about ``save_last``. Here the newest
    ``<runs>/version_*/checkpoints/last.ckpt`` (``runs`` is ``<root>/<name>``, see :mod:`rlkit.run_folder`; or
    ``last.ckpt`` in a fixed ``dirpath``) is found and the checkpoint path is set; the found version folder is
    returned, so the run (and its logger's curves) continue where they stopped. With none, a one-line message
    says training starts fresh. Returns None when the run is not resumed from a version folder.
    """
    if config.get("ckpt_path") != "last":
        return None
    candidates = []
    for callback in config.trainer.get("callbacks") or []:
        init_args = getattr(callback, "init_args", None)
        dirpath = init_args.get("dirpath") if init_args is not None else None
        if dirpath:
            candidates.append((Path(dirpath), None))
    versions = sorted(runs.glob("version_*/checkpoints"), key=lambda p: _version_number(p.parent.name))
    candidates.extend((path, path.parent.name) for path in reversed(versions))
    from rlkit.checkpointing import settle_checkpoint  # imports torch: not at the module's import

    for directory, version in candidates:
        last = directory / "last.ckpt"
        settle_checkpoint(last)  # a sharded checkpoint's swap that a kill interrupted
        if last.is_file() or (last / "meta.pt").is_file():  # a file, or a sharded (FSDP2) checkpoint folder
            config.ckpt_path = str(last)
            print(f"rlkit: resuming from {last}", file=sys.stderr)
            return version
    where = ", ".join(dict.fromkeys([*(str(d) for d, v in candidates if v is None), f"{runs}/version_*/checkpoints"]))
    print(f"rlkit: --ckpt_path=last: no checkpoint found (looked in {where}); training starts fresh", file=sys.stderr)
    config.ckpt_path = None
    return None


def purge_resumed_steps(logger, ckpt_path: str | None) -> None:
    """On resume, have TensorBoard drop the events a killed run logged after its checkpoint.

    Curves are indexed by rollouts trained on; a checkpoint after ``k`` rollouts means the points from
    ``k + 1`` on are about to be logged again, so ``purge_step = k + 1`` (TensorBoard's SummaryWriter
    option) hides the first copies instead of drawing a zig-zag.
    """
    from lightning.pytorch.loggers import TensorBoardLogger

    if not ckpt_path or not isinstance(logger, TensorBoardLogger) or not Path(ckpt_path).is_file():
        return
    import torch

    state = torch.load(ckpt_path, map_location="cpu", weights_only=True, mmap=True)
    # Lightning keeps the data module's state under its class name
    iteration = next((v["iteration"] for v in state.values() if isinstance(v, dict) and "iteration" in v), None)
    if iteration is not None:
        logger._kwargs.setdefault("purge_step", int(iteration) + 1)


def _version_number(name: str) -> int:
    digits = name.removeprefix("version_")
    return int(digits) if digits.isdigit() else -1


# ---- parser errors ----


#: Family options that moved into the nested settings every family shares (rlkit 0.2): old name -> new.
MOVED_MODEL_KEYS = {
    "checkpoint": "policy.checkpoint",
    "trust_remote_code": "policy.trust_remote_code",
    "gradient_checkpointing": "policy.gradient_checkpointing",
    "logprob_chunk_rows": "policy.logprob_chunk_rows",
    "attn_implementation": "policy.attn_implementation",
    "ppo_epochs": "loop.ppo_epochs",
    "minibatches": "loop.minibatches",
    "micro_batch_size": "loop.micro_batch_size",
    "micro_batch_tokens": "loop.micro_batch_tokens",
    "pack_sequences": "loop.pack_sequences",
    "seed": "loop.seed",
    "optimizer": "optim.optimizer",
    "lr_scheduler": "optim.lr_scheduler",
    "max_grad_norm": "optim.max_grad_norm",
    "critic_optimizer": "critic_optim.optimizer",
    "critic_lr_scheduler": "critic_optim.lr_scheduler",
    "critic_max_grad_norm": "critic_optim.max_grad_norm",
}


def moved_key_message(message: str) -> str | None:
    """One line naming the new place of an old flat family option (``--model.ppo_epochs`` ->
    ``--model.loop.ppo_epochs``), from the command line or a config file; None if it is not one."""
    found = re.search(r"Option '(\w+)(?:\.[\w.]+)?' is not accepted", message) or re.search(
        r"unrecognized arguments: --model\.(?:init_args\.)?(\w+)", message
    )
    if found is None or found.group(1) not in MOVED_MODEL_KEYS:
        return None
    old, new = found.group(1), MOVED_MODEL_KEYS[found.group(1)]
    group = new.split(".")[0]
    return (
        f"model.{old} is now model.{new}: the settings every family shares are nested (policy.*, loop.*, optim.*"
        f"{', critic_optim.*' if group == 'critic_optim' else ''}); write --model.{new}=... on the command line, "
        f"or model: {{init_args: {{{group}: {{{new.split('.', 1)[1]}: ...}}}}}} in a config file"
    )


def explain_parser_error(message: str) -> str:
    """jsonargparse's report on a bad value, as one line when it is an unknown class name or an old option.

    ``--model.advantage=GroupMaen`` gives "unknown advantage 'GroupMaen' (did you mean GroupMean?);
    known: GroupMean, GroupNorm, ..."; ``--model.ppo_epochs=2`` names ``--model.loop.ppo_epochs``. Other
    messages are returned unchanged.
    """
    moved = moved_key_message(message)
    if moved is not None:
        return moved
    keys = re.findall(r'Parser key "([\w.]+)"', message)
    bad = re.findall(r"Expected a dot import path string: (\S+)", message)
    if keys and not bad:
        return _explain_nested_option(keys[0], message) or message
    if not keys or not bad:
        return message
    value, key = bad[-1], keys[-1]
    owner = _owner_class(keys, message)
    known = _known_names(owner, key.rsplit(".", 1)[-1]) if owner is not None else []
    option = keys[0] if len(keys) == 1 else f"{keys[0]}.{key}"
    if not known:
        return f"unknown class {value!r} for --{option}: give a short name or a full import path (module.Class)"
    close = difflib.get_close_matches(value, known, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return (
        f"unknown {key.rsplit('.', 1)[-1]} {value!r} for --{option}{hint}; known: {', '.join(known)} "
        "(or a full import path, module.Class)"
    )


def _explain_nested_option(top: str, message: str) -> str | None:
    """A component option that does not exist or has the wrong type, as one line.

    ``--model.advantage.init_args.epz=1`` gives "unknown option --model.advantage.init_args.epz: GroupNorm
    has no parameter 'epz' (did you mean eps?); its parameters: eps".
    """
    nested = re.search(r"NestedArg\(key='([\w.]+)', val='(.*)'\)", message)
    if nested is None:
        return None
    option = f"--{top}.{nested.group(1)}"
    unknown = re.search(r"Option '(\w+)' is not accepted", message)
    if unknown is not None:
        paths = re.findall(r"given class_path '([\w.]+)'", message)
        owner = _import(paths[-1]) if paths else None
        if owner is None:
            return f"unknown option {option}"
        params = _parameters(owner)
        close = difflib.get_close_matches(unknown.group(1), params, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        return (
            f"unknown option {option}: {owner.__name__} has no parameter {unknown.group(1)!r}{hint}; "
            f"its parameters: {', '.join(params) or 'none'}"
        )
    unrecognized = re.search(r"unrecognized arguments: --([\w.]+)", message)
    if unrecognized is not None and "." in unrecognized.group(1):
        paths = re.findall(r"given class_path '([\w.]+)'", message)
        owner = _import(paths[-1]) if paths else None
        group, _, name = unrecognized.group(1).rpartition(".")
        fields = _group_fields(owner, group) if owner is not None else []
        if fields:
            close = difflib.get_close_matches(name, fields, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            settings = ", ".join(fields)
            return f"unknown option {option}: model.{group} has no setting {name!r}{hint}; its settings: {settings}"
    types = _expected_types(message)
    if types:
        return f"{option}: expected {' or '.join(types)}, got {nested.group(2)!r}"
    return None


def _group_fields(owner: type, group: str) -> list[str]:
    """The fields of the nested settings ``group`` (a dataclass parameter, e.g. ``loop``) of ``owner``."""
    import dataclasses

    for cls in owner.__mro__:
        init = cls.__dict__.get("__init__")
        if init is None:
            continue
        try:
            hint = typing.get_type_hints(init).get(group)
        except Exception:  # unresolvable annotations: no list rather than a crash in an error path
            return []
        if hint is not None:
            return [f.name for f in dataclasses.fields(hint)] if dataclasses.is_dataclass(hint) else []
    return []


def _parameters(owner: type) -> list[str]:
    """``owner``'s constructor parameters, with those its ``**kwargs`` pass to the base classes."""
    names: list[str] = []
    for cls in owner.__mro__:
        init = cls.__dict__.get("__init__")
        if init is None:
            continue
        parameters = inspect.signature(init).parameters.values()
        names += [p.name for p in parameters if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if not any(p.kind is p.VAR_KEYWORD for p in parameters):
            break
    return list(dict.fromkeys(names))


def _expected_types(message: str) -> list[str]:
    """The types the innermost ``Parser key`` of a jsonargparse report expects (``null`` for None)."""
    lines = message.splitlines()
    starts = [i for i, line in enumerate(lines) if 'Parser key "' in line]
    if not starts:
        return []
    indent = len(lines[starts[-1]]) - len(lines[starts[-1]].lstrip())
    inner = [lines[starts[-1]]]
    for line in lines[starts[-1] + 1 :]:
        if len(line) - len(line.lstrip()) <= indent:
            break
        inner.append(line)
    found = re.findall(r"Expected a <class '([\w.]+)'>", "\n".join(inner))
    return ["null" if name == "NoneType" else name for name in dict.fromkeys(found)]


def _owner_class(keys: list[str], message: str):
    """The class whose constructor declares the innermost key of a parser error."""
    paths = re.findall(r"given class_path '([\w.]+)'", message)
    if paths:
        return _import(paths[-1])
    if keys[0].startswith("data"):
        from rlkit.rollouts.datamodule import RolloutDataModule

        return RolloutDataModule
    return None


def _import(path: str):
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def _known_names(owner, key: str) -> list[str]:
    """Short names of the concrete classes that ``owner.__init__``'s parameter ``key`` accepts."""
    try:
        hint = typing.get_type_hints(owner.__init__).get(key)
    except Exception:  # unresolvable annotations: no list rather than a crash in an error path
        return []
    names = set()
    for base in _classes_in(hint):
        for cls in _subclasses(base):
            if not inspect.isabstract(cls) and not cls.__name__.startswith("_"):
                names.add(cls.__name__)
    return sorted(names)


def _classes_in(hint) -> list[type]:
    if isinstance(hint, type):
        return [hint]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is not None:
        return [cls for arg in typing.get_args(hint) for cls in _classes_in(arg) if cls is not type(None)]
    return []


def _subclasses(base: type) -> list[type]:
    found = [base]
    for sub in base.__subclasses__():
        found.extend(_subclasses(sub))
    return found
