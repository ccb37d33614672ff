"""KL estimators: hand-worked numbers, verl's kl_penalty values and gradients, straight-through."""

import math

import pytest
import torch
from verl_modes import AGGREGATIONS

from rlkit.components.kl import K1, K2, K3, AbsKL

# verl kl_penalty names -> rlkit class; a trailing "+" is straight_through=True
VERL_NAMES = {"kl": K1, "k1": K1, "abs": AbsKL, "mse": K2, "k2": K2, "low_var_kl": K3, "k3": K3}


def test_hand_worked():
    """pi = 0.5, pi_ref = 0.25: log pi - log pi_ref = ln 2; r = pi_ref / pi = 0.5.
    k1 = ln 2 = 0.6931, k2 = ln^2 2 / 2 = 0.2402, k3 = 0.5 - ln 0.5 - 1 = 0.1931, abs = ln 2."""
    lp, ref = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]])
    ln2 = math.log(2.0)
    assert K1()(lp, ref).item() == pytest.approx(ln2)
    assert K2()(lp, ref).item() == pytest.approx(ln2**2 / 2)
    assert K3()(lp, ref).item() == pytest.approx(0.5 + ln2 - 1.0)
    assert AbsKL()(lp, ref).item() == AbsKL()(ref, lp).item() == pytest.approx(ln2)


def test_k3_is_clamped_like_verl():
    """log r = 50 is clamped to 20 before exp, and k3 to 10."""
    assert K3()(torch.tensor([[-50.0]]), torch.tensor([[0.0]])).item() == 10.0


@pytest.mark.parametrize("cls", [K1, K3, AbsKL])
def test_straight_through_keeps_value_takes_k2_gradient(cls):
    """d/d log pi of the straight-through form is log pi - log pi_ref (k2's gradient)."""
    lp = torch.tensor([[-1.0, -2.0, -0.1]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -0.1]])
    value = cls(straight_through=True)(lp, ref)
    torch.testing.assert_close(value, cls()(lp, ref))
    (grad,) = torch.autograd.grad(value.sum(), lp)
    torch.testing.assert_close(grad, torch.tensor([[0.5, -1.0, 0.0]]))


@pytest.mark.parametrize("case", ["kl_near_4x6", "kl_extreme_8x10", "kl_huge_6x5"])
@pytest.mark.parametrize("name", [n + s for s in ("", "+") for n in VERL_NAMES])
def test_matches_verl_kl_penalty(verl_cases, case, name):
    (c,) = [c for c in verl_cases["kl_cases"] if c["name"] == case]
    ref_result = c["results"][name]
    lp = c["inputs"]["logprob"].clone().requires_grad_()
    ref = c["inputs"]["ref_logprob"].clone().requires_grad_()
    mask = c["inputs"]["mask"]
    kl = VERL_NAMES[name.rstrip("+")](straight_through=name.endswith("+"))(lp, ref)
    grad_lp, grad_ref = torch.autograd.grad((kl * mask).sum(), (lp, ref))
    torch.testing.assert_close(kl, ref_result["value"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_lp, ref_result["grad_logprob"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_ref, ref_result["grad_ref_logprob"], rtol=1e-5, atol=1e-5)
    for mode, expected in ref_result["agg"].items():
        assert AGGREGATIONS[mode](kl, mask).item() == pytest.approx(expected, rel=1e-5, abs=1e-6), mode


def test_full_kl_is_not_offered(verl_cases):
    """verl's "full" raises NotImplementedError; rlkit simply has no such estimator."""
    assert "NotImplementedError" in verl_cases["kl_cases"][0]["results"]["full"]["error"]
