"""Held-out validation with a multi-turn environment: one greedy episode per prompt in the training
environment, scored on its last model turn, ``val/episode/*`` logged beside ``val/reward``."""

import dataclasses

import pytest
from test_rollouts import Sums, solver
from turn_engine import RecordingEngine, add

from rlkit.environments import ToolEnvironment
from rlkit.rewards import ExactAnswer
from rlkit.rollouts.datamodule import RolloutDataModule
from rlkit.rollouts.source import EngineRequest
from rlkit.spine.evaluation import HeldOutEvaluation


def held_out(tokenizer, script, environment):
    engine = RecordingEngine(tokenizer, script)
    data = RolloutDataModule(
        Sums(),
        engine,
        [ExactAnswer()],
        prompts_per_step=2,
        chat_template=True,
        val_prompts=Sums(),
        val_batch_size=4,
        environment=environment,
    )
    data.attach(EngineRequest("unused", tokenizer))
    return data, engine


@pytest.mark.parametrize("max_turns", [3, 1])
def test_validation_plays_greedy_episodes_and_logs_their_counts(chat_tokenizer, max_turns):
    """The solver calls ``add`` and answers with the tool's result: with 3 turns every held-out episode is
    solved in 2 turns; with 1 turn the answer is the tool call itself (made, never read) and scores 0."""
    data, engine = held_out(chat_tokenizer, solver(chat_tokenizer), ToolEnvironment([add], max_turns=max_turns))
    [indices] = data.held_out.batches(0, 1)
    batch = data.evaluate(indices)
    solved = max_turns > 1
    assert batch.scores.tolist() == [float(solved)] * 4
    assert batch.episode["turns"].tolist() == [2.0 if solved else 1.0] * 4
    assert batch.episode["tool_calls"].tolist() == [1.0] * 4
    assert batch.episode["tool_errors"].tolist() == [0.0] * 4
    assert engine.greedy and all(engine.greedy)  # every model turn decoded greedily
    assert all("<tool_response>" in text for text in batch.texts) == solved  # the TEXT tab shows the episode
    assert all("⟦" in text and "<tool_response>" in text.split("⟦")[1] for text in batch.texts) == solved  # marked
    callback = HeldOutEvaluation()
    callback._update(batch)
    values = callback._compute()
    assert values["val/reward"] == float(solved)
    assert values["val/episode/turns"] == (2.0 if solved else 1.0) and values["val/episode/tool_errors"] == 0.0
    by_turns = {name: v for name, v in values.items() if name.startswith("val/episode/reward_by_turns/")}
    assert by_turns == ({"val/episode/reward_by_turns/2": 1.0} if solved else {"val/episode/reward_by_turns/1": 0.0})


def test_tool_errors_in_validation_are_counted(chat_tokenizer):
    """A malformed call is answered by an error observation in validation as in training: one per turn."""
    script = lambda ids, seed: "<tool_call>\n{not json}\n</tool_call>"  # noqa: E731
    data, _ = held_out(chat_tokenizer, script, ToolEnvironment([add], max_turns=2))
    batch = data.evaluate([0, 1])
    assert batch.episode["tool_errors"].tolist() == [2.0, 2.0] and batch.scores.tolist() == [0.0, 0.0]


class PaidToolEnvironment(ToolEnvironment):
    """ToolEnvironment paying 0.25 for every turn it answers."""

    def step(self, state, text):
        observation = super().step(state, text)
        return observation if observation.done else dataclasses.replace(observation, reward=0.25)


def test_with_per_turn_rewards_the_outcome_is_logged_apart(chat_tokenizer):
    """The solved episode's tool turn is paid 0.25: ``val/reward`` adds it, ``val/accuracy`` is the answer's
    score alone (logged with a multi-turn environment even with one reward function)."""
    data, _ = held_out(chat_tokenizer, solver(chat_tokenizer), PaidToolEnvironment([add], max_turns=3))
    [indices] = data.held_out.batches(0, 1)
    callback = HeldOutEvaluation()
    callback._update(data.evaluate(indices))
    values = callback._compute()
    assert values["val/reward"] == 1.25 and values["val/accuracy"] == 1.0


def test_held_out_prompts_are_offered_the_tools_training_prompts_are(chat_tokenizer):
    """A held-out episode starts from the prompt rendered with the environment's tools, token for token the
    training encoding of the same question (it was rendered without them, so the model never saw ``add``)."""
    data, engine = held_out(chat_tokenizer, solver(chat_tokenizer), ToolEnvironment([add], max_turns=3))
    [indices] = data.held_out.batches(0, 1)
    data.evaluate(indices)
    first_turns = [context for context, _, _ in engine.calls[: len(indices)]]
    training = [data._encode(i)[1] for i in indices]  # val_prompts are the training prompts here
    assert first_turns == training and '"name": "add"' in chat_tokenizer.decode(first_turns[0])
