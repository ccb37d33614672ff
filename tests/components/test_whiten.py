"""Masked mean, variance and whitening: verl's recorded numbers and a hand-worked example."""

import pytest
import torch

from rlkit.components.whiten import masked_mean, masked_var, masked_whiten


def test_against_verl_whiten_cases(verl_cases):
    for case in verl_cases["whiten_cases"]:
        x, mask = case["inputs"]["values"], case["inputs"]["mask"]
        ref = case["results"]
        close = dict(atol=1e-5, rtol=0, msg=lambda m, name=case["name"]: f"{name}: {m}")
        torch.testing.assert_close(masked_mean(x, mask), ref["masked_mean"], **close)
        torch.testing.assert_close(masked_var(x, mask), ref["masked_var_unbiased"], **close)
        torch.testing.assert_close(masked_var(x, mask, unbiased=False), ref["masked_var_biased"], **close)
        torch.testing.assert_close(masked_whiten(x, mask), ref["masked_whiten"], **close)
        torch.testing.assert_close(masked_whiten(x, mask, shift_mean=False), ref["masked_whiten_noshift"], **close)


def test_hand_worked():
    """x = [2, 4, 6, 100] with the last position masked out.

    mean = 12 / 3 = 4; squared deviations 4, 0, 4: biased var 8/3, unbiased 8/2 = 4, std 2.
    whiten: (x - 4) / 2 = [-1, 0, 1, 48] (the masked 100 is transformed but never enters the stats);
    without shifting the mean back out: [-1, 0, 1, 48] + 4 = [3, 4, 5, 52].
    """
    x = torch.tensor([2.0, 4.0, 6.0, 100.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    assert masked_mean(x, mask).item() == pytest.approx(4.0)
    assert masked_var(x, mask).item() == pytest.approx(4.0)
    assert masked_var(x, mask, unbiased=False).item() == pytest.approx(8 / 3)
    torch.testing.assert_close(masked_whiten(x, mask, eps=0.0), torch.tensor([-1.0, 0.0, 1.0, 48.0]))
    torch.testing.assert_close(masked_whiten(x, mask, shift_mean=False, eps=0.0), torch.tensor([3.0, 4.0, 5.0, 52.0]))


def test_mean_along_dim_and_bool_mask():
    """Row means of [[1, 3, 9], [2, 0, 0]] with masks [[1, 1, 0], [1, 0, 0]] are [2, 2]."""
    x = torch.tensor([[1.0, 3.0, 9.0], [2.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    torch.testing.assert_close(masked_mean(x, mask, dim=-1), torch.tensor([2.0, 2.0]))


def test_values_outside_mask_never_read():
    x = torch.tensor([1.0, 3.0, float("nan"), float("inf")])
    mask = torch.tensor([1.0, 1.0, 0.0, 0.0])
    assert masked_mean(x, mask).item() == pytest.approx(2.0)
    assert masked_var(x, mask).item() == pytest.approx(2.0)  # (1 + 1) / (2 - 1)


def test_empty_mask_mean_is_zero():
    assert masked_mean(torch.ones(3), torch.zeros(3)).item() == 0.0


@pytest.mark.parametrize("kept", [0, 1])
def test_unbiased_var_needs_two_elements(kept):
    mask = torch.zeros(4)
    mask[:kept] = 1
    with pytest.raises(ValueError, match="at least 2 unmasked elements"):
        masked_var(torch.arange(4.0), mask)
