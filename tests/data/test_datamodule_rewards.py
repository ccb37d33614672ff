"""The data module's reward settings: error policy, workers, and the reward/errors count in each rollout."""

import pytest
from fragile_reward import Fragile
from scripted_engine import ScriptedEngine

from rlkit.embedded.arithmetic import Arithmetic
from rlkit.rollouts.datamodule import RolloutDataModule
from rlkit.rollouts.source import EngineRequest
from rlkit.embedded.model import build_tokenizer
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
    data.attach(EngineRequest("unused", tokenizer))
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
