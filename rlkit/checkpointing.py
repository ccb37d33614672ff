"""Checkpoint files that are never torn: written beside their target, synced, then renamed."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from rlkit.errors import ConfigError, RLKitError


class CheckpointWriteError(RLKitError, OSError):
    """A checkpoint could not be written (disk full, permissions); the previous ones are intact."""

    def __init__(self, path: Path, error: OSError) -> None:
        try:
            others = sorted((p for p in path.parent.glob("*.ckpt") if p != path), key=lambda p: p.stat().st_mtime)
        except OSError:
            others = []
        if path.exists():
            kept = f"{path} still holds the previous checkpoint"
        elif others:
            kept = f"the last good checkpoint is {others[-1]}"
        else:
            kept = "no checkpoint had been written yet"
        super().__init__(
            f"could not write the checkpoint {path} ({error.strerror or error}); nothing was lost: {kept}. "
            "Free space or fix the directory, then resume with --ckpt_path=last"
        )


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint IO with an atomic write for local paths.

    Lightning's own save goes through an fsspec transaction whose temporary file is made in the
    system temp directory; when that is another filesystem the final move is a copy, and a kill
    during it leaves a torn ``last.ckpt``. Here the temporary file sits in the target directory, is
    ``fsync``-ed, and replaces the target with ``os.replace`` (atomic on POSIX): a reader sees the old
    checkpoint or the new one, never a partial file. Remote paths (``s3://`` and the like) use
    Lightning's implementation.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if "://" in str(path):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options for local paths")
        path = Path(path)
        partial = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            descriptor, partial = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
            with os.fdopen(descriptor, "wb") as file:
                torch.save(checkpoint, file)
                file.flush()
                os.fsync(file.fileno())
            os.replace(partial, path)
        except BaseException as error:
            if partial is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(partial)
            if isinstance(error, OSError):
                raise CheckpointWriteError(path, error) from error
            raise

    def load_checkpoint(self, path, *args, **kwargs) -> dict[str, Any]:
        if "://" not in str(path) and (Path(path) / "meta.pt").is_file():
            raise ConfigError(
                f"{path} is a sharded checkpoint (a folder of one shard per rank, written by FSDP2), which this "
                "strategy cannot read: resume it with --config configs/trainer/fsdp.yaml on 2 or more ranks (any "
                "number: the shards are redistributed), or start a one-process run from the run's HF export "
                "(--model.policy.checkpoint=<run>/hf_export)"
            )
        return super().load_checkpoint(path, *args, **kwargs)
