"""What ``--ckpt_path`` resumes, checked before any weight is loaded: one line naming the file and what differs.

Lightning reads a checkpoint with ``torch.load`` and copies its ``state_dict`` into the module; a file that is
no checkpoint, a checkpoint of another family or of another model shape then ends in a traceback
(``UnpicklingError: Weights only load failed``, ``Missing key(s) ... critic.*``, 56 lines of ``size
mismatch``). Here, in order:

1. :func:`read_checkpoint` (the CLI, before the Trainer starts): the file exists, is a torch file (not text,
   not ``.safetensors``, not truncated) and holds a Lightning checkpoint. It is read with ``mmap=True``:
   tensors stay on disk, so this costs a directory read, not the checkpoint's size.
2. :func:`check_family` (the CLI): the family that wrote it (:func:`metadata`, saved in every checkpoint since
   rlkit 0.3; for older ones the run's ``config.yaml`` beside the ``checkpoints`` folder) is this run's.
3. :func:`check_world_size` (the CLI): a sharded checkpoint folder needs the sharding strategy and the number
   of processes that wrote it; a whole-state checkpoint resumes on any number (rlkit's prompt order and
   sample seeds do not depend on it), said in one line when it changes.
4. :func:`check_weights` (the module's ``on_load_checkpoint``, after the model is built and before Lightning
   copies the weights): the saved parameter names and shapes are the module's.
"""

from __future__ import annotations

import sys
import zipfile
from collections.abc import Mapping
from pathlib import Path

import torch

from rlkit.errors import ConfigError

#: The checkpoint key under which rlkit records who wrote a checkpoint (family, world size).
METADATA_KEY = "rlkit"
#: Differing parameters named in a message (the rest are counted).
SHOWN = 3
_RESUME_FIX = "give a checkpoint that `rlkit fit` wrote (<run>/checkpoints/last.ckpt), or --ckpt_path=last"


def _name(module_or_class) -> str:
    cls = module_or_class if isinstance(module_or_class, type) else type(module_or_class)
    return f"{cls.__module__}.{cls.__qualname__}"


def metadata(module, trainer) -> dict:
    """What :func:`check_family` and :func:`check_world_size` compare, saved in each checkpoint: plain values
    (``torch.load`` is weights-only)."""
    return {"family": _name(module), "world_size": int(trainer.world_size)}


def read_checkpoint(path: str | Path) -> dict:
    """The checkpoint at ``path`` (tensors memory-mapped), or a :class:`ConfigError` naming the file and what
    it is instead: missing, text, a ``.safetensors`` weights file, empty, truncated or another torch file."""
    path = Path(path)
    where = f"--ckpt_path={path}"
    if not path.exists():
        raise ConfigError(f"{where}: no such file; {_RESUME_FIX}")
    if path.is_dir():
        raise ConfigError(f"{where} is a folder, not a checkpoint file; {_RESUME_FIX}")
    with path.open("rb") as file:
        head = file.read(64)
    if not head:
        raise ConfigError(f"{where} is empty (0 bytes), not a Lightning checkpoint; {_RESUME_FIX}")
    if _is_safetensors(head):
        raise ConfigError(
            f"{where} is a .safetensors weights file, not a Lightning checkpoint (which also holds the optimizer "
            "and the data position): to start a new run from these weights put them in a model folder and set "
            f"--model.policy.checkpoint=DIR without --ckpt_path; to resume, {_RESUME_FIX}"
        )
    if not head.startswith((b"PK\x03\x04", b"\x80")):  # torch's zip format, or its legacy pickle
        kind = "text" if _is_text(head) else "not a torch file"
        shown = head[:24].decode("utf-8", "replace").splitlines()[0] if _is_text(head) else head[:8].hex()
        raise ConfigError(f"{where} is {kind} (it begins {shown!r}), not a Lightning checkpoint; {_RESUME_FIX}")
    try:
        if head.startswith(b"PK"):  # torch says only "Invalid argument" of a zip without its index (torn)
            with zipfile.ZipFile(path) as archive:
                archive.infolist()
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=head.startswith(b"PK"))
    except Exception as error:  # torch's reader raises RuntimeError, UnpicklingError, EOFError, ...
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        if isinstance(error, zipfile.BadZipFile):
            reason = f"{reason}: its index at the end is missing, as when a copy or a write was cut short"
        raise ConfigError(
            f"{where} could not be read as a checkpoint, truncated or corrupt ({reason}); resume from an earlier "
            f"checkpoint in {path.resolve().parent} or {_RESUME_FIX}"
        ) from error
    if not isinstance(state, dict) or "state_dict" not in state or "global_step" not in state:
        keys = ", ".join(map(str, list(state)[:5])) if isinstance(state, dict) else type(state).__name__
        raise ConfigError(
            f"{where} is a torch file but not a Lightning checkpoint (no state_dict and global_step; it holds "
            f"{keys}); {_RESUME_FIX}"
        )
    return state


def _is_safetensors(head: bytes) -> bool:
    # 8 bytes: the JSON header's length (little-endian), then the header itself
    return len(head) > 9 and head[8:9] == b"{" and 0 < int.from_bytes(head[:8], "little") < 100_000_000


