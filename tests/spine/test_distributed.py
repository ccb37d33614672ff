"""Data parallelism does not change the maths: 2 CPU ranks (DDP, gloo) end where 1 process ends.

Each rank generates every second prompt of the step, seeded by the prompt's position in the step, so
the two ranks together sample exactly what one process samples; the aggregation divides by the
step's totals over both ranks and multiplies by the world size (DDP averages gradients).

The comparison uses SGD without gradient clipping: Adam and clipping are both invariant to the
gradient's scale (a wrong normaliser would go unseen), and Adam turns float noise in near-zero
gradients into lr-sized steps. With SGD a normaliser off
by the world size doubles or halves the update; float reduction order stays ~1e-7 of it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlkit.models import embedded_checkpoint
from spine.helpers import run_rlkit, short_args
from spine.test_fit import _scalars

EVERY_STEP = Path(__file__).with_name("checkpoint_every_step.yaml")


# a rollout correction that drops tokens: the step's totals come from the kept tokens of both ranks
MASKED_IS = [
    "--data.engine.init_args.dtype=bfloat16",  # the engine's log-probs then differ from the trainer's fp32 ones
    "--model.rollout_correction=MaskedIS",
    "--model.rollout_correction.init_args.lower=0.995",
    "--model.rollout_correction.init_args.upper=1.005",
]
# rows sorted by length into token-budget micro-batches, each cut to its longest row; the ranks' plans
# differ in length and the shorter ones are split to match (the same number of backward passes)
TOKEN_BUDGET = ["--model.micro_batch_tokens=20"]


@pytest.mark.parametrize(
    "experiment, settings",
    [("drgrpo", []), ("grpo", []), ("cispo", MASKED_IS), ("drgrpo", TOKEN_BUDGET)],
    ids=["drgrpo", "grpo", "cispo-masked-is", "drgrpo-token-budget"],
)
def test_two_ranks_equal_one_process(experiment, settings, tmp_path):
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not built in")
    runs, logged = {}, {}
    for name, extra in {
        "single": [],
        "ddp": ["--trainer.devices=2", "--trainer.strategy=ddp", "--trainer.accelerator=cpu"],
    }.items():
        workdir = tmp_path / name
        workdir.mkdir()
        sgd = ["--model.optimizer=torch.optim.SGD", "--model.optimizer.init_args.lr=0.1", "--model.max_grad_norm=null"]
        sgd.append(
            "--model.entropy_coef=0.01"
        )  # an entropy term: loss/entropy is ~1, not ~0 like on-policy loss/policy
        args = short_args(
            workdir, experiment, f"--config={EVERY_STEP}", "--trainer.max_steps=3", *sgd, *settings, *extra
        )
        result = run_rlkit(args, cwd=workdir)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name] = load_file(workdir / "export" / "model.safetensors")
        logged[name] = _scalars(workdir / "runs")
    initial = load_file(embedded_checkpoint() / "model.safetensors")
    moved = max((runs["single"][k] - initial[k]).abs().max().item() for k in initial)
    assert moved > 1e-3, "training must move the weights for the comparison to mean anything"
    for name, tensor in runs["single"].items():
        gap = (runs["ddp"][name] - tensor).abs().max().item()
        assert gap <= 1e-3 * moved, f"{name}: DDP vs one process differ by {gap:.3g} (updates up to {moved:.3g})"
    # the logged step values are the whole step's, not one rank's and not world_size times too large
    tags = ["loss/entropy", "loss/total", "loss/policy", "reward/mean", "policy/entropy"]
    if settings is MASKED_IS:
        assert max(logged["single"]["rollout_correction/masked_fraction"]) > 0, "the correction must drop tokens"
        tags += ["rollout_correction/masked_fraction", "rollout_correction/weight_mean"]
    for tag in tags:
        torch.testing.assert_close(
            torch.tensor(logged["ddp"][tag]),
            torch.tensor(logged["single"][tag]),
            rtol=1e-4,
            atol=1e-6,
            equal_nan=True,
            msg=tag,
        )
