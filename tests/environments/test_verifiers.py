"""A verifiers environment (its classic ``vf.MultiTurnEnv`` API) played unchanged in rlkit's episodes: its
turns, stop conditions, tools and rubric are its own; the row is the chat template's render of the conversation;
an episode rlkit drops is cancelled; a hang, a rewritten history and a missing package are one clear line each.

The package is optional (``rlkit[verifiers]``); without it only the missing-package test runs."""

import asyncio
import gc
import importlib.util
import re
import sys
import time

import pytest
from turn_engine import RecordingEngine

from rlkit.data.prompts import Prompt, encode_prompt
from rlkit.environments import EpisodeRunner
from rlkit.errors import ConfigError


def _classic_verifiers() -> bool:
    if importlib.util.find_spec("verifiers") is None:
        return False
    import verifiers as vf

    return hasattr(vf, "MultiTurnEnv")


needs_verifiers = pytest.mark.skipif(not _classic_verifiers(), reason="verifiers>=0.3.1,<0.4 is not installed")
MODULE = __name__
CLEANED_UP = []  # the trajectory ids whose rollout ran its cleanup handlers


def test_without_the_package_the_error_says_how_to_install_it(monkeypatch):
    from rlkit.environments import verifiers_env

    verifiers_env._load.cache_clear()
    monkeypatch.setitem(sys.modules, "verifiers", None)  # import verifiers now raises ImportError
    with pytest.raises(ConfigError, match=r"needs the verifiers package: pip install 'rlkit\[verifiers\]'"):
        verifiers_env.VerifiersEnvironment(f"{MODULE}:guessing", max_turns=3)
    verifiers_env._load.cache_clear()


# --- verifiers environments, defined as their authors write them ---------------------------------------------


def guessing(target: int = 7, hang: bool = False, rewrite: bool = False):
    """Higher/lower: the model guesses ``target``; the rubric pays 1 for a win and counts the guesses."""
    import verifiers as vf
    from datasets import Dataset

    class Guess(vf.MultiTurnEnv):
        @vf.cleanup
        async def record(self, state):
            await asyncio.sleep(0)  # a cleanup that awaits (closing a sandbox) needs the loop: a cancelled task has it
            CLEANED_UP.append(state["trajectory_id"])

        async def env_response(self, messages, state, **kwargs):
            if hang:
                await asyncio.sleep(3600)
            guess = re.findall(r"-?\d+", messages[-1].content or "")
            if not guess:
                return [vf.UserMessage(content="Say a number.")]
            if int(guess[-1]) == target:
                state["won"] = True
                state["final_env_response"] = [vf.UserMessage(content="Correct!")]
                return state["final_env_response"]
            return [vf.UserMessage(content="higher" if int(guess[-1]) < target else "lower")]

        async def get_prompt_messages(self, state):
            messages = await super().get_prompt_messages(state)
            return messages[1:] if rewrite and state["trajectory"] else messages

    async def won(state, **kwargs) -> float:
        return float(state.get("won", False))

    rows = [{"question": "Guess my number (1-20).", "answer": str(target)}]
    return Guess(dataset=Dataset.from_list(rows), rubric=vf.Rubric(funcs=[won]), max_turns=4)


def ranked():
    """Higher/lower scored by a group rubric: 1 for a win plus 1 for the group's fewest turns (a group function)."""
    import verifiers as vf

    env = guessing()

    async def fewest(states, **kwargs) -> list[float]:
        turns = [len(state["trajectory"]) for state in states]
        return [float(t == min(turns)) for t in turns]

    env.rubric.add_reward_func(fewest)
    assert isinstance(env.rubric, vf.Rubric) and env.rubric.has_group_rewards
    return env


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first number.
        b: the second number.
    """
    return a + b


def calculator():
    """verifiers' own ``ToolEnv`` with one tool; the rubric pays 1 when the final answer is the sum."""
    import verifiers as vf
    from datasets import Dataset

    async def correct(completion, answer, **kwargs) -> float:
        return float(completion[-1].content.strip() == answer)

    rows = [{"question": "What is 2+3?", "answer": "5"}]
    return vf.ToolEnv(dataset=Dataset.from_list(rows), tools=[add], rubric=vf.Rubric(funcs=[correct]), max_turns=3)


