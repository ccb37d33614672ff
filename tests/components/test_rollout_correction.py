"""Rollout corrections: hand-worked weights, masks and metrics; micro-batch invariance.

verl's numbers (bypass REINFORCE with token and sequence TIS, and bypass PPO-clip) are matched in
``test_policy_loss_reference.py``.
"""

import math

import pytest
import torch

from rlkit.components.aggregation import SeqMeanTokenMean, StepTotals, TokenMean
from rlkit.components.clip import ClipInputs, NoClip
from rlkit.components.ratio import LogProb
from rlkit.components.rollout_correction import IcePop, MaskedIS, NoCorrection, TruncatedIS

LN = math.log


def _rows(log_ratios, lengths=None):
    """Trainer log-probs with the given log-ratios to an engine at log-prob -1; ``lengths`` valid tokens."""
    log_ratio = torch.tensor(log_ratios, dtype=torch.float64)
    rollout = torch.full_like(log_ratio, -1.0)
    t = log_ratio.shape[1]
    lengths = [t] * log_ratio.shape[0] if lengths is None else lengths
    mask = (torch.arange(t) < torch.tensor(lengths)[:, None]).to(torch.float64)
    return rollout + log_ratio, rollout, mask


def test_truncated_is_token_hand_worked():
    """rho = [3, 0.5, 1] (+ padding) -> w = [2, 0.5, 1, 0]; truncated 1/3; mean 3.5/3, max 2,
    ess = 3.5^2 / (3 (4 + 0.25 + 1)) = 0.7778."""
    log_prob, rollout, mask = _rows([[LN(3), LN(0.5), 0.0, 7.0]], lengths=[3])
    out = TruncatedIS("token", 2.0)(log_prob, rollout, mask)
    assert out.weights[0].tolist() == pytest.approx([2.0, 0.5, 1.0, 0.0])
    assert out.keep[0].tolist() == [True, True, True, False]
    m = {k: v.item() for k, v in out.metrics.items()}
    assert m == pytest.approx(
        {"weight_mean": 3.5 / 3, "weight_max": 2.0, "truncated_fraction": 1 / 3, "ess": 3.5**2 / (3 * 5.25)}
    )


def test_truncated_is_sequence_and_geometric_levels():
    """Row log-ratios [ln 2, ln 2]: product 4 -> capped at 3; geometric mean 2 -> 2 (under the cap).
    An empty row gets weight 0 everywhere and counts nowhere."""
    log_prob, rollout, mask = _rows([[LN(2), LN(2)], [5.0, 5.0]], lengths=[2, 0])
    sequence = TruncatedIS("sequence", 3.0)(log_prob, rollout, mask)
    torch.testing.assert_close(sequence.weights, torch.tensor([[3.0, 3.0], [0.0, 0.0]], dtype=torch.float64))
    assert sequence.metrics["truncated_fraction"].item() == 1.0
    geometric = TruncatedIS("geometric", 3.0)(log_prob, rollout, mask)
    torch.testing.assert_close(geometric.weights, torch.tensor([[2.0, 2.0], [0.0, 0.0]], dtype=torch.float64))
    assert geometric.metrics["truncated_fraction"].item() == 0.0


def test_log_ratio_is_clamped_at_the_safety_bound():
    """log rho = 30 and -30 are clamped to +-20 before exp (verl's SAFETY_BOUND); IcePop then zeroes both."""
    log_prob, rollout, mask = _rows([[30.0, -30.0]])
    out = TruncatedIS("token", 1e12)(log_prob, rollout, mask)
    assert out.weights[0].tolist() == pytest.approx([math.exp(20.0), math.exp(-20.0)])
    assert not IcePop("token", 0.5, 5.0)(log_prob, rollout, mask).weights.any()


def test_icepop_hand_worked():
    """Band [0.5, 5]: rho = [3, 0.6, 1, 6] -> w = [3, 0.6, 1, 0]; the zeroed token stays in the counts."""
    log_prob, rollout, mask = _rows([[LN(3), LN(0.6), 0.0, LN(6)]])
    out = IcePop("token", 0.5, 5.0)(log_prob, rollout, mask)
    assert out.weights[0].tolist() == pytest.approx([3.0, 0.6, 1.0, 0.0])
    assert out.keep.all()
    assert out.metrics["masked_fraction"].item() == 0.25
    assert out.metrics["weight_max"].item() == pytest.approx(3.0)


