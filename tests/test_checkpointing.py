"""Checkpoints are replaced atomically: a failure mid-write leaves the previous checkpoint intact."""

from __future__ import annotations

import pytest
import torch

import rlkit.checkpointing
from rlkit.checkpointing import AtomicCheckpointIO


def test_save_replaces_the_file_and_leaves_no_partial(tmp_path):
    io = AtomicCheckpointIO()
    target = tmp_path / "deep" / "last.ckpt"
    io.save_checkpoint({"step": torch.tensor(1)}, target)
    io.save_checkpoint({"step": torch.tensor(2)}, target)
    assert torch.load(target, weights_only=True)["step"].item() == 2
    assert [p.name for p in target.parent.iterdir()] == ["last.ckpt"]


def test_a_failed_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    io = AtomicCheckpointIO()
    target = tmp_path / "last.ckpt"
    io.save_checkpoint({"step": torch.tensor(1)}, target)

    def torn_save(obj, file):
        file.write(b"half a checkpoint")
        raise KeyboardInterrupt  # e.g. Ctrl-C in the middle of the write

    monkeypatch.setattr(rlkit.checkpointing.torch, "save", torn_save)
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint({"step": torch.tensor(2)}, target)
    monkeypatch.undo()
    assert torch.load(target, weights_only=True)["step"].item() == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_the_cli_uses_it(tmp_path, monkeypatch):
    from spine.helpers import EXPERIMENTS

    from rlkit.cli import build_cli

    monkeypatch.chdir(tmp_path)
    cli = build_cli([f"--config={EXPERIMENTS / 'drgrpo.yaml'}"], run=False)
    assert isinstance(cli.trainer.strategy.checkpoint_io, AtomicCheckpointIO)
