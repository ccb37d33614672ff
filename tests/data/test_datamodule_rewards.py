"""The data module's reward settings: error policy, workers, and the reward/errors count in each rollout."""

import logging

import pytest
from fragile_reward import Fragile
from scripted_engine import ScriptedEngine
from spine.helpers import EXPERIMENTS

from rlkit.cli import main
from rlkit.data.arithmetic import Arithmetic
from rlkit.data.datamodule import RolloutDataModule
from rlkit.models import build_tokenizer
from rlkit.rewards import ExactAnswer, RewardError


def make(on_error, **kwargs):
    tokenizer = build_tokenizer()
    engine = ScriptedEngine(tokenizer, lambda call, ids, j, seed: "x" if j == 0 else "7")
    data = RolloutDataModule(
        prompts=Arithmetic(num_prompts=64),
        engine=engine,
        rewards=[Fragile(), ExactAnswer()],
        prompts_per_step=4,
        samples_per_prompt=3,
        reward_on_error=on_error,
        **kwargs,
    )
    data.attach("unused", tokenizer)
    return data


def test_errors_scored_zero_are_counted_in_the_rollout():
    data = make("zero")
    rollout = data.next_rollout()
    # one "x" completion per prompt: 4 calls raised and scored 0, the rest scored 1
    assert rollout.stats == {"reward/errors": 4.0}
    assert rollout.reward_terms["fragile"].tolist() == [0.0, 1.0, 1.0] * 4
    assert data.next_rollout().stats == {"reward/errors": 4.0}  # per rollout, not cumulative


def test_errors_stop_the_run_by_default():
    with pytest.raises(RewardError, match=r"'fragile' \(Fragile\) raised ValueError: cannot read it on row 0"):
        make("raise").next_rollout()


def test_reward_workers():
    data = make("zero", reward_workers=1)
    try:
        assert data.next_rollout().stats == {"reward/errors": 4.0}
    finally:
        data.teardown("fit")
    assert data.scorer._pool._workers == []  # teardown stopped the worker


def test_a_bad_reward_setting_names_its_config_key(capsys, monkeypatch):
    monkeypatch.setattr(logging, "raiseExceptions", False)  # see tests/spine/test_cli_errors.py
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", f"--config={EXPERIMENTS / 'drgrpo.yaml'}", "--data.reward_workers=-1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and "Traceback" not in "".join(err)
    assert err[-1] == (
        "rlkit: error: invalid configuration: RewardScorer: workers must be >= 0 (0 scores in this process), "
        "got -1 (data.reward_workers)."
    )
