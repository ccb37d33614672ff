"""The embedded multi-turn task (``rlkit.embedded.turns``), worked by hand: what the environment writes after
each model turn, when an episode ends, the per-turn rewards, and the warm-up transcripts' tokens and labels."""

from __future__ import annotations

import pytest
import torch

from rlkit.data.prompts import Prompt
from rlkit.embedded.model import build_tokenizer
from rlkit.embedded.turns import RevealedChain, RunningSums, transcript_batch
from rlkit.environments.episode import Episode, episode_stats

CHAIN = Prompt(prompt="3+5=", ground_truth="22", meta={"terms": [3, 5, 7, 7]})


def test_the_environment_reveals_each_next_term_after_the_models_number():
    env = RunningSums(max_turns=3)
    state = env.reset(CHAIN)
    first = env.step(state, "8")  # 3+5
    assert (first.text, first.done, first.reward) == (",8+7=", False, None)
    second = env.step(state, "14")  # wrong (8+7=15): echoed as written, the next term follows
    assert (second.text, second.done) == (",14+7=", False)
    assert env.step(state, "21").done  # every term added: the last turn is the answer


def test_per_turn_rewards_pay_correct_intermediate_sums_only():
    env = RunningSums(turn_reward=0.5)
    state = env.reset(CHAIN)
    assert env.step(state, "8").reward == 0.5
    assert env.step(state, "16").reward == 0.0  # 15 is right
    assert env.step(state, "abc").done  # not a number: the episode ends, scored as the answer


def test_prompts_without_terms_are_named():
    with pytest.raises(ValueError, match=r"meta\['terms'\].*data.prompts=rlkit.embedded.RevealedChain"):
        RunningSums().reset(Prompt(prompt="3+5=", ground_truth="8"))


def test_a_revealed_chain_shows_two_terms_and_keeps_the_question():
    row = RevealedChain(num_prompts=64, min_terms=3)[0]
    terms = row.meta["terms"]
    assert len(terms) >= 3 and row.prompt == f"{terms[0]}+{terms[1]}=" and row.ground_truth == str(sum(terms))


def test_transcripts_label_the_models_turns_only():
    tokenizer = build_tokenizer()
    ids, labels = transcript_batch([CHAIN], tokenizer)
    eos = tokenizer.eos_token
    real = ids[0][ids[0] != tokenizer.pad_token_id].tolist()
    prompt = tokenizer.decode(tokenizer("3+5=")["input_ids"])
    assert tokenizer.decode(real) == prompt + f"8{eos},8+7=15{eos},15+7=22{eos}"
    learned = labels[0][labels[0] != -100]
    expected = tokenizer(f"8{eos}15{eos}22{eos}", add_special_tokens=False)["input_ids"]
    assert learned.tolist() == expected
    assert torch.equal(labels[0][labels[0] != -100], ids[0][labels[0] != -100])


def test_a_steps_environment_reward_is_the_mean_of_its_episodes_per_turn_sums():
    paid = Episode([1, 2], [0.0, 0.0], True, turn_rewards=[0.5, 0.0, None])
    unpaid = Episode([1], [0.0], True, turn_rewards=[None])
    assert episode_stats([paid, unpaid])["episode/environment_reward"] == 0.25
