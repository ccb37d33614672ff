"""Episodes: the row is what the model saw (no re-tokenization drift), the mask is 0 exactly on the
environment's tokens, seeds depend on (prompt seed, sample, turn), and the limits end episodes as stated."""

import copy
import re
from pathlib import Path

import pytest
from turn_engine import CALL, RecordingEngine, add

from rlkit.data.prompts import Prompt, encode_prompt
from rlkit.embedded.model import build_tokenizer
from rlkit.engines.base import request_seed
from rlkit.environments import Environment, EpisodeRunner, Observation, ToolEnvironment, TurnEncoder
from rlkit.errors import ConfigError

QUESTION = Prompt("What is 2+3?", ground_truth="5")
ANSWER = "The answer is 5."


def tool_then_answer(tokenizer):
    """Call ``add`` until a tool response is in the context, then answer."""
    return lambda ids, seed: ANSWER if "<tool_response>" in tokenizer.decode(ids) else CALL


def play(tokenizer, script, n=1, seeds=(7,), prompts=(QUESTION,), **limits):
    env = ToolEnvironment([add], **{"max_turns": 3, **limits})
    engine = RecordingEngine(tokenizer, script)
    ids = [encode_prompt(p, tokenizer, True, tools=env.tool_schemas()) for p in prompts]
    return EpisodeRunner(env, engine, tokenizer).run(list(prompts), ids, n, list(seeds)), ids, engine


