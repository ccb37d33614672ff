"""The issue-8 axes inside the real training step: micro-batching changes memory, not the update.

Each configuration trains 2 rollouts twice, in one forward per mini-batch and in micro-batches of 3
rows (uneven), with SGD and no gradient clipping (a wrong normaliser would show), and must reach the
same weights. The engine samples in bfloat16 where a rollout correction is on, so the trainer's fp32
log-probs differ from the engine's and the correction really acts (asserted from its metrics).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from rlkit.algorithms.shaping import advantage_inputs
from rlkit.cli import build_cli
from rlkit.components import GroupMean
from rlkit.data.batch import Rollout
from rlkit.embedded.cache import embedded_checkpoint
from rlkit.errors import ConfigError
from rlkit.spine.metrics import StepMetrics
from spine.helpers import FLOAT64, assert_same_update, short_args

SGD = [
    "--model.optim.optimizer=torch.optim.SGD",
    "--model.optim.optimizer.init_args.lr=0.1",
    "--model.optim.max_grad_norm=null",
]
BF16_ENGINE = ["--data.engine.init_args.dtype=bfloat16"]

CONFIGS = {
    # covariance selection over the whole step: first step from the old log-probs, later ones by an extra pass
    "clip_cov": (
        ["--model.clip=ClipCov", "--model.clip.init_args.select_fraction=0.2", "--model.clip.init_args.cov_lower=0.0"],
        "clip/selected",
    ),
    "clip_cov_two_epochs": (
        [
            "--model.clip=ClipCov",
            "--model.clip.init_args.select_fraction=0.2",
            "--model.clip.init_args.cov_lower=0.0",
            "--model.loop.ppo_epochs=2",
        ],
        "clip/selected",
    ),
    "kl_cov_two_minibatches": (
        ["--model.clip=KLCov", "--model.clip.init_args.select_fraction=0.2", "--model.loop.minibatches=2"],
        "clip/selected",
    ),
    "truncated_is": (
        [
            *BF16_ENGINE,
            "--model.rollout_correction=TruncatedIS",
            "--model.rollout_correction.init_args.threshold=1.002",
        ],
        "rollout_correction/truncated_fraction",
    ),
    "masked_is_sequence": (
        [
            *BF16_ENGINE,
            "--model.rollout_correction=MaskedIS",
            "--model.rollout_correction.init_args.level=sequence",
            "--model.rollout_correction.init_args.lower=0.97",
            "--model.rollout_correction.init_args.upper=1.03",
        ],
        "rollout_correction/masked_fraction",
    ),
    "bypass_reinforce": (
        [
            *BF16_ENGINE,
            "--model.ratio=LogProb",
            "--model.clip=NoClip",
            "--model.rollout_correction=TruncatedIS",
            "--model.rollout_correction.init_args.threshold=1.002",
            "--model.rollout_correction.init_args.bypass=true",
            "--model.loop.ppo_epochs=2",
        ],
        "rollout_correction/truncated_fraction",
    ),
    "optimal_token_baseline": (["--model.advantage=OptimalTokenBaseline"], None),
    "gdpo": (["--model.advantage=GDPO"], None),
}


def _fit(tmp_path, monkeypatch, name: str, *extra: str):
    workdir = tmp_path / name
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    args = short_args(workdir, "drgrpo", "--trainer.max_steps=2", *FLOAT64, *SGD, *extra)[1:]
    cli = build_cli(args, run=False)
    cli.trainer.fit(cli.model, cli.datamodule)
    metrics = {k: float(v) for k, v in cli.trainer.callback_metrics.items()}
    return {k: v.clone() for k, v in cli.model.policy.state_dict().items()}, metrics, cli


@pytest.mark.parametrize("config", list(CONFIGS))
def test_micro_batches_change_memory_not_maths(config, tmp_path, monkeypatch):
    extra, acting_metric = CONFIGS[config]
    steps = 2 * (2 if "--model.loop.ppo_epochs=2" in extra or "--model.loop.minibatches=2" in extra else 1)
    extra = [*extra, f"--trainer.max_steps={steps}"]
    whole, metrics, _ = _fit(tmp_path, monkeypatch, "whole", *extra)
    micro, _, _ = _fit(tmp_path, monkeypatch, "micro", *extra, "--model.loop.micro_batch_size=3")
    if acting_metric is not None:
        assert metrics[acting_metric] > 0, f"{acting_metric} is 0: the configuration did not exercise the axis"
    initial = load_file(embedded_checkpoint() / "model.safetensors")
    assert_same_update(whole, micro, {f"model.{k}": v for k, v in initial.items()})


def test_bypass_mode_skips_the_trainer_pass(tmp_path, monkeypatch):
    """Bypass: the engine's log-probs are the old ones, so there is no no-grad pass (no policy/entropy
    or mismatch curves) and, on-policy, the weights compare the current policy with the engine."""
    _, metrics, _ = _fit(
        tmp_path,
        monkeypatch,
        "bypass",
        *BF16_ENGINE,
        "--model.rollout_correction=NoCorrection",
        "--model.rollout_correction.init_args.bypass=true",
    )
    assert "policy/entropy" not in metrics and "mismatch/kl" not in metrics
    assert "loss/policy" in metrics


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--model.rollout_correction=TruncatedIS", "--data.engine.init_args.temperature=0.7"], "temperature"),
        (["--model.advantage=OptimalTokenBaseline", "--model.advantage.init_args.use_is_weights=true"], "weights"),
        (
            [
                "--model.advantage=OptimalTokenBaseline",
                "--model.rollout_correction=NoCorrection",
                "--model.rollout_correction.init_args.bypass=true",
            ],
            "bypass",
        ),
    ],
    ids=["correction-needs-temperature-1", "otb-is-weights-need-a-correction", "otb-needs-the-trainer-pass"],
)
def test_misconfigurations_are_config_errors(extra, words, tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=words):
        _fit(tmp_path, monkeypatch, "bad", *extra)


def test_a_dropped_completion_still_counts_in_its_group_baseline():
    """A correction that drops a whole completion removes it from the loss, not from its group's baseline:
    the outcome reward stays on the completion's last token (verl scores before it masks). Group
    rewards [1, 0, 0, 1] with the last row dropped: GroupMean gives [0.5, -0.5, -0.5, (0)], not the
    [2/3, -1/3, -1/3] a reward of 0 for the dropped row would give."""
    mask = torch.ones(4, 2)
    rollout = Rollout(
        input_ids=torch.zeros(4, 3, dtype=torch.long),
        attention_mask=torch.ones(4, 3),
        completion_mask=mask,
        group_ids=torch.zeros(4, dtype=torch.long),
        scores=torch.tensor([1.0, 0.0, 0.0, 1.0]),
        engine_logprobs=torch.zeros(4, 2),
        truncated=torch.zeros(4, dtype=torch.bool),
    )
    kept = mask.clone()
    kept[3] = 0.0
    inputs = advantage_inputs(GroupMean(), rollout, StepMetrics(), old_logprobs=rollout.engine_logprobs, mask=kept)
    advantages = GroupMean()(inputs)[0]
    torch.testing.assert_close(advantages[:, 0], torch.tensor([0.5, -0.5, -0.5, 0.0]))
    assert not advantages[3].any()
