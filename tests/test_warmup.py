"""The supervised warm-up: batches, the teacher-forced greedy check, stopping by held-out accuracy."""

import json

import pytest
import torch

from rlkit.data.prompts import Prompt
from rlkit.embedded.cache import embedded_checkpoint
from rlkit.embedded.chain import AdditionChain
from rlkit.embedded.model import build_tiny_checkpoint, build_tokenizer
from rlkit.embedded.warmup import greedy_exact_match, supervised_batch, warm_up
from rlkit.engines.hf import HFEngine
from rlkit.models import load_policy, load_tokenizer
from rlkit.rewards import FinalAnswer

HELD_OUT = AdditionChain(num_prompts=512, split="test", unique=True)  # the experiments' val_prompts


def greedy_completions(checkpoint, prompts: list[Prompt]) -> list[str]:
    tokenizer = load_tokenizer(checkpoint)
    engine = HFEngine(max_new_tokens=32)
    engine.start(str(checkpoint))
    generations = engine.generate([tokenizer(p.prompt)["input_ids"] for p in prompts], 1, seed=0, greedy=True)
    return [tokenizer.decode(g[0].token_ids, skip_special_tokens=True) for g in generations]


def held_out_accuracy(checkpoint) -> float:
    """What a run's ``val/reward`` starts at: greedy decoding, FinalAnswer, 512 held-out questions."""
    prompts = [HELD_OUT[i] for i in range(len(HELD_OUT))]
    texts = greedy_completions(checkpoint, prompts)
    return sum(FinalAnswer()(t, p) for t, p in zip(texts, prompts, strict=True)) / len(prompts)


def test_supervised_batch_learns_the_worked_solution_and_masks_the_prompt():
    tokenizer = build_tokenizer()
    rows = [
        Prompt(prompt="3+5=", ground_truth="8"),  # no worked solution: the ground truth is the target
        Prompt(prompt="1+2+3=", ground_truth="6", meta={"solution": "1+2=3,3+3=6"}),
    ]
    input_ids, labels = supervised_batch(rows, tokenizer)
    ids = tokenizer.convert_tokens_to_ids
    bos, eos, pad = tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
    expected_ids = torch.tensor(
        [
            [bos, *ids(list("3+5=8")), eos] + [pad] * 12,
            [bos, *ids(list("1+2+3=1+2=3,3+3=6")), eos],
        ]
    )
    expected_labels = torch.tensor(
        [
            [-100] * 5 + [ids("8"), eos] + [-100] * 12,
            [-100] * 7 + [*ids(list("1+2=3,3+3=6")), eos],
        ]
    )
    assert torch.equal(input_ids, expected_ids)
    assert torch.equal(labels, expected_labels)
    with pytest.raises(ValueError, match="neither a ground truth nor a worked solution"):
        supervised_batch([Prompt(prompt="?")], tokenizer)


def test_teacher_forced_check_is_greedy_decoding():
    """greedy_exact_match's one forward pass agrees, question by question, with decoding greedily."""
    checkpoint = embedded_checkpoint()
    prompts = [HELD_OUT[i] for i in range(len(HELD_OUT))]
    input_ids, labels = supervised_batch(prompts, load_tokenizer(checkpoint))
    matches = greedy_exact_match(load_policy(checkpoint), input_ids, labels).tolist()
    texts = greedy_completions(checkpoint, prompts)
    decoded = [text == p.meta["solution"] for text, p in zip(texts, prompts, strict=True)]
    assert 0 < sum(matches) < len(matches)  # the comparison means something: some hits, some misses
    assert matches == decoded


def test_warm_up_teaches_part_of_the_task():
    """Random weights answer nothing; the default warm-up stops inside the target band, leaving RL room.

    It stops at the first check (every 10 steps) where greedy decoding writes the worked solution of at
    least 20% of the 512 held-out questions (the default target); the phase transition can carry it some
    way past that within 10 steps. The final-result accuracy RL is scored by is higher (a wrong step can
    still end in the right sum). Measured for warm-up seeds 0-2: see rlkit_embedded.json in the cache and the README."""
    cold = embedded_checkpoint(max_sft_steps=0)
    warm = embedded_checkpoint()  # the session's fresh cache (tests/conftest.py)
    assert held_out_accuracy(cold) == 0.0
    record = json.loads((warm / "rlkit_embedded.json").read_text())
    target, reached = record["settings"]["target_accuracy"], record["warm_up"]
    assert 0.2 <= target <= reached["accuracy"] <= 0.5 and reached["steps"] < 3000
    assert reached["checks"][-2][1] < target  # it stopped at the first check that reached the target
    assert 0.2 <= held_out_accuracy(warm) <= 0.6  # what RL starts from (val/reward at step 0)


def test_warm_up_stops_at_the_target_or_warns_at_max_steps(tmp_path):
    checkpoint = build_tiny_checkpoint(tmp_path)
    tokenizer = load_tokenizer(checkpoint)
    train = AdditionChain(num_prompts=64)
    held_out = AdditionChain(num_prompts=16, split="test", unique=True)
    settings = dict(max_steps=6, check_every=2, batch_size=4, lr=1e-3, seed=0)
    reached = warm_up(load_policy(checkpoint), tokenizer, train, held_out, target_accuracy=0.0, **settings)
    assert reached["steps"] == 2 and reached["checks"] == [[2, 0.0]]  # the first check already meets 0.0
    with pytest.warns(UserWarning, match="short of its target 1.0"):
        short = warm_up(load_policy(checkpoint), tokenizer, train, held_out, target_accuracy=1.0, **settings)
    assert short["steps"] == 6 and [step for step, _ in short["checks"]] == [2, 4, 6]


def test_the_embedded_checkpoint_is_built_on_the_cpu_under_any_default_device(tmp_path):
    """On a GPU, Lightning's ``configure_model`` (where the policy loads, and so where a new machine builds the
    embedded checkpoint) runs under a CUDA default device; the warm-up's CPU generator then failed ("Expected a
    'cuda' device type for generator", found on an H200). A meta default device stands in for it here: the build
    under it gives the very weights of a plain build."""
    from safetensors.torch import load_file

    settings = dict(max_sft_steps=2, check_every=2, sft_batch_size=4)
    with torch.device("meta"):
        under = embedded_checkpoint(tmp_path / "under", **settings)
    plain = embedded_checkpoint(tmp_path / "plain", **settings)
    assert under.name == plain.name  # the same key
    weights, expected = load_file(under / "model.safetensors"), load_file(plain / "model.safetensors")
    assert weights.keys() == expected.keys()
    assert all(torch.equal(weights[name], expected[name]) for name in expected)
    assert json.loads((under / "rlkit_embedded.json").read_text())["warm_up"]["steps"] == 2
