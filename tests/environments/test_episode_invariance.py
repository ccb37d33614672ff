"""Episodes keep the training invariances of single turns: micro-batches (and packing) change memory, not the
maths, and a run stopped at a checkpoint and resumed plays the same episodes and ends on the same weights.

The runs are the embedded task with a plain-text two-turn environment that rewards each right turn
(``turn_engine.Retry``) and the per-turn estimator, so every row has environment tokens (mask holes) and
per-turn token rewards; the comparisons are spine.helpers' (float64, SGD without clipping, SAME_MATHS of the
update; bitwise weights after a resume).
"""

import json

import torch
from safetensors.torch import load_file
from spine.helpers import EPISODES, assert_same_update
from spine.test_fit import _fit_state, _recording, _resume_runs

from rlkit.embedded.cache import embedded_checkpoint
from rlkit.spine.loop import UpdateLoop


def test_micro_batches_change_memory_not_maths_for_episodes(tmp_path, monkeypatch):
    """16 episodes in one forward, in micro-batches of 3 rows, in token-budget micro-batches, and packed:
    the same update after 2 rollouts (float64, SGD without clipping: a wrong normaliser, a turn's advantage
    on another turn's tokens or an environment token in the loss would move it)."""
    whole, cli = _fit_state(tmp_path, monkeypatch, "whole", *EPISODES)
    assert float(cli.trainer.callback_metrics["episode/length_environment"]) > 0
    assert float(cli.trainer.callback_metrics["advantage/std"]) > 0
    initial = {f"model.{k}": v for k, v in load_file(embedded_checkpoint() / "model.safetensors").items()}
    splits = {
        "rows": ["--model.loop.micro_batch_size=3"],
        "tokens": ["--model.loop.micro_batch_tokens=40"],
        "packed": ["--model.loop.pack_sequences=true", "--model.loop.micro_batch_tokens=80"],
    }
    for name, split in splits.items():
        sizes = []
        with monkeypatch.context() as patch:
            patch.setattr(UpdateLoop, "micro_batches", _recording(UpdateLoop.micro_batches, sizes))
            micro, _ = _fit_state(tmp_path, monkeypatch, name, *EPISODES, *split)
        assert len(sizes) > 2 and max(sizes) < 16, f"{name}: {sizes} is not several micro-batches per step"
        assert_same_update(whole, micro, initial)


def test_exact_resume_of_an_episode_run(tmp_path):
    """4 rollouts straight == 2, a checkpoint, a new process and 2 more: bitwise the same weights, and the
    resumed half samples the same episodes (the sample tables of rollouts 2 and 3 equal, text for text)."""
    straight, resumed = _resume_runs(tmp_path, *EPISODES, "--model.samples_every=1")
    initial = load_file(embedded_checkpoint() / "model.safetensors")
    assert any(not torch.equal(straight[k], initial[k]) for k in straight if k in initial), "training changed nothing"
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), f"{name} differs after resume"

    def samples(run: str) -> list[dict]:  # the resumed run writes a second version folder
        paths = sorted((tmp_path / run).rglob("samples.jsonl"))
        lines = [line for path in paths for line in path.read_text().splitlines()]
        return [row for row in map(json.loads, lines) if row["table"] == "samples"]

    late = lambda rows: [r for r in rows if r["rollout"] >= 2]  # noqa: E731
    assert late(samples("straight")) and late(samples("straight")) == late(samples("split"))
    assert all("⟦" in row["completion"] for row in samples("straight")), "the environment's turns are marked"
