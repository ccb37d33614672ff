"""DAPO's data side: the group filter (dynamic sampling) with its generation rounds and their bound,
exact resume with it on, and overlong filtering (truncated completions out of the loss)."""

import math

import pytest
import torch
from scripted_engine import ScriptedEngine

from rlkit.data.prompts import Prompt
from rlkit.embedded.arithmetic import Arithmetic
from rlkit.embedded.model import build_tokenizer
from rlkit.engines.base import Generation
from rlkit.errors import ConfigError
from rlkit.rewards import ExactAnswer, OverlongPenalty
from rlkit.rollouts.buffer import DropConstantGroups, GenerationRoundsExceeded, Group, ReplayBuffer
from rlkit.rollouts.datamodule import RolloutDataModule
from rlkit.rollouts.schedule import stream_seed as _stream_seed
from rlkit.rollouts.source import EngineRequest

TOKENIZER = build_tokenizer()


def group(scores, terms=None, lengths=None):
    lengths = lengths or [1] * len(scores)
    return Group(
        prompt=Prompt("p"),
        prompt_ids=[1],
        generations=[Generation([5] * n, [0.0] * n, True) for n in lengths],
        scores=list(scores),
        terms=terms or {},
        texts=[""] * len(scores),
    )


# --- the filter and the buffer -----------------------------------------------------------------------


def test_drop_constant_groups():
    keep = DropConstantGroups()
    assert keep(group([1.0, 0.0, 1.0])) and not keep(group([1.0, 1.0, 1.0])) and not keep(group([0.0, 0.0]))
    # by a reward function's own values: equal accuracy with different length penalties is still constant
    by_accuracy = DropConstantGroups(metric="accuracy")
    mixed_total = group([1.0, 0.5], terms={"accuracy": [1.0, 1.0], "overlong": [0.0, -0.5]})
    assert keep(mixed_total) and not by_accuracy(mixed_total)
    assert DropConstantGroups(metric="length")(group([1.0, 1.0], lengths=[3, 4]))
    assert not DropConstantGroups(tolerance=0.1)(group([1.0, 0.95]))
    # NaN means "does not apply": a group with one applicable value is constant
    assert not DropConstantGroups(metric="py")(group([0.0, 0.0], terms={"py": [math.nan, 1.0]}))
    with pytest.raises(KeyError, match="no metric 'acc': use 'score', 'length' or one of the reward names"):
        DropConstantGroups(metric="acc")(group([1.0, 0.0], terms={"accuracy": [1.0, 0.0]}))
    with pytest.raises(ValueError, match="tolerance must be >= 0"):
        DropConstantGroups(tolerance=-1.0)


def test_buffer_keeps_what_the_filter_accepts():
    buffer = ReplayBuffer(capacity=8, group_filter=DropConstantGroups())
    assert buffer.put([group([1.0, 1.0]), group([0.0, 1.0]), group([0.0, 0.0])]) == 1
    assert len(buffer) == 1 and buffer.take(5)[0].scores == [0.0, 1.0]
    assert ReplayBuffer(capacity=8).put([group([1.0, 1.0])]) == 1  # no filter keeps all


# --- rounds in the data module ----------------------------------------------------------------------


def correct(ids):
    a, b = TOKENIZER.decode(ids, skip_special_tokens=True).rstrip("=").split("+")
    return str(int(a) + int(b))


def make(answers, B=4, G=4, max_new_tokens=8, **kwargs):
    engine = ScriptedEngine(TOKENIZER, answers, max_new_tokens=max_new_tokens)
    data = RolloutDataModule(
        prompts=Arithmetic(num_prompts=64),
        engine=engine,
        rewards=kwargs.pop("rewards", [ExactAnswer()]),
        prompts_per_step=B,
        samples_per_prompt=G,
        seed=kwargs.pop("seed", 0),
        **kwargs,
    )
    data.attach(EngineRequest("unused", TOKENIZER))
    return data, engine


def test_dynamic_sampling_generates_more_rounds_until_the_step_is_full():
    # round 0: every answer right (constant groups); round 1: half right, half wrong (mixed)
    seen = []

    def answers(call, ids, j, seed):
        seen.append((call, seed))
        return correct(ids) if call == 0 or j % 2 else "x"

    data, engine = make(answers, group_filter=DropConstantGroups(metric="accuracy"))
    rollout = data.next_rollout()
    assert engine.calls == 2 and engine.rollouts_ended == 1  # a sleeping engine sleeps once, after the last round
    assert rollout.stats == {
        "reward/errors": 0.0,
        "reward/rejected": 0.0,
        "reward/accuracy/applied_fraction": 1.0,
        "buffer/rounds": 2.0,
        "buffer/groups_kept": 4.0,
        "buffer/groups_dropped": 4.0,
    }
    assert len(rollout) == 16 and rollout.group_ids.unique().numel() == 4
    assert rollout.reward_terms["accuracy"].tolist() == [0.0, 1.0] * 8  # only round 1's mixed groups
    # sample seeds: round 0 as without dynamic sampling, (seed, rollout, position, round) after
    round0 = sorted({s for call, s in seen if call == 0})
    round1 = sorted({s for call, s in seen if call == 1})
    assert round0 == sorted(_stream_seed(data.seed, 0, p) for p in range(4))
    assert round1 == sorted(_stream_seed(data.seed, 0, p, 1) for p in range(4))
    assert data.iteration == 1 and len(data.buffer) == 0


