"""How the update loop cuts a rollout into mini-batches and micro-batches (the maths is tested end to end in
test_fit)."""

import inspect

import pytest
import torch

from rlkit.errors import ConfigError
from rlkit.spine import Family, LoopSettings, UpdateLoop
from spine.helpers import random_rollout


def loop(**settings) -> UpdateLoop:
    return UpdateLoop(LoopSettings(**settings))


def plan(update_loop: UpdateLoop, batch) -> list[list[int]]:
    return [b.rows.tolist() for b in update_loop.micro_batches(torch.arange(len(batch)), batch)]


def lengths(batch) -> list[int]:
    return batch.attention_mask.sum(-1).tolist()


@pytest.mark.parametrize("pack", [False, True])
def test_rows_and_tokens_both_limit_a_micro_batch(pack):
    batch = random_rollout(seed=5, N=40, P=6, T=20)
    n = lengths(batch)
    micro = plan(loop(micro_batch_size=3, micro_batch_tokens=60, pack_sequences=pack), batch)
    assert sorted(i for b in micro for i in b) == list(range(40))
    for b in micro:
        cost = sum(n[i] for i in b) if pack else len(b) * max(n[i] for i in b)
        assert len(b) <= 3 and (cost <= 60 or len(b) == 1)
    only_tokens = plan(loop(micro_batch_tokens=60, pack_sequences=pack), batch)
    assert max(map(len, only_tokens)) > 3  # the row limit is what kept them at 3


def test_no_limit_is_one_micro_batch_and_the_default_is_a_token_budget():
    batch = random_rollout(seed=6, N=10)
    assert plan(loop(micro_batch_tokens=None), batch) == [list(range(10))]
    assert plan(loop(micro_batch_tokens=None, micro_batch_size=4), batch) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert LoopSettings().micro_batch_tokens == 1024
    assert inspect.signature(Family).parameters["loop"].default == LoopSettings()


def grouped(seed: int, groups: list[int]):
    """A random rollout whose rows belong to ``groups`` (interleaved, as after a shuffle)."""
    batch = random_rollout(seed=seed, N=len(groups), P=6, T=20)
    batch.group_ids = torch.tensor(groups)
    return batch


@pytest.mark.parametrize("pack", [False, True])
def test_keep_groups_never_cuts_a_group(pack):
    """Mini-batches and micro-batches (under a token and a row limit) hold whole groups, however
    the rows are ordered; a group larger than a limit goes alone."""
    groups = [g for g in range(6) for _ in range(3)]
    batch = grouped(7, groups[::-1][1::2] + groups[::-1][0::2])  # each group's rows scattered
    settings = {"keep_groups": True, "micro_batch_tokens": 40, "micro_batch_size": 4, "pack_sequences": pack}
    for epoch in range(3):
        for rows in loop(minibatches=4, **settings).minibatch_rows(batch, epoch):
            held = batch.group_ids[rows].tolist()
            assert all(held.count(g) == groups.count(g) for g in set(held)), "a mini-batch cut a group"
            for micro in plan(loop(**settings), batch.select(rows)):
                inner = batch.select(rows).group_ids[micro].tolist()
                assert all(inner.count(g) == groups.count(g) for g in set(inner)), "a micro-batch cut a group"
    without = loop(micro_batch_tokens=40, micro_batch_size=2)
    cut = [batch.group_ids[b].tolist() for b in plan(without, batch)]
    assert any(held.count(g) < 3 for held in cut for g in held), "without keep_groups rows are split freely"


def test_keep_groups_needs_a_group_per_minibatch():
    with pytest.raises(ConfigError, match=r"holds 3 groups per rollout, fewer than model.loop.minibatches=4"):
        loop(keep_groups=True, minibatches=4).check_rows(rows_per_rank=24, groups_per_rank=3)
    loop(keep_groups=False, minibatches=4).check_rows(rows_per_rank=24, groups_per_rank=3)


@pytest.mark.parametrize(
    "settings, key",
    [({"ppo_epochs": 0}, "model.loop.ppo_epochs"), ({"micro_batch_tokens": 0}, "model.loop.micro_batch_tokens")],
)
def test_settings_out_of_range_name_their_key(settings, key):
    with pytest.raises(ConfigError, match=key):
        LoopSettings(**settings)
