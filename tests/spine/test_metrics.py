"""StepMetrics: weighted means, extremes, selection and reset; non-finite values left out."""

import math

import pytest
import torch

from rlkit.spine.metrics import StepMetrics


def test_weighted_mean_extremes_and_reset():
    metrics = StepMetrics()
    metrics.update("loss/policy", 1.0, 3)  # (1 * 3 + 5 * 1) / 4 = 2
    metrics.update("loss/policy", torch.tensor(5.0), torch.tensor(1))
    metrics.update("ratio/max", 1.5, reduce="max")
    metrics.update("ratio/max", 1.2, reduce="max")
    metrics.update("ratio/min", 0.7, reduce="min")
    metrics.update("ratio/min", 0.9, reduce="min")
    metrics.update("val/reward", 0.25, 8)
    values = {name: value.item() for name, value in metrics.compute(exclude="val/").items()}
    assert values == {"loss/policy": 2.0, "ratio/max": 1.5, "ratio/min": pytest.approx(0.7)}
    assert metrics.compute(exclude="val/") == {}  # reset: nothing new since
    assert {k: v.item() for k, v in metrics.compute("val/").items()} == {"val/reward": 0.25}


def test_non_finite_values_are_left_out_with_a_warning():
    metrics = StepMetrics()
    metrics.update("reward/mean", 1.0, 2)
    with pytest.warns(UserWarning, match="reward/mean"):
        metrics.update("reward/mean", math.nan, 2)
    assert metrics.compute()["reward/mean"].item() == 1.0


def test_updates_under_inference_mode_and_autograd_share_the_sink():
    metrics = StepMetrics()
    with torch.inference_mode():
        metrics.update("val/reward", torch.tensor(1.0), 1)
    x = torch.tensor(3.0, requires_grad=True)
    metrics.update("val/reward", x * 1, 1)
    assert metrics.compute()["val/reward"].item() == 2.0
