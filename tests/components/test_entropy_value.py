"""Entropy from logits (chunked) and the clipped value loss: hand-worked numbers and verl's."""

import math

import pytest
import torch
from verl_modes import AGGREGATIONS

from rlkit.components.entropy import entropy_from_logits
from rlkit.components.value import ClippedValueLoss


def test_entropy_hand_worked():
    """Uniform over 4 -> ln 4.
    Logits [0, ln 3] -> p = [1/4, 3/4] -> H = -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.5623."""
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -math.inf, -math.inf]]])
    h = entropy_from_logits(logits)
    assert h.shape == (1, 2)
    assert h[0, 0].item() == pytest.approx(math.log(4.0))
    assert h[0, 1].item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)))


def _reference_entropy(logits):
    p = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (p * logits).sum(-1)


@pytest.mark.parametrize("chunk_rows", [1, 3, 512])
def test_entropy_value_and_gradient_match_autograd(chunk_rows):
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 5, 17, generator=gen, dtype=torch.float64)).requires_grad_()
    weights = torch.randn(3, 5, generator=gen, dtype=torch.float64)
    ours = entropy_from_logits(logits, chunk_rows=chunk_rows)
    (grad,) = torch.autograd.grad((ours * weights).sum(), logits)
    ref = _reference_entropy(logits)
    (grad_ref,) = torch.autograd.grad((ref * weights).sum(), logits)
    torch.testing.assert_close(ours, ref.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, grad_ref, rtol=1e-5, atol=1e-6)


def test_entropy_non_contiguous_and_bf16():
    gen = torch.Generator().manual_seed(1)
    full = torch.randn(2, 6, 11, generator=gen)
    sliced = full[:, :-1]  # the usual shifted view
    torch.testing.assert_close(entropy_from_logits(sliced, chunk_rows=2), _reference_entropy(sliced))
    half = full.bfloat16().requires_grad_()
    h = entropy_from_logits(half, chunk_rows=4)
    assert h.dtype == torch.float32
    torch.testing.assert_close(h, _reference_entropy(half.detach().float()), rtol=1e-5, atol=1e-5)
    h.sum().backward()
    assert half.grad.dtype == torch.bfloat16 and half.grad.isfinite().all()


@pytest.mark.parametrize("case", ["entropy_3x5x11", "entropy_6x7x13"])
def test_entropy_matches_verl(verl_cases, case):
    (c,) = [c for c in verl_cases["entropy_cases"] if c["name"] == case]
    h = entropy_from_logits(c["inputs"]["logits"], chunk_rows=4)
    torch.testing.assert_close(h, c["results"]["entropy_from_logits"], rtol=1e-5, atol=1e-5)
    for mode, expected in c["results"]["entropy_loss"].items():
        got = AGGREGATIONS[mode](h, c["inputs"]["response_mask"]).item()
        assert got == pytest.approx(expected, rel=1e-5), mode


def test_value_loss_hand_worked():
    """c = 0.2.
    V=1.5, R=1.0, V_old=1.0: (0.5)^2 = 0.25 vs (1.2 - 1.0)^2 = 0.04 -> 0.25 / 2 = 0.125, not clipped;
    V=1.0, R=2.0, V_old=0.5: (1.0)^2 = 1.0 vs (0.7 - 2.0)^2 = 1.69 -> 1.69 / 2 = 0.845, clipped
    (the clipped term is constant in V: no gradient)."""
    values = torch.tensor([[1.5, 1.0]], requires_grad=True)
    out = ClippedValueLoss(0.2)(values, torch.tensor([[1.0, 2.0]]), torch.tensor([[1.0, 0.5]]))
    assert out.loss[0].tolist() == pytest.approx([0.125, 0.845])
    assert out.clipped["fraction"].tolist() == [[False, True]]
    (grad,) = torch.autograd.grad(out.loss.sum(), values)
    assert grad[0].tolist() == pytest.approx([0.5, 0.0])  # d/dV (V - R)^2 / 2 = V - R
    unclipped = ClippedValueLoss(None)(values, torch.tensor([[1.0, 2.0]]), torch.tensor([[1.0, 0.5]]))
    assert unclipped.loss[0].tolist() == pytest.approx([0.125, 0.5]) and not unclipped.clipped["fraction"].any()


@pytest.mark.parametrize("case", ["value_4x6", "value_8x9"])
@pytest.mark.parametrize("mode", list(AGGREGATIONS))
@pytest.mark.parametrize("clip_range", [0.2, 0.5])
def test_value_loss_matches_verl(verl_cases, case, mode, clip_range):
    (c,) = [c for c in verl_cases["value_loss_cases"] if c["name"] == case]
    (r,) = [r for r in c["results"] if r["agg_mode"] == mode and r["cliprange_value"] == clip_range]
    inputs, mask = c["inputs"], c["inputs"]["response_mask"]
    values = inputs["vpreds"].clone().requires_grad_()
    out = ClippedValueLoss(clip_range)(values, inputs["returns"], inputs["values"])
    loss = AGGREGATIONS[mode](out.loss, mask)
    (grad,) = torch.autograd.grad(loss, values)
    assert loss.item() == pytest.approx(r["vf_loss"], rel=1e-5)
    torch.testing.assert_close(grad, r["grad_vpreds"], rtol=1e-5, atol=1e-6)
    clipfrac = (out.clipped["fraction"] & mask.bool()).sum() / mask.sum()
    assert clipfrac.item() == pytest.approx(r["vf_clipfrac"], abs=1e-6)


@pytest.mark.parametrize("clip_range", [0.0, -0.1])
def test_value_loss_rejects_bad_clip_range(clip_range):
    with pytest.raises(ValueError, match="clip_range"):
        ClippedValueLoss(clip_range)


def test_entropy_rejects_bad_arguments():
    with pytest.raises(ValueError, match="chunk_rows"):
        entropy_from_logits(torch.zeros(2, 3), chunk_rows=0)
    with pytest.raises(ValueError, match="unsqueeze"):
        entropy_from_logits(torch.zeros(3))


def test_entropy_of_masked_vocabulary_is_finite():
    """-inf logits (masked vocabulary) contribute 0 log 0 = 0 to the value and nothing to the gradient."""
    logits = torch.tensor([[[1.0, 2.0, -math.inf]]], requires_grad=True)
    h = entropy_from_logits(logits)
    torch.testing.assert_close(h, _reference_entropy(logits.detach()[..., :2]))
    h.sum().backward()
    assert logits.grad.isfinite().all() and logits.grad[0, 0, 2] == 0
