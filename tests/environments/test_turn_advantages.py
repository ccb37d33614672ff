"""Per-turn rewards travel in the Rollout (each on its turn's last model token) and reach the advantage
estimators; TurnDiscountedReturn and MultiTurnOptimalTokenBaseline train an episode run by class_path."""

import math
import re

import pytest
import torch
from spine.helpers import short_args
from test_rollouts import Sums
from turn_engine import RecordingEngine, Retry

from rlkit.algorithms.shaping import advantage_inputs
from rlkit.components import GroupMean, TurnDiscountedReturn
from rlkit.components.advantage import AdvantageInputs
from rlkit.engines.base import request_seed
from rlkit.rewards import ExactAnswer
from rlkit.rollouts.datamodule import RolloutDataModule
from rlkit.rollouts.source import EngineRequest
from rlkit.spine.metrics import StepMetrics


@pytest.fixture(scope="module")
def retried(chat_tokenizer):
    """Two prompts x two episodes of Retry(turn_reward=0.5): sample 1 answers 0 in its first turn, every
    other turn is right; the final turn is scored by ExactAnswer (1)."""
    wrong = set()

    def script(ids, seed):
        a, b = re.findall(r"What is (\d+)\+(\d+)\?", chat_tokenizer.decode(ids))[0]
        return "0" if seed in wrong else str(int(a) + int(b))

    data = RolloutDataModule(
        Sums(), RecordingEngine(chat_tokenizer, script), [ExactAnswer()], prompts_per_step=2, samples_per_prompt=2,
        environment=Retry(max_turns=2, turn_reward=0.5),
    )  # fmt: skip
    wrong.update(request_seed(s, 0, 1) for s in data.schedule.sample_seeds(0, [0, 1]))
    data.attach(EngineRequest("unused", chat_tokenizer))
    return data.next_rollout()


def test_turn_rewards_sit_on_each_turns_last_model_token(retried):
    """Sample 0: turn rewards 0.5, 0.5 and the outcome 1 (score 2); sample 1: 0, 0.5 and 1 (score 1.5). Each
    turn reward is on its turn's last model token, the outcome on the episode's last; rows sum to the score."""
    rollout = retried
    assert rollout.scores.tolist() == [2.0, 1.5, 2.0, 1.5]
    torch.testing.assert_close(rollout.token_rewards.sum(-1), rollout.scores, rtol=0, atol=0)
    mask = rollout.completion_mask.bool()  # [N, T]
    turn_ids = rollout.turn_ids  # [N, T]
    assert torch.equal(turn_ids >= 0, mask) and set(turn_ids[mask].tolist()) == {0, 1}
    for row in range(len(rollout)):
        last = [int((turn_ids[row] == k).nonzero().max()) for k in (0, 1)]  # each turn's last model token
        first_turn = 0.5 if row % 2 == 0 else 0.0
        assert rollout.token_rewards[row, last].tolist() == [first_turn, 1.5]
        assert rollout.token_rewards[row].count_nonzero() == (2 if first_turn else 1)


def test_advantage_inputs_carry_the_turns(retried):
    """advantage_inputs hands the estimators the per-turn token rewards and turn ids; an outcome estimator
    still sees each episode's score (their sum) and gives what it gave on the scores alone."""
    rollout, old = retried, torch.zeros_like(retried.engine_logprobs)
    inputs = advantage_inputs(TurnDiscountedReturn(), rollout, StepMetrics(), old_logprobs=old)
    assert torch.equal(inputs.token_rewards, rollout.token_rewards) and torch.equal(inputs.turn_ids, rollout.turn_ids)
    outcome = AdvantageInputs.from_scores(rollout.scores, rollout.completion_mask, rollout.group_ids)
    torch.testing.assert_close(GroupMean()(inputs)[0], GroupMean()(outcome)[0], rtol=0, atol=1e-7)
    # per turn (gamma 1): turn 0 returns 2 and 1.5 (mean 1.75: A = +-0.25), turn 1 returns 1.5 and 1.5 (A = 0)
    advantages, _ = TurnDiscountedReturn()(inputs)
    for row in range(len(rollout)):
        sign = 1 if row % 2 == 0 else -1
        assert set(advantages[row][rollout.turn_ids[row] == 0].tolist()) == {sign * 0.25}
        assert set(advantages[row][rollout.turn_ids[row] == 1].tolist()) == {0.0}


@pytest.mark.parametrize(
    "advantage",
    ["TurnDiscountedReturn --model.advantage.init_args.gamma=0.9", "MultiTurnOptimalTokenBaseline"],
)
def test_a_per_turn_estimator_trains_an_episode_run(advantage, tmp_path, monkeypatch):
    """``--model.advantage=...`` by class_path on the embedded task with a two-turn environment that rewards
    each right turn: one rollout trains (finite loss, advantages that vary)."""
    from rlkit.cli import build_cli

    monkeypatch.chdir(tmp_path)
    name, *settings = advantage.split()
    args = short_args(
        tmp_path, "drgrpo", "--trainer.max_steps=1", "--data.environment=turn_engine.Retry",
        "--data.environment.init_args.turn_reward=0.5", f"--model.advantage={name}", *settings,
    )[1:]  # fmt: skip
    cli = build_cli(args, run=False)
    cli.trainer.fit(cli.model, cli.datamodule)
    metrics = cli.trainer.callback_metrics
    assert type(cli.model.advantage).__name__ == name
    assert math.isfinite(float(metrics["loss/policy"])) and float(metrics["episode/turns"]) == 2.0
    assert float(metrics["advantage/std"]) > 0, "the per-turn rewards gave no signal"
