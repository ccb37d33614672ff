"""How the update loop cuts a mini-batch into micro-batches (the maths is tested end to end in test_fit)."""

import pytest
import torch

from rlkit.spine.loop import UpdateLoop
from spine.helpers import random_rollout


def plan(loop: UpdateLoop, batch) -> list[list[int]]:
    return [b.tolist() for b in loop.micro_batches(torch.arange(len(batch)), batch)]


def lengths(batch) -> list[int]:
    return batch.attention_mask.sum(-1).tolist()


@pytest.mark.parametrize("pack", [False, True])
def test_rows_and_tokens_both_limit_a_micro_batch(pack):
    batch = random_rollout(seed=5, N=40, P=6, T=20)
    n = lengths(batch)
    loop = UpdateLoop(micro_batch_size=3, micro_batch_tokens=60, pack_sequences=pack)
    micro = plan(loop, batch)
    assert sorted(i for b in micro for i in b) == list(range(40))
    for b in micro:
        cost = sum(n[i] for i in b) if pack else len(b) * max(n[i] for i in b)
        assert len(b) <= 3 and (cost <= 60 or len(b) == 1)
    only_tokens = plan(UpdateLoop(micro_batch_tokens=60, pack_sequences=pack), batch)
    assert max(map(len, only_tokens)) > 3  # the row limit is what kept them at 3


def test_the_default_loop_is_one_micro_batch_and_the_families_default_to_a_token_budget():
    batch = random_rollout(seed=6, N=10)
    assert plan(UpdateLoop(), batch) == [list(range(10))]
    assert plan(UpdateLoop(micro_batch_size=4), batch) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]  # in order
    import inspect

    from rlkit.algorithms import ActorCritic, Distillation, PolicyGradient

    for family in (PolicyGradient, ActorCritic, Distillation):
        assert inspect.signature(family).parameters["micro_batch_tokens"].default == 1024
