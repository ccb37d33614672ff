"""Aggregations: hand-worked numbers, verl's agg_loss, and micro-batch / data-parallel invariance."""

import pytest
import torch
from verl_modes import AGGREGATIONS

from rlkit.components.aggregation import (
    SeqMeanTokenMean,
    SeqMeanTokenSum,
    SeqMeanTokenSumNorm,
    StepTotals,
    TokenMean,
    TokenSum,
)

# loss [[1, 2, 3], [4, 5, 6], [7, 8, 9]] with mask [[1, 1, 0], [1, 0, 0], [0, 0, 0]]:
# valid sum = 1 + 2 + 4 = 7, 3 tokens, 2 non-empty sequences (row 2 is empty), T = 3.
LOSS = torch.arange(1.0, 10.0).reshape(3, 3)
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
HAND_WORKED = {
    "token-mean": 7 / 3,
    "token-sum": 7.0,
    "seq-mean-token-sum": 7 / 2,
    "seq-mean-token-mean": (1.5 + 4.0) / 2,  # row means 1.5 and 4; the empty row is not a sequence
    "seq-mean-token-sum-norm": 7 / (2 * 3),
}


@pytest.mark.parametrize("mode", list(AGGREGATIONS))
def test_hand_worked(mode):
    assert AGGREGATIONS[mode](LOSS, MASK).item() == pytest.approx(HAND_WORKED[mode])


def test_hand_worked_with_step_totals():
    """Totals of a bigger step on 2 ranks: 4 sequences, 10 tokens, max_length 4."""
    totals = StepTotals(num_sequences=4, num_tokens=10, world_size=2, max_length=4)
    assert TokenMean()(LOSS, MASK, totals).item() == pytest.approx(7 * 2 / 10)
    assert TokenSum()(LOSS, MASK, totals).item() == pytest.approx(7 * 2)
    assert SeqMeanTokenSum()(LOSS, MASK, totals).item() == pytest.approx(7 * 2 / 4)
    assert SeqMeanTokenMean()(LOSS, MASK, totals).item() == pytest.approx(5.5 * 2 / 4)
    assert SeqMeanTokenSumNorm()(LOSS, MASK, totals).item() == pytest.approx(7 * 2 / (4 * 4))


@pytest.mark.parametrize("mode", list(AGGREGATIONS))
def test_no_valid_token_gives_zero_not_nan(mode):
    loss = torch.ones(2, 3, requires_grad=True)
    out = AGGREGATIONS[mode](loss, torch.zeros(2, 3))
    out.backward()
    assert out.item() == 0.0 and torch.equal(loss.grad, torch.zeros(2, 3))


def test_step_totals_from_masks_counts_non_empty_rows():
    totals = StepTotals.from_masks([MASK, torch.ones(2, 3)], world_size=2, max_length=5)
    assert totals == StepTotals(num_sequences=4, num_tokens=9, world_size=2, max_length=5)


def _verl_totals(kwargs: dict, mask: torch.Tensor) -> StepTotals:
    """verl agg_loss kwargs -> StepTotals; absent counts are those of the batch (single process)."""
    local = StepTotals.from_masks([mask])
    return StepTotals(
        num_sequences=kwargs.get("global_batch_size", local.num_sequences),
        num_tokens=kwargs.get("batch_num_tokens", local.num_tokens),
        world_size=kwargs.get("dp_size", 1),
        max_length=kwargs.get("loss_scale_factor"),
    )