def test_masked_is_hand_worked():
    """Band [0.5, 2]. Token level: rho = [3, 0.6, 1] -> the first token is dropped (keep False, w 0).
    Sequence level: row 0's product 1.8 is inside, row 1's 3 * 1 = 3 is not: row 1 is dropped whole."""
    log_prob, rollout, mask = _rows([[LN(3), LN(0.6), 0.0], [LN(3), 0.0, 0.0]])
    token = MaskedIS("token", 0.5, 2.0)(log_prob, rollout, mask)
    assert token.keep.tolist() == [[False, True, True], [False, True, True]]
    assert token.weights.tolist() == [[0.0, 1.0, 1.0], [0.0, 1.0, 1.0]]
    assert token.metrics["masked_fraction"].item() == pytest.approx(2 / 6)
    sequence = MaskedIS("sequence", 0.5, 2.0)(log_prob, rollout, mask)
    assert sequence.keep.tolist() == [[True, True, True], [False, False, False]]
    assert sequence.metrics["ess"].item() == pytest.approx(0.5)  # 3 of 6 weights are 1


def test_no_correction_is_the_mask():
    log_prob, rollout, mask = _rows([[LN(3), 0.0]], lengths=[1])
    out = NoCorrection()(log_prob, rollout, mask)
    assert out.weights.tolist() == [[1.0, 0.0]] and out.keep.tolist() == [[True, False]] and not out.metrics
    assert NoCorrection(bypass=True).bypass and not NoCorrection().bypass


ALL = [
    NoCorrection(),
    TruncatedIS("token", 1.5),
    TruncatedIS("sequence", 2.0),
    TruncatedIS("geometric", 1.2, bypass=True),
    IcePop("token", 0.8, 1.25),
    IcePop("sequence", 0.5, 2.0),
    MaskedIS("token", 0.8, 1.25),
    MaskedIS("geometric", 0.9, 1.1),
]


def _random(seed=0, n=7, t=6):
    gen = torch.Generator().manual_seed(seed)
    log_prob = -torch.rand(n, t, generator=gen, dtype=torch.float64) * 2
    rollout = log_prob + 0.3 * torch.randn(n, t, generator=gen, dtype=torch.float64)
    mask = (torch.rand(n, t, generator=gen) > 0.25).to(torch.float64)
    mask[2] = 0.0  # an empty row
    return log_prob, rollout, mask


@pytest.mark.parametrize("correction", ALL, ids=repr)
def test_weights_are_detached_zero_on_padding_and_row_local(correction):
    """Weights carry no gradient, vanish on padding, and a row's weights do not depend on the other rows
    (so micro-batching cannot change them)."""
    log_prob, rollout, mask = _random()
    leaf = log_prob.clone().requires_grad_()
    out = correction(leaf, rollout, mask)
    assert not out.weights.requires_grad
    assert not out.weights[mask == 0].any() and not out.keep[mask == 0].any()
    for rows in (slice(0, 3), slice(3, 7)):
        part = correction(log_prob[rows], rollout[rows], mask[rows])
        torch.testing.assert_close(part.weights, out.weights[rows])
        assert torch.equal(part.keep, out.keep[rows])


@pytest.mark.parametrize("correction", ALL, ids=repr)
@pytest.mark.parametrize("aggregation", [TokenMean(), SeqMeanTokenMean()], ids=repr)
def test_micro_batched_corrected_loss_sums_to_the_whole_step(correction, aggregation):
    """The caller's pipeline: weights multiply the loss, dropped tokens leave the mask and the totals.
    Uneven micro-batches with StepTotals from the kept masks give the whole step's loss and gradient."""
    log_prob, rollout, mask = _random(seed=1)
    adv = torch.randn(mask.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    leaf = log_prob.clone().requires_grad_()
    corrected = correction(log_prob, rollout, mask)
    kept = mask * corrected.keep

    def loss_of(rows, totals):
        inputs = ClipInputs(
            LogProb()(leaf[rows], log_prob[rows], kept[rows]), leaf[rows], log_prob[rows], adv[rows], kept[rows]
        )
        return aggregation(NoClip()(inputs).loss * corrected.weights[rows], kept[rows], totals)

    whole = loss_of(slice(None), None)
    (whole_grad,) = torch.autograd.grad(whole, leaf)
    splits = [slice(0, 1), slice(1, 5), slice(5, 7)]
    totals = StepTotals.from_masks([kept[s] for s in splits])
    micro = sum(loss_of(s, totals) for s in splits)
    torch.testing.assert_close(micro, whole)
    torch.testing.assert_close(torch.autograd.grad(micro, leaf)[0], whole_grad)


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda: TruncatedIS(level="tokens"), "level"),
        (lambda: TruncatedIS(threshold=0.0), "threshold"),
        (lambda: IcePop(lower=2.0, upper=1.0), "lower"),
        (lambda: IcePop(lower=0.0), "lower"),
        (lambda: MaskedIS(level="seq"), "level"),
        (lambda: MaskedIS(lower=-1.0), "lower"),
    ],
)
def test_bad_hyper_parameters_raise(make, words):
    with pytest.raises(ValueError, match=words):
        make()