def test_the_row_is_the_chat_template_render_of_the_whole_conversation(chat_tokenizer):
    [[episode]], [prompt_ids], _ = play(chat_tokenizer, tool_then_answer(chat_tokenizer))
    conversation = [
        {"role": "user", "content": QUESTION.prompt},
        {"role": "assistant", "content": CALL},
        {"role": "tool", "name": "add", "content": "5"},
        {"role": "assistant", "content": ANSWER},
    ]
    schemas = ToolEnvironment([add]).tool_schemas()
    rendered = chat_tokenizer.apply_chat_template(conversation, tools=schemas, tokenize=False)
    assert chat_tokenizer.decode(prompt_ids + episode.token_ids) + "\n" == rendered  # the template ends with "\n"
    environment = [t for t, m in zip(episode.token_ids, episode.model_mask, strict=True) if not m]
    assert chat_tokenizer.decode(environment) == (
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert (episode.turns, episode.tool_calls, episode.tool_errors, episode.finished) == (2, 1, 0, True)
    assert episode.answer == ANSWER and episode.loss_mask() == [float(m) for m in episode.model_mask]
    first, second = episode.turn_spans
    assert episode.model_mask == [
        first[0] <= i < first[1] or second[0] <= i < second[1] for i in range(len(episode.model_mask))
    ]
    assert episode.logprobs == [-0.5 if m else 0.0 for m in episode.model_mask]


def test_no_retokenization_drift(chat_tokenizer):
    """The model's tokens are kept as sampled, even where they are not how the tokenizer would encode the text."""
    spelled = [t for c in "Answer: 5" for t in chat_tokenizer(c, add_special_tokens=False)["input_ids"]]
    assert len(spelled) == len("Answer: 5")  # one token per character

    class Spelling(RecordingEngine):
        def generate(self, prompts, n, seed, greedy=False):
            out = super().generate(prompts, n, seed, greedy)
            for row in out:
                if row[0].token_ids[:-1] != chat_tokenizer(CALL, add_special_tokens=False)["input_ids"]:
                    row[0].token_ids = [*spelled, chat_tokenizer.eos_token_id]
                    row[0].logprobs = [-0.5] * len(row[0].token_ids)
                    self.calls[-1] = (*self.calls[-1][:2], row[0].token_ids)
            return out

    assert chat_tokenizer("Answer: 5", add_special_tokens=False)["input_ids"] != spelled  # re-encoding would differ
    env = ToolEnvironment([add], max_turns=3)
    engine = Spelling(chat_tokenizer, tool_then_answer(chat_tokenizer))
    ids = encode_prompt(QUESTION, chat_tokenizer, True, tools=env.tool_schemas())
    [[episode]] = EpisodeRunner(env, engine, chat_tokenizer).run([QUESTION], [ids], 1, [7])
    # each turn was generated from exactly the row so far, and its tokens are in the row as produced
    assert len(engine.calls) == episode.turns == 2
    for (context, _, produced), (start, end) in zip(engine.calls, episode.turn_spans, strict=True):
        assert context == ids + episode.token_ids[:start]
        assert episode.token_ids[start:end] == produced
    assert episode.token_ids[episode.turn_spans[-1][0] :] == [*spelled, chat_tokenizer.eos_token_id]
    assert episode.answer == "Answer: 5"


def test_each_turn_is_seeded_by_prompt_seed_sample_and_turn(chat_tokenizer):
    other = Prompt("What is 4+4?", ground_truth="8")
    script = tool_then_answer(chat_tokenizer)
    both, _, engine = play(chat_tokenizer, script, n=2, seeds=(11, 7), prompts=(other, QUESTION))
    seeds = sorted(s for _, s, _ in engine.calls)
    assert seeds == sorted(request_seed(p, t, j) for p in (11, 7) for j in (0, 1) for t in (0, 1))
    alone, _, _ = play(chat_tokenizer, script, n=2, seeds=(7,), prompts=(QUESTION,))
    assert both[1] == alone[0]  # an episode does not depend on the episodes sharing its engine calls


def test_max_turns_ends_a_calling_episode_truncated(chat_tokenizer):
    [[episode]], _, engine = play(chat_tokenizer, lambda ids, seed: CALL, max_turns=2)
    assert (episode.turns, episode.tool_calls, episode.finished) == (2, 2, False)
    assert episode.model_mask[-1]  # the last tool result is not appended: nobody would read it
    assert len(engine.calls) == 2


def test_the_token_budget_cuts_a_turn_or_stops_before_an_observation(chat_tokenizer):
    [[full]], _, _ = play(chat_tokenizer, tool_then_answer(chat_tokenizer))
    call_length = full.turn_spans[0][1]
    [[stopped]], _, _ = play(chat_tokenizer, tool_then_answer(chat_tokenizer), max_episode_tokens=call_length + 3)
    assert stopped.budget_stops == 1 and not stopped.finished and stopped.token_ids == full.token_ids[:call_length]
    [[cut]], _, _ = play(chat_tokenizer, tool_then_answer(chat_tokenizer), max_episode_tokens=5)
    assert cut.token_ids == full.token_ids[:5] and not cut.finished and cut.turns == 1 and cut.tool_calls == 0


def test_a_template_without_tools_is_one_clear_error(chat_tokenizer):
    plain = copy.deepcopy(chat_tokenizer)
    plain.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    with pytest.raises(ConfigError, match=r"does not render tools= \(none, or it ignores them\)"):
        EpisodeRunner(ToolEnvironment([add]), RecordingEngine(plain, None), plain)
    with pytest.raises(ConfigError, match="offers tools, which only the chat template can show"):
        encode_prompt(QUESTION, chat_tokenizer, False, tools=ToolEnvironment([add]).tool_schemas())


def times(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first number.
        b: the second number.
    """
    return a * b


def test_a_prompt_with_its_own_tools_is_offered_them_in_place_of_the_environments(chat_tokenizer):
    """``Prompt.tools`` (a verifiers row's ``info["tool_defs"]``): the prompt shows its own tools, not the
    environment's; the episode's row is still the template's render of the whole conversation with them; and a
    template that cannot render them is refused when such a prompt is played, even by an environment without
    tools of its own."""
    own = ToolEnvironment([times]).tool_schemas()
    prompt = Prompt(QUESTION.prompt, ground_truth="5", tools=own)
    shown = chat_tokenizer.decode(
        encode_prompt(prompt, chat_tokenizer, True, tools=ToolEnvironment([add]).tool_schemas())
    )
    assert '"name": "times"' in shown and '"name": "add"' not in shown
    [[episode]], [prompt_ids], _ = play(chat_tokenizer, tool_then_answer(chat_tokenizer), prompts=(prompt,))
    conversation = [
        {"role": "user", "content": QUESTION.prompt},
        {"role": "assistant", "content": CALL},
        {"role": "tool", "name": "add", "content": "5"},
        {"role": "assistant", "content": ANSWER},
    ]
    rendered = chat_tokenizer.apply_chat_template(conversation, tools=own, tokenize=False)
    assert chat_tokenizer.decode(prompt_ids + episode.token_ids) + "\n" == rendered
    plain = copy.deepcopy(chat_tokenizer)
    plain.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    runner = EpisodeRunner(Countdown(), RecordingEngine(plain, lambda ids, seed: "go"), plain)  # no tools: fine
    with pytest.raises(ConfigError, match=r"does not render tools="):
        runner.run([prompt], [[1, 2]], 1, [0])


class Countdown(Environment):
    """A plain-text environment: says how many turns are left, with a reward per turn."""

    max_turns = 3

    def reset(self, prompt):
        return {"left": 2}

    def step(self, state, text):
        state["left"] -= 1
        return Observation(text=f" left {state['left']};", reward=0.5, done=state["left"] == 0)


def test_text_observations_without_a_chat_template():
    tokenizer = build_tokenizer()
    engine = RecordingEngine(tokenizer, lambda ids, seed: "go")
    prompt = Prompt("count:")
    ids = encode_prompt(prompt, tokenizer)
    [[episode]] = EpisodeRunner(Countdown(), engine, tokenizer).run([prompt], [ids], 1, [0])
    assert tokenizer.decode(episode.token_ids) == "go<eos> left 1;go<eos>"
    assert episode.turns == 2 and episode.finished and episode.environment_reward == 1.0
    with pytest.raises(ConfigError, match="the tokenizer has no chat template"):
        TurnEncoder(tokenizer).encode(Observation(messages=[{"role": "user", "content": "x"}]), [2])


def test_the_readme_example_environment_plays(chat_tokenizer):
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## Multi-turn episodes and tools (foundation)")[1].split("\n## ")[0]
    namespace = {}
    exec(re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1), namespace)  # noqa: S102 - our own README
    guesses = ["5", "9", "7"]
    engine = RecordingEngine(chat_tokenizer, lambda ids, seed: guesses[chat_tokenizer.decode(ids).count("is wrong")])
    prompt = Prompt([{"role": "user", "content": "Guess my number."}], ground_truth="7")
    ids = encode_prompt(prompt, chat_tokenizer)
    [[episode]] = EpisodeRunner(namespace["GuessTheNumber"](max_turns=4), engine, chat_tokenizer).run(
        [prompt], [ids], 1, [0]
    )
    assert (episode.turns, episode.finished, episode.answer) == (3, True, "7")
    assert episode.environment_reward == pytest.approx(1 / 3)
    environment = chat_tokenizer.decode(
        [t for t, m in zip(episode.token_ids, episode.model_mask, strict=True) if not m]
    )
    assert "5 is wrong: go higher." in environment and "9 is wrong: go lower." in environment


def test_a_real_engine_samples_each_turn_from_exactly_the_row(tmp_path):
    """HFEngine on a tiny random model: the trainer's log-probs of the finished row, one forward over prompt and
    completion, equal the engine's on every model token, so each turn was sampled from exactly the row's
    tokens before it (a context that differed would move them)."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlkit.embedded.model import build_tiny_checkpoint
    from rlkit.engines.hf import HFEngine

    checkpoint = str(build_tiny_checkpoint(tmp_path, seed=3))
    engine = HFEngine(max_new_tokens=24)
    engine.start(checkpoint)
    tokenizer, prompt = build_tokenizer(), Prompt("count:")
    ids = encode_prompt(prompt, tokenizer)
    [episodes] = EpisodeRunner(Countdown(), engine, tokenizer).run([prompt], [ids], 8, [0])
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    multi_turn = [e for e in episodes if not all(e.model_mask)]
    assert multi_turn  # some episodes got an observation and a second turn
    for episode in episodes:
        row = torch.tensor([ids + episode.token_ids])  # [1, P + T]
        with torch.no_grad():
            logits = model(row).logits[0, len(ids) - 1 : -1]  # [T, V] the positions predicting the completion
        trainer = logits.log_softmax(-1).gather(1, row[0, len(ids) :, None]).squeeze(1)  # [T]
        model_tokens = torch.tensor(episode.model_mask)  # [T]
        engine_logprobs = torch.tensor(episode.logprobs)  # [T]
        assert torch.allclose(trainer[model_tokens], engine_logprobs[model_tokens], atol=1e-4)
