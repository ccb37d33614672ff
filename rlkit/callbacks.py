"""Callbacks shipped with rlkit."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import lightning.pytorch as pl

from rlkit.spine.family import Family
from rlkit.spine.policy import full_state_dict


class ExportHF(pl.Callback):
    """At the end of ``fit``, save the policy as a Hugging Face checkpoint directory.

    ``transformers`` and vLLM load the result like any checkpoint (``from_pretrained(directory)``).
    Each of the family's other trained models (:meth:`~rlkit.spine.family.Family.exported_models`) goes to
    ``<directory>/<name>``: the actor-critic's ``critic`` (a separate critic's base model,
    ``AutoModel.from_pretrained``, with ``value_head.safetensors``, or a shared-backbone critic's
    ``value_head.safetensors`` alone). The directory is written to a temporary sibling first and
    renamed, so a crash never leaves a half-written export.

    Args:
        dirpath: where to write; default ``<log dir>/hf_export``.
    """

    def __init__(self, dirpath: str | None = None) -> None:
        self.dirpath = dirpath

    def target(self, trainer: pl.Trainer) -> Path:
        if self.dirpath is not None:
            return Path(self.dirpath)
        # the logger's log_dir: trainer.log_dir is a collective, and only rank 0 exports
        log_dir = getattr(trainer.logger, "log_dir", None)
        return Path(log_dir or trainer.default_root_dir) / "hf_export"

    def on_fit_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if not isinstance(module, Family) or module.policy is None:
            return
        policy = module.policy
        state = policy.full_state_dict(trainer)  # collective under FSDP: every rank takes part
        others = {name: (model, full_state_dict(model, trainer)) for name, model in module.exported_models().items()}
        if not trainer.is_global_zero:
            return
        target = self.target(trainer)
        partial = target.with_name(target.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        policy.model.save_pretrained(partial, state_dict=state, safe_serialization=True)
        policy.tokenizer.save_pretrained(partial)
        for name, (model, model_state) in others.items():
            model.save(partial / name, model_state, policy.tokenizer)
        if target.exists():
            shutil.rmtree(target)
        os.replace(partial, target)


class RunFiles(pl.Callback):
    """Where a run writes: checked before the first step, cleaned of stale partial files, and told at the end.

    At the start of ``fit`` every checkpoint directory must be writable (a read-only or missing-permission
    directory would otherwise fail after the first step's work, with a long traceback), and hidden
    ``.*.partial`` files that a killed checkpoint write left behind are removed (with a real model each is
    gigabytes). The CLI calls :meth:`print_summary` after ``fit``.
    """

    def on_fit_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        from rlkit.errors import ConfigError

        for callback in trainer.checkpoint_callbacks:
            directory = Path(callback.dirpath) if callback.dirpath else None
            if directory is None or "://" in str(directory):
                continue
            try:
                directory.mkdir(parents=True, exist_ok=True)
                with tempfile.NamedTemporaryFile(dir=directory, prefix=".rlkit-write-check-"):
                    pass
            except OSError as error:
                raise ConfigError(
                    f"the checkpoint directory {directory} is not writable ({error.strerror or error}): fix its "
                    "permissions, or write the run elsewhere with --trainer.logger.init_args.save_dir=DIR"
                ) from error
            if trainer.is_global_zero:
                for stale in directory.glob(".*.partial"):
                    stale.unlink(missing_ok=True)

    def print_summary(self, trainer: pl.Trainer) -> None:
        if not trainer.is_global_zero:
            return
        lines = ["rlkit: run finished."]
        log_dir = getattr(trainer.logger, "log_dir", None)  # the logger's, not trainer.log_dir (a collective)
        if log_dir:
            name = getattr(trainer.logger, "name", None) or ""
            root = Path(log_dir).parents[len(Path(name).parts)]
            lines.append(f"  TensorBoard logs: {log_dir}   (tensorboard --logdir {root})")
        for callback in trainer.checkpoint_callbacks:
            if callback.dirpath:
                last = f" (last: {Path(callback.last_model_path).name})" if callback.last_model_path else ""
                lines.append(f"  checkpoints:      {callback.dirpath}{last}")
        for callback in trainer.callbacks:
            if isinstance(callback, ExportHF):
                lines.append(f"  HF export:        {callback.target(trainer)}")
        print("\n".join(lines), file=sys.stderr)
