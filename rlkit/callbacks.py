"""Callbacks shipped with rlkit."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import lightning.pytorch as pl

from rlkit.algorithms.policy import full_state_dict


class ExportHF(pl.Callback):
    """At the end of ``fit``, save the policy as a Hugging Face checkpoint directory.

    ``transformers`` and vLLM load the result like any checkpoint (``from_pretrained(directory)``).
    A module with a critic (the actor-critic family) also gets ``<directory>/critic``: a separate critic's
    base model (``AutoModel.from_pretrained``) with ``value_head.safetensors``, or a shared-backbone
    critic's ``value_head.safetensors`` alone. The directory is written to a temporary sibling first and
    renamed, so a crash never leaves a half-written export.

    Args:
        dirpath: where to write; default ``<log dir>/hf_export``.
    """

    def __init__(self, dirpath: str | None = None) -> None:
        self.dirpath = dirpath

    def target(self, trainer: pl.Trainer) -> Path:
        if self.dirpath is not None:
            return Path(self.dirpath)
        return Path(trainer.log_dir or trainer.default_root_dir) / "hf_export"

    def on_fit_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        policy = getattr(module, "policy", None)
        if policy is None:
            return
        state = policy.full_state_dict(trainer)  # collective under FSDP: every rank takes part
        critic = getattr(module, "critic", None)
        critic_state = full_state_dict(critic, trainer) if critic is not None else None
        if not trainer.is_global_zero:
            return
        target = self.target(trainer)
        partial = target.with_name(target.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        policy.model.save_pretrained(partial, state_dict=state, safe_serialization=True)
        policy.tokenizer.save_pretrained(partial)
        if critic is not None:
            critic.save(partial / "critic", critic_state, policy.tokenizer)
        if target.exists():
            shutil.rmtree(target)
        os.replace(partial, target)