@pytest.mark.parametrize("case", ["agg_4x6", "agg_7x9_emptyrow", "agg_16x5"])
@pytest.mark.parametrize("mode", list(AGGREGATIONS))
def test_matches_verl_agg_loss(verl_cases, case, mode):
    (c,) = [c for c in verl_cases["agg_cases"] if c["name"] == case]
    results = [r for r in c["results"] if r["agg_mode"] == mode]
    assert len(results) == 4
    for r in results:
        loss_mat = c["inputs"]["loss_mat"].clone().requires_grad_()
        mask = c["inputs"]["loss_mask"]
        loss = AGGREGATIONS[mode](loss_mat, mask, _verl_totals(r["kwargs"], mask))
        (grad,) = torch.autograd.grad(loss, loss_mat)
        assert loss.item() == pytest.approx(r["loss"], rel=1e-5, abs=1e-6), r["kwargs"]
        torch.testing.assert_close(grad, r["grad_loss_mat"], rtol=1e-5, atol=1e-6)


def _problem(seed=0, n=9, t=6):
    """A shared parameter theta feeds every row, so rank gradients overlap as in DDP."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, t, generator=gen, dtype=torch.float64)
    lengths = torch.tensor([6, 1, 0, 3, 6, 2, 5, 4, 1])[:n]  # row 2 is empty
    mask = (torch.arange(t) < lengths[:, None]).double()  # [N, T]
    theta = torch.tensor([0.7, -0.3], dtype=torch.float64, requires_grad=True)
    return x, mask, theta


def _loss_mat(theta, x):
    return torch.sin(theta[0] * x + theta[1]) * x  # [n, T]


@pytest.mark.parametrize("max_length", [None, 10])
@pytest.mark.parametrize("mode", list(AGGREGATIONS))
def test_micro_batches_sum_to_whole_batch(mode, max_length):
    x, mask, theta = _problem()
    agg = AGGREGATIONS[mode]
    whole = agg(_loss_mat(theta, x), mask, StepTotals.from_masks([mask], max_length=max_length))
    (grad_whole,) = torch.autograd.grad(whole, theta)
    if max_length is None:  # totals=None means "this batch is the whole step"
        torch.testing.assert_close(agg(_loss_mat(theta, x), mask), whole)

    splits = [slice(0, 1), slice(1, 5), slice(5, 9)]  # uneven micro-batches
    totals = StepTotals.from_masks([mask[s] for s in splits], max_length=max_length)
    micro = sum(agg(_loss_mat(theta, x[s]), mask[s], totals) for s in splits)
    (grad_micro,) = torch.autograd.grad(micro, theta)
    torch.testing.assert_close(micro, whole)
    torch.testing.assert_close(grad_micro, grad_whole)


@pytest.mark.parametrize("mode", list(AGGREGATIONS))
def test_data_parallel_average_of_rank_gradients_is_whole_batch_gradient(mode):
    """2 simulated ranks (rows 0-3 and 4-8), each with 2 micro-batches; DDP averages the gradients."""
    x, mask, theta = _problem(seed=1)
    agg = AGGREGATIONS[mode]
    whole = agg(_loss_mat(theta, x), mask)
    (grad_whole,) = torch.autograd.grad(whole, theta)

    ranks = [[slice(0, 1), slice(1, 4)], [slice(4, 7), slice(7, 9)]]
    totals = StepTotals.from_masks([mask[s] for rank in ranks for s in rank], world_size=2)
    rank_losses, rank_grads = [], []
    for rank in ranks:
        loss = sum(agg(_loss_mat(theta, x[s]), mask[s], totals) for s in rank)
        rank_losses.append(loss)
        rank_grads.append(torch.autograd.grad(loss, theta)[0])
    torch.testing.assert_close(sum(rank_grads) / 2, grad_whole)
    torch.testing.assert_close(sum(rank_losses) / 2, whole)


def test_per_micro_batch_mean_would_differ():
    """The invariant above is not vacuous: normalising each micro-batch by its own counts differs."""
    x, mask, theta = _problem()
    whole = TokenMean()(_loss_mat(theta, x), mask)
    naive = sum(TokenMean()(_loss_mat(theta, x[s]), mask[s]) for s in [slice(0, 1), slice(1, 9)]) / 2
    assert abs(naive.item() - whole.item()) > 1e-3
