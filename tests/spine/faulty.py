"""Deliberately broken pieces for the bad-input tests (importable as ``spine.faulty``)."""

import os

import torch
from lightning.pytorch import Callback

from rlkit.components.ratio import Ratio
from rlkit.data.prompts import Prompt
from rlkit.engines.hf import HFEngine
from rlkit.rewards.base import RewardFunction


class NaNRatio(Ratio):
    """A ratio that turns the loss into NaN."""

    def __call__(self, log_prob, old_log_prob, mask):
        return torch.exp(log_prob - old_log_prob) * float("nan")


class RaisingReward(RewardFunction):
    """A reward function with a bug."""

    name = "buggy"

    def __call__(self, completion: str, prompt: Prompt) -> float:
        raise KeyError("answer")


class MismatchedEngine(HFEngine):
    """HFEngine whose reported log-probs carry a deterministic offset of up to +-0.008 per (token, position),
    so a rollout correction with a narrow band acts, and acts alike in every process: a bfloat16 engine's
    mismatch depends on how the prompts were batched, which data parallelism changes."""

    def generate(self, prompts, n, seed, greedy=False):
        rows = super().generate(prompts, n, seed, greedy=greedy)
        for row in rows:
            for g in row:
                g.logprobs = [
                    lp + 0.004 * ((tok * 7 + t * 3) % 5 - 2)
                    for t, (tok, lp) in enumerate(zip(g.token_ids, g.logprobs, strict=True))
                ]
        return rows


class SignalAfterStep(Callback):
    """Sends this process ``signum`` at the end of optimizer step ``step``, as a user's ``kill`` would."""

    def __init__(self, step: int = 1, signum: int = 15) -> None:
        self.step, self.signum = step, signum

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), self.signum)


class RecordingEngine(HFEngine):
    """HFEngine that writes its model's weights (as the last push left them) to ``record_dir/engine-<rank>``
    when it closes, so a test can compare every rank's engine with the trained model."""

    def __init__(
        self,
        record_dir: str = "engines",
        max_new_tokens: int = 16,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        dtype: str = "float32",
        device: str = "cpu",
    ) -> None:
        super().__init__(max_new_tokens, temperature, top_p, top_k, dtype, device)
        self.record_dir = record_dir

    def close(self) -> None:
        from pathlib import Path

        from safetensors.torch import save_file

        if self.model is not None:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            state = {k: v.detach().contiguous().clone() for k, v in self.model.state_dict().items()}
            Path(self.record_dir).mkdir(parents=True, exist_ok=True)
            save_file(state, str(Path(self.record_dir) / f"engine-{rank}.safetensors"))
        super().close()