def _is_text(head: bytes) -> bool:
    try:
        head.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return "\x00" not in head.decode("utf-8")


def saved_family(path: Path, state: Mapping) -> str | None:
    """The family (``module.Class``) that wrote the checkpoint: its metadata, else the ``model.class_path``
    of the run's ``config.yaml`` beside its ``checkpoints`` folder, else None (unknown)."""
    recorded = state.get(METADATA_KEY)
    if isinstance(recorded, dict) and recorded.get("family"):
        return str(recorded["family"])
    config = Path(path).resolve().parent.parent / "config.yaml"
    if not config.is_file():
        return None
    import yaml

    try:
        model = (yaml.safe_load(config.read_text()) or {}).get("model")
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    return model.get("class_path") if isinstance(model, dict) else None


def check_family(path: str | Path, state: Mapping, module) -> None:
    """A checkpoint another family wrote (a Dr.GRPO run resumed with ``ppo.yaml``) is a one-line error."""
    family, ours = saved_family(Path(path), state), _name(module)
    if family is None or family == ours or _resolve(family) is type(module):
        return  # a config names a class by any import path (rlkit.algorithms.PolicyGradient)
    raise ConfigError(
        f"--ckpt_path={path} was written by another family ({family.rsplit('.', 1)[-1]}, {family}); this run is "
        f"{type(module).__name__} ({ours}): resume with the experiment that wrote it, or start a new run "
        "without --ckpt_path"
    )


def _resolve(path: str):
    import importlib

    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None


def check_world_size(path: str | Path, state: Mapping, trainer) -> None:
    """A whole-state checkpoint resumes on any number of processes; the change is said in one line."""
    recorded = state.get(METADATA_KEY)
    saved = recorded.get("world_size") if isinstance(recorded, dict) else None
    if saved is None or int(saved) == trainer.world_size or not trainer.is_global_zero:
        return
    print(
        f"rlkit: --ckpt_path={path} was written by {saved} process(es), this run has {trainer.world_size}: the "
        "prompt order, sample seeds and step totals do not depend on it; with model.loop.minibatches > 1 each "
        "rank shuffles its own rows, so from here the run is not bitwise the one it would have been",
        file=sys.stderr,
    )


def check_sharded_folder(path: str | Path, trainer) -> bool:
    """True when ``path`` is a sharded checkpoint folder this run's strategy reads itself (checked no further);
    a sharded folder under a strategy that cannot read it is a one-line error naming the writers' count."""
    path = Path(path)
    if not path.is_dir():
        return False
    shards = sorted(path.glob("*.distcp"))
    if not shards and not (path / "meta.pt").is_file():
        return False  # read_checkpoint says it is a folder, not a checkpoint
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    if isinstance(trainer.strategy, FSDPStrategy | ModelParallelStrategy):
        return True
    raise ConfigError(
        f"--ckpt_path={path} is a sharded checkpoint folder ({len(shards)} shard file(s), written by a sharding "
        f"strategy), and this run uses {type(trainer.strategy).__name__}: resume it with the strategy that wrote "
        "it (e.g. --config configs/trainer/fsdp.yaml), or give a whole-state .ckpt file"
    )


def check_weights(path, saved: Mapping[str, object], expected: Mapping[str, object], strict: bool = True) -> None:
    """The saved parameter names and shapes are the module's, else a one-line error naming the first few that
    differ: another model (shapes) or another family / another set of components (names)."""
    saved_tensors = {k: v for k, v in saved.items() if isinstance(v, torch.Tensor)}
    expected_tensors = {k: v for k, v in expected.items() if isinstance(v, torch.Tensor)}
    shapes = [
        f"{k} {list(saved_tensors[k].shape)} in the checkpoint, {list(v.shape)} here"
        for k, v in expected_tensors.items()
        if k in saved_tensors and saved_tensors[k].shape != v.shape
    ]
    if shapes:
        raise ConfigError(
            f"--ckpt_path={path} holds another model shape: {len(shapes)} parameter(s) differ, "
            f"{_first(shapes)}; resume with the model it was trained with (model.policy.checkpoint), or start a "
            "new run without --ckpt_path"
        )
    if not strict:
        return
    missing = [k for k in expected if k not in saved]
    unexpected = [k for k in saved if k not in expected]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"it lacks {len(missing)} this run has ({_first(missing)}; {_groups(missing)})")
        if unexpected:
            parts.append(f"it has {len(unexpected)} this run lacks ({_first(unexpected)}; {_groups(unexpected)})")
        raise ConfigError(
            f"--ckpt_path={path} holds other parameters than this run's model: {' and '.join(parts)}; another "
            "family or other stateful components wrote it: resume with the experiment that wrote it, or start a "
            "new run without --ckpt_path"
        )


def _first(items: list[str]) -> str:
    more = f", ... ({len(items) - SHOWN} more)" if len(items) > SHOWN else ""
    return ", ".join(items[:SHOWN]) + more


def _groups(keys: list[str]) -> str:
    """Counts by top-level name, e.g. ``critic.*: 27``."""
    counts: dict[str, int] = {}
    for key in keys:
        top = key.split(".", 1)[0]
        counts[top] = counts.get(top, 0) + 1
    return ", ".join(f"{top}.*: {n}" for top, n in counts.items())