def test_surplus_groups_of_the_last_round_are_discarded():
    # round 0 keeps 2 of 4 groups (prompts at even positions answer mixed), round 1 keeps 4: 2 are surplus
    state = {"prompt": 0}

    def answers(call, ids, j, seed):
        if j == 0:
            state["prompt"] += 1
        mixed = call == 1 or state["prompt"] % 2
        return "x" if mixed and j == 0 else correct(ids)

    data, _ = make(answers, group_filter=DropConstantGroups())
    rollout = data.next_rollout()
    assert rollout.stats["buffer/rounds"] == 2.0
    assert rollout.stats["buffer/groups_kept"] == 6.0 and rollout.stats["buffer/groups_dropped"] == 2.0
    assert rollout.group_ids.unique().numel() == 4 and len(data.buffer) == 0


def test_dynamic_sampling_stops_at_the_bound_with_a_message():
    always_right = lambda call, ids, j, seed: correct(ids)  # noqa: E731
    data, engine = make(always_right, group_filter=DropConstantGroups(), max_generation_rounds=3)
    with pytest.raises(GenerationRoundsExceeded) as caught:
        data.next_rollout()
    assert engine.calls == 3
    message = str(caught.value)
    assert "after data.max_generation_rounds=3 generation rounds of rollout 0, 0 of the 4 groups" in message
    assert "DropConstantGroups on 'score'" in message and "12 groups were dropped" in message
    assert "raise data.max_generation_rounds or data.samples_per_prompt" in message
    assert "data.group_filter=null" in message


def test_without_a_filter_one_round_and_no_buffer_metrics():
    data, engine = make(lambda call, ids, j, seed: correct(ids))
    rollout = data.next_rollout()
    assert engine.calls == 1 and len(rollout) == 16
    assert rollout.stats == {"reward/errors": 0.0, "reward/rejected": 0.0, "reward/accuracy/applied_fraction": 1.0}


def test_group_filter_settings_are_checked():
    with pytest.raises(ConfigError, match=r"metric 'acc', which is neither 'score', 'length' nor .* \['accuracy'\]"):
        make(lambda *a: "1", group_filter=DropConstantGroups(metric="acc"))
    with pytest.raises(ConfigError, match="max_generation_rounds must be >= 1"):
        make(lambda *a: "1", max_generation_rounds=0)
    with pytest.raises(ConfigError, match="buffer_capacity=4 cannot hold one step's 7 groups"):
        make(lambda *a: "1", group_filter=DropConstantGroups(), buffer_capacity=4)


# --- overlong filtering -----------------------------------------------------------------------------


@pytest.mark.parametrize("mask_truncated", [False, True])
def test_truncated_completions_can_be_masked_out_of_the_loss(mask_truncated):
    # sample 0 rambles past max_new_tokens=4 (truncated); the others answer and stop
    data, _ = make(
        lambda call, ids, j, seed: "123456" if j == 0 else correct(ids),
        rewards=[ExactAnswer(), OverlongPenalty(max_length=4, buffer=1)],
        mask_truncated=mask_truncated,
        max_new_tokens=4,
    )
    rollout = data.next_rollout()
    truncated = rollout.truncated  # [N]
    assert truncated.tolist() == [True, False, False, False] * 4
    T = rollout.completion_mask.shape[1]
    sampled = rollout.attention_mask[:, -T:].float()  # [N, T]
    if mask_truncated:
        assert rollout.completion_mask[truncated].sum() == 0  # out of the loss
        assert torch.equal(rollout.completion_mask[~truncated], sampled[~truncated])
    else:
        assert torch.equal(rollout.completion_mask, sampled)
    assert sampled[truncated].sum(-1).tolist() == [4.0] * 4  # still attended to, as sampled
    # and still rewarded: the soft penalty sees the length
    assert rollout.reward_terms["overlong"][truncated].tolist() == [-1.0] * 4


# --- exact resume with dynamic sampling on (the real command, as tests/spine/test_fit.py) -------------


def test_exact_resume_with_dynamic_sampling(tmp_path):
    """4 rollouts straight == 2, checkpoint, a new process, 2 more: bitwise, with extra generation rounds."""
    from safetensors.torch import load_file
    from spine.helpers import ROOT, event_files, run_rlkit, short_args
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    every_step = ROOT / "tests" / "spine" / "checkpoint_every_step.yaml"
    common = [
        f"--config={every_step}",
        "--model.optim.lr_scheduler.init_args.total_steps=4",  # the schedule of the whole run also in its first half
        "--data.group_filter=DropConstantGroups",
        "--data.max_generation_rounds=50",
    ]
    straight, split = tmp_path / "straight", tmp_path / "split"
    straight.mkdir(), split.mkdir()
    for args, cwd in [
        (short_args(straight, "drgrpo", *common), straight),
        (short_args(split, "drgrpo", *common, "--trainer.max_steps=2"), split),
        (short_args(split, "drgrpo", *common, "--ckpt_path=ckpts/last.ckpt"), split),
    ]:
        result = run_rlkit(args, cwd=cwd)
        assert result.returncode == 0, result.stderr[-3000:]
    expected = load_file(straight / "export" / "model.safetensors")
    resumed = load_file(split / "export" / "model.safetensors")
    for name in expected:
        assert torch.equal(expected[name], resumed[name]), f"{name} differs after resume"
    # and the filter was at work: some rollout needed more than one generation round
    [events] = event_files(straight / "runs")
    accumulator = EventAccumulator(str(events.parent))
    accumulator.Reload()
    rounds = [e.value for e in accumulator.Scalars("buffer/rounds")]
    dropped = [e.value for e in accumulator.Scalars("buffer/groups_dropped")]
    assert len(rounds) == 4 and max(rounds) > 1 and sum(dropped) > 0, (rounds, dropped)