LOOKUP = {
    "name": "lookup",
    "description": "Look a word up.",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]},
}


def own_tools():
    """A single-turn environment whose rows bring their own tools (``info["tool_defs"]``, verifiers' per-row
    tools), one row as a dict, one as JSON text, one without."""
    import json

    import verifiers as vf
    from datasets import Dataset

    async def said(completion, answer, **kwargs) -> float:
        return float(completion[-1].content.strip() == answer)

    define = {**LOOKUP, "name": "define"}
    rows = [
        {"question": "Spell cat.", "answer": "cat", "info": json.dumps({"tool_defs": [LOOKUP]})},
        {"question": "Spell dog.", "answer": "dog", "info": json.dumps({"tool_defs": [LOOKUP, define]})},
        {"question": "Spell emu.", "answer": "emu", "info": json.dumps({})},
    ]
    return vf.SingleTurnEnv(dataset=Dataset.from_list(rows), rubric=vf.Rubric(funcs=[said]))


def bisect(tokenizer):
    """A model that bisects 1..20 from the environment's feedback."""

    def script(ids, seed):
        text = tokenizer.decode(ids)
        low, high = 1, 20
        for guess, answer in re.findall(r"assistant\n(\d+)<\|im_end\|>\n<\|im_start\|>user\n(\w+)", text):
            low, high = (int(guess) + 1, high) if answer == "higher" else (low, int(guess) - 1)
        return str((low + high) // 2)

    return script


def play(tokenizer, script, env, prompts, **engine):
    engine = RecordingEngine(tokenizer, script, **engine)
    ids = [encode_prompt(p, tokenizer, True, tools=env.tool_schemas()) for p in prompts]
    return EpisodeRunner(env, engine, tokenizer).run(list(prompts), ids, 1, [3] * len(prompts)), ids


@needs_verifiers
def test_a_verifiers_environment_plays_its_own_turns_and_rubric(chat_tokenizer):
    from rlkit.environments.verifiers_env import VerifiersEnvironment, VerifiersPrompts

    prompts = VerifiersPrompts(f"{MODULE}:guessing", {"target": 10})
    env = VerifiersEnvironment(f"{MODULE}:guessing", {"target": 10}, max_turns=6)
    assert env.max_turns == 4  # the environment's own bound is the smaller
    [[episode]], [prompt_ids] = play(chat_tokenizer, bisect(chat_tokenizer), env, [prompts[0]])
    # bisecting 1..20 for 10: 10 at once; the rubric's 1 for the win is the last turn's environment reward
    assert (episode.turns, episode.finished, episode.turn_rewards) == (1, True, [1.0])

    env = VerifiersEnvironment(f"{MODULE}:guessing")
    prompts = VerifiersPrompts(f"{MODULE}:guessing")
    assert prompts[0].ground_truth == "7" and prompts[0].meta["example_id"] == 0
    [[episode]], [prompt_ids] = play(chat_tokenizer, bisect(chat_tokenizer), env, [prompts[0]])
    # 1..20 -> 10 (lower) 5 (higher) 7: won on turn 3, paid once, on that turn
    assert (episode.turns, episode.finished, episode.turn_rewards) == (3, True, [None, None, 1.0])
    conversation = [
        *prompts[0].prompt,
        {"role": "assistant", "content": "10"},
        {"role": "user", "content": "lower"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "higher"},
        {"role": "assistant", "content": "7"},
    ]
    rendered = chat_tokenizer.apply_chat_template(conversation, tokenize=False)
    assert chat_tokenizer.decode(prompt_ids + episode.token_ids) + "\n" == rendered  # no re-tokenization drift
    environment = [t for t, m in zip(episode.token_ids, episode.model_mask, strict=True) if not m]
    assert chat_tokenizer.decode(environment).count("<|im_start|>user\n") == 2


@needs_verifiers
def test_a_group_rubric_scores_a_prompts_episodes_together(chat_tokenizer):
    """``Rubric.score_rollout`` refuses group reward functions; the adapter scores the prompt's episodes with
    ``Rubric.score_group`` once all have ended, and each reward lands on its episode's last turn."""
    from rlkit.engines.base import request_seed
    from rlkit.environments.verifiers_env import VerifiersEnvironment, VerifiersPrompts

    env = VerifiersEnvironment(f"{MODULE}:ranked")
    assert env.group_rubric
    bisector = {request_seed(3, turn, 0) for turn in range(4)}  # sample 0 bisects, sample 1 says 3 every turn
    script = bisect(chat_tokenizer)
    engine = RecordingEngine(chat_tokenizer, lambda ids, seed: script(ids, seed) if seed in bisector else "3")
    prompt = VerifiersPrompts(f"{MODULE}:ranked")[0]
    ids = [encode_prompt(prompt, chat_tokenizer, True)]
    [[winner, loser]] = EpisodeRunner(env, engine, chat_tokenizer).run([prompt], ids, 2, [3])
    # the winner: 10 lower, 5 higher, 7 in 3 turns -> won 1 + fewest turns 1; the other runs out of its 4 turns
    assert (winner.turns, winner.turn_rewards) == (3, [None, None, 2.0])
    assert (loser.turns, loser.turn_rewards) == (4, [None, None, None, 0.0])


@needs_verifiers
def test_a_verifiers_tool_environment_runs_the_models_tool_calls(chat_tokenizer):
    from rlkit.environments.verifiers_env import VerifiersEnvironment, VerifiersPrompts

    env = VerifiersEnvironment(f"{MODULE}:calculator")
    [schema] = env.tool_schemas()
    assert schema["function"]["name"] == "add" and set(schema["function"]["parameters"]["properties"]) == {"a", "b"}
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'

    def script(ids, seed):
        text = chat_tokenizer.decode(ids)
        return re.findall(r"<tool_response>\n(\d+)", text)[-1] if "<tool_response>" in text else call

    [[episode]], [prompt_ids] = play(chat_tokenizer, script, env, [VerifiersPrompts(f"{MODULE}:calculator")[0]])
    assert (episode.turns, episode.tool_calls, episode.tool_errors, episode.finished) == (2, 1, 0, True)
    assert episode.turn_rewards == [None, 1.0]  # verifiers ran add(2, 3) and its rubric paid the answer 5
    assert "<tool_response>\n5\n</tool_response>" in chat_tokenizer.decode(episode.token_ids)


@needs_verifiers
def test_a_row_with_its_own_tools_is_offered_them(chat_tokenizer):
    """verifiers offers a row's ``info["tool_defs"]`` in place of the environment's tools; rlkit's prompt of that
    row shows them through the chat template, and the episode plays as verifiers sets it up."""
    from rlkit.environments.verifiers_env import VerifiersEnvironment, VerifiersPrompts

    env, prompts = VerifiersEnvironment(f"{MODULE}:own_tools"), VerifiersPrompts(f"{MODULE}:own_tools")
    assert env.tool_schemas() is None
    names = [[t["function"]["name"] for t in prompts[i].tools or []] for i in range(3)]
    assert names == [["lookup"], ["lookup", "define"], []]
    assert prompts[0].tools[0]["function"]["parameters"] == LOOKUP["parameters"] and prompts[2].tools is None
    [[episode], [_], [_]], ids = play(chat_tokenizer, lambda ids, seed: "cat", env, [prompts[i] for i in range(3)])
    shown = [chat_tokenizer.decode(row) for row in ids]
    assert '"name": "lookup"' in shown[0] and '"name": "define"' not in shown[0] and '"name": "define"' in shown[1]
    assert "<tools>" not in shown[2]
    assert (episode.turns, episode.finished, episode.turn_rewards) == (1, True, [1.0])


@needs_verifiers
def test_an_episode_rlkit_cuts_is_cancelled_in_the_environment(chat_tokenizer):
    from rlkit.environments.verifiers_env import VerifiersEnvironment

    env = VerifiersEnvironment(f"{MODULE}:guessing")
    before = len(CLEANED_UP)
    # every answer is longer than max_new_tokens: the turn is cut, the episode truncated, no rubric reward
    [[episode]], _ = play(chat_tokenizer, lambda ids, seed: "1" * 40, env, [Prompt("Guess.")], max_new_tokens=4)
    assert (episode.turns, episode.finished, episode.turn_rewards) == (1, False, [None])
    gc.collect()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and len(CLEANED_UP) == before:
        time.sleep(0.01)
    # its rollout was cancelled and ended as verifiers ends one (its cleanup handlers ran), not left waiting
    assert len(CLEANED_UP) == before + 1 and not asyncio.all_tasks(env._loop)


@needs_verifiers
def test_a_hang_and_a_rewritten_history_are_one_line_each(chat_tokenizer):
    from rlkit.environments.verifiers_env import VerifiersEnvironment

    hanging = VerifiersEnvironment(f"{MODULE}:guessing", {"hang": True}, turn_timeout_s=0.3)
    start = time.monotonic()
    [[episode]], _ = play(chat_tokenizer, lambda ids, seed: "5", hanging, [Prompt("Guess.")])
    assert time.monotonic() - start < 5
    assert (episode.turns, episode.finished, episode.tool_errors, episode.turn_rewards) == (1, True, 1, [None])

    rewriting = VerifiersEnvironment(f"{MODULE}:guessing", {"rewrite": True})
    with pytest.raises(RuntimeError, match="does not extend the previous one"):
        play(chat_tokenizer, lambda ids, seed: "5", rewriting, [Prompt("Guess.")])
    from rlkit.environments import verifiers_env

    verifiers_env.load(f"{MODULE}:guessing", {"target": 5}).max_turns = -1  # an unbounded environment
    with pytest.raises(ConfigError, match="sets no max_turns: give max_turns"):
        VerifiersEnvironment(f"{MODULE}:guessing", {"target": 5})
    assert VerifiersEnvironment(f"{MODULE}:guessing", {"target": 5}, max_turns=2).max_turns == 2


@needs_verifiers
def test_a_rollout_of_a_verifiers_environment_scores_its_rubric(chat_tokenizer):
    """Through the data module and the CLI: the rubric's reward is the episode's score with ``NoOutcome``."""
    from spine.helpers import EXPERIMENTS

    from rlkit.cli import build_cli
    from rlkit.environments.verifiers_env import VerifiersEnvironment, VerifiersPrompts
    from rlkit.rewards import NoOutcome
    from rlkit.rollouts.datamodule import RolloutDataModule
    from rlkit.rollouts.source import EngineRequest

    guess = {"target": 10}
    # an episode whose first turn is sampled with an odd seed says 10 and wins; the others say 3 every turn

    def script(ids, seed):
        return "10" if seed % 2 and "higher" not in chat_tokenizer.decode(ids) else "3"

    engine = RecordingEngine(chat_tokenizer, script)
    data = RolloutDataModule(VerifiersPrompts(f"{MODULE}:guessing", guess), engine, [NoOutcome()],
                             prompts_per_step=1, samples_per_prompt=4, chat_template=True,
                             environment=VerifiersEnvironment(f"{MODULE}:guessing", guess))  # fmt: skip
    data.attach(EngineRequest("unused", chat_tokenizer))
    rollout = data.next_rollout()
    seeds = [s for _, s, _ in engine.calls[:4]]  # the first turn of each episode
    assert rollout.scores.tolist() == [1.0 if s % 2 else 0.0 for s in seeds] and 0 < sum(s % 2 for s in seeds) < 4
    assert rollout.stats["episode/turns"] == sum(1 if s % 2 else 4 for s in seeds) / 4

    cli = build_cli([
        f"--config={EXPERIMENTS / 'drgrpo.yaml'}", "--trainer.max_steps=1", "--data.chat_template=true",
        "--data.rewards=[NoOutcome]", "--data.environment=VerifiersEnvironment",
        f"--data.environment.init_args.env={MODULE}:guessing", "--data.environment.init_args.max_turns=2",
        "--data.prompts=VerifiersPrompts", f"--data.prompts.init_args.env={MODULE}:guessing",
    ], run=False)  # fmt: skip
    environment = cli.datamodule.environment
    assert isinstance(environment, VerifiersEnvironment) and environment.max_turns == 2
    assert cli.datamodule.prompts[0].ground_truth == "7"
