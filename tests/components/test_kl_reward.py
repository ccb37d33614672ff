"""KL in the reward: verl's ``compute_rewards`` and ``AdaptiveKLController`` numbers, hand-worked cases,
and the family-side holder (controller update from the step's mean per-sequence KL, checkpointed coef)."""

from __future__ import annotations

import pytest
import torch

from rlkit.algorithms.shaping import KLInReward
from rlkit.components import K1, K3, AdaptiveKLController, FixedKLController, KLPenalty
from rlkit.spine.metrics import StepMetrics


def test_rewards_match_verl_compute_rewards(verl_cases):
    """verl: ``token_level_scores - kl_ratio * (old_log_prob - ref_log_prob)`` on every position (no mask)."""
    [case] = verl_cases["rewards_cases"]
    inputs = case["inputs"]
    penalty = KLPenalty(K1(), FixedKLController(inputs["kl_ratio"]))
    scores = inputs["token_level_scores"]
    rewards, kl = penalty(scores, inputs["old_log_prob"], inputs["ref_log_prob"], torch.ones_like(scores))
    torch.testing.assert_close(rewards, case["result"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kl, inputs["old_log_prob"] - inputs["ref_log_prob"])


def test_adaptive_controller_matches_verl(verl_cases):
    [case] = verl_cases["kl_ctrl_cases"]
    assert case["name"] == "adaptive_0.2_target6_h10000"
    controller = AdaptiveKLController(coef=0.2, target_kl=6.0, horizon=10000)
    for (current_kl, n_steps), expected in zip(case["updates"], case["values_after_each"], strict=True):
        controller.update(current_kl, n_steps)
        assert controller.coef == pytest.approx(expected, rel=1e-5, abs=1e-5), (current_kl, n_steps)
    assert len(case["updates"]) == 7


def test_adaptive_controller_hand_worked():
    """coef 0.2, target 6, horizon 10000, 256 sequences: KL 0 -> e = -0.2 (clipped from -1), beta * 0.99488;
    KL 6 -> e = 0, unchanged; KL 7.2 -> e = +0.2, beta * 1.00512; KL 9 -> e = 0.5 clipped to 0.2."""
    controller = AdaptiveKLController(0.2, 6.0, 10000)
    controller.update(0.0, 256)
    assert controller.coef == pytest.approx(0.198976, abs=1e-12)
    controller.update(6.0, 256)
    assert controller.coef == pytest.approx(0.198976, abs=1e-12)
    controller.update(7.2, 256)
    assert controller.coef == pytest.approx(0.198976 * 1.00512, abs=1e-12)
    before = controller.coef
    controller.update(9.0, 256)
    assert controller.coef == pytest.approx(before * 1.00512, abs=1e-12)


def test_fixed_controller_never_moves():
    controller = FixedKLController(0.05)
    controller.update(100.0, 1024)
    assert controller.coef == 0.05


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: FixedKLController(-0.1), "coef"),
        (lambda: AdaptiveKLController(-1.0), "coef"),
        (lambda: AdaptiveKLController(0.1, target_kl=0.0), "target_kl"),
        (lambda: AdaptiveKLController(0.1, horizon=0), "horizon"),
    ],
)
def test_controllers_reject_bad_settings(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_penalty_is_masked_and_uses_the_estimator():
    """K3 on a log-ratio of 0.5: k3 = e^-0.5 + 0.5 - 1 = 0.10653; the padded token gets no penalty."""
    old = torch.tensor([[-1.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.5, -1.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    rewards = torch.tensor([[0.0, 1.0, 0.0]])
    shaped, kl = KLPenalty(K3(), FixedKLController(0.1))(rewards, old, ref, mask)
    expected_kl = torch.tensor([[torch.exp(torch.tensor(-0.5)).item() + 0.5 - 1.0, 0.0, 0.0]])
    torch.testing.assert_close(kl, expected_kl)
    torch.testing.assert_close(shaped, rewards - 0.1 * expected_kl)


def test_holder_updates_from_the_mean_per_sequence_kl_and_checkpoints_the_coef():
    """Two rows: K1 = [1, 1] over 2 tokens and [3] over 1 token -> per-sequence means 1 and 3, step KL 2.
    Adaptive (coef 1, target 1, horizon 2): e = clip(2 - 1) = 0.2, beta = 1 * (1 + 0.2 * 2 / 2) = 1.2."""
    holder = KLInReward(KLPenalty(K1(), AdaptiveKLController(1.0, target_kl=1.0, horizon=2)))
    old = torch.tensor([[0.0, 0.0], [0.0, 0.0]])
    ref = torch.tensor([[-1.0, -1.0], [-3.0, -5.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    metrics = StepMetrics()
    shaped = holder(torch.zeros(2, 2), old, ref, mask, metrics)
    torch.testing.assert_close(shaped, torch.tensor([[-1.0, -1.0], [-3.0, 0.0]]))  # beta used = 1.0
    assert holder.penalty.controller.coef == pytest.approx(1.2)
    values = metrics.compute()
    assert values["reward/kl_penalty"].item() == pytest.approx(2.0)
    assert values["reward/kl_coef"].item() == pytest.approx(1.0)

    state = holder.state_dict()
    assert state["_extra_state"] == {"coef": pytest.approx(1.2)}
    fresh = KLInReward(KLPenalty(K1(), AdaptiveKLController(1.0, target_kl=1.0, horizon=2)))
    fresh.load_state_dict(state)
    assert fresh.penalty.controller.coef == holder.penalty.controller.coef
