"""A test-only callback: every rollout the trainer trains on, appended to a JSON-lines file as it starts."""

from __future__ import annotations

import json
import os

import lightning.pytorch as pl


class TrainedLog(pl.Callback):
    """Appends ``{"step", "iteration", "version", "prompts"}`` per training batch to ``path`` (synced, so a
    kill -9 right after loses nothing written)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        row = {
            "step": trainer.global_step,
            "iteration": batch.iteration,
            "version": batch.weights_version,
            "prompts": sorted(set(batch.prompt_texts)),
        }
        with open(self.path, "a") as file:
            file.write(json.dumps(row) + "\n")
            file.flush()
            os.fsync(file.fileno())
