"""The data module's reward settings: error policy, workers, the reward/errors count in each rollout, a
reward that never applies, ground truths checked when the data is loaded, and settings named by their key."""

import json
import logging

import pytest
from fragile_reward import Fragile
from scripted_engine import ScriptedEngine
from spine.helpers import EXPERIMENTS

from rlkit.cli import main
from rlkit.data.prompts import PromptFile
from rlkit.embedded.arithmetic import Arithmetic
from rlkit.embedded.model import build_tokenizer
from rlkit.errors import ConfigError
from rlkit.rewards import ExactAnswer, MathAnswer, RewardError, TRLReward
from rlkit.rollouts.datamodule import RolloutDataModule
from rlkit.rollouts.source import EngineRequest


def make(on_error, rewards=None, prompts=None, **kwargs):
    tokenizer = build_tokenizer()
    engine = ScriptedEngine(tokenizer, lambda call, ids, j, seed: "x" if j == 0 else "7")
    data = RolloutDataModule(
        prompts=prompts or Arithmetic(num_prompts=64),
        engine=engine,
        rewards=rewards or [Fragile(), ExactAnswer()],
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
    assert rollout.stats["reward/errors"] == 4.0 and rollout.stats["reward/rejected"] == 0.0
    assert rollout.reward_terms["fragile"].tolist() == [0.0, 1.0, 1.0] * 4
    assert data.next_rollout().stats["reward/errors"] == 4.0  # per rollout, not cumulative
    assert data.constant_metrics() == frozenset()  # so it is logged, at 0 too: the evidence nothing failed


def test_errors_stop_the_run_by_default():
    assert make("raise").constant_metrics() == {"reward/errors"}  # a failed call stops the run: never logged
    with pytest.raises(RewardError, match=r"'fragile' \(Fragile\) raised ValueError: cannot read it on row 0"):
        make("raise").next_rollout()


def test_reward_workers():
    data = make("zero", reward_workers=1)
    try:
        assert data.next_rollout().stats["reward/errors"] == 4.0
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


def test_a_reward_that_never_applies_is_said_logged_and_stops_the_run(caplog):
    # TRL's None is "does not apply"; a function that returns it for everything trains the run on reward 0
    data = make("raise", rewards=[TRLReward("fragile_reward.trl_never")], reward_none_patience=3)
    with caplog.at_level("WARNING", logger="rlkit.rewards.coverage"):
        first, second = data.next_rollout(), data.next_rollout()
    assert first.stats["reward/trl_never/applied_fraction"] == 0.0 and first.scores.tolist() == [0.0] * 12
    assert second.stats["reward/trl_never/applied_fraction"] == 0.0
    (warning,) = caplog.messages  # once, not every rollout
    assert warning.startswith("reward function 'trl_never' (TRLReward) applied to 0% of this rollout's completions")
    assert "reward/trl_never/applied_fraction" in warning
    with pytest.raises(RewardError) as stop:
        data.next_rollout()
    assert str(stop.value).startswith(
        "reward function 'trl_never' (TRLReward) returned None (does not apply) for every completion of the last "
        "3 rollouts"
    )
    assert "data.reward_none_patience" in str(stop.value)


def test_a_reward_that_applies_to_some_completions_goes_on():
    data = make("zero", reward_none_patience=1)  # Fragile raises on "x": scored 0 (an error), not None
    for _ in range(3):
        stats = data.next_rollout().stats
    assert stats["reward/fragile/applied_fraction"] == 1.0 and stats["reward/accuracy/applied_fraction"] == 1.0


def test_a_ground_truth_a_reward_cannot_read_is_an_error_when_the_data_is_loaded(tmp_path):
    rows = [{"prompt": f"q{i}", "reward_model": {"ground_truth": str(i)}} for i in range(8)]
    rows[2]["reward_model"]["ground_truth"] = "9^{9^{9^{9}}}"  # a tower: sympy would compute it for hours
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(ConfigError) as error:
        make("raise", rewards=[MathAnswer()], prompts=PromptFile(str(path)))
    assert str(error.value).startswith(
        f"data.prompts: {path}, line 3: reward function 'math' (MathAnswer): MathAnswer cannot read the ground "
        "truth '9^{9^{9^{9}}}': a power of about 10^8 digits, more than 1000"
    )
    # scored without that check, the row is an error naming its ground truth, not the completion
    with pytest.raises(ValueError, match=r"cannot read the ground truth '9\^\{9\^\{9\^\{9\}\}\}'"):
        MathAnswer()("\\boxed{1}", PromptFile(str(path))[2])


def test_a_trl_function_is_called_once_per_rollout_with_all_its_completions():
    import fragile_reward

    fragile_reward.trl_batch_sizes.batches.clear()
    data = make("raise", rewards=[TRLReward("fragile_reward.trl_batch_sizes")])
    first, second = data.next_rollout(), data.next_rollout()
    # 4 prompts x 3 samples: one call of 12 completions per rollout, not 12 calls of one
    assert fragile_reward.trl_batch_sizes.batches == [12, 12]
    assert first.scores.tolist() == [1.0] * 12 and second.scores.tolist() == [1.0] * 12
