"""Ratio + Clip + Aggregation against verl 0.9.1's policy losses (``pl_cases``), loss and gradient.

verl ``vanilla`` = TokenRatio + PPOClip(clip_ratio_low, clip_ratio_high, dual_clip=clip_ratio_c);
``gspo`` = SequenceRatio + PPOClip(low, high) (no dual clip); ``gpg`` = LogProb + NoClip.
verl 0.9.1's GSPO honours the aggregation mode it is given (the recorded numbers differ per mode),
so all three are compared under all five modes. Where verl multiplies the per-token loss by
``rollout_is_weights``, the caller does so before aggregating; no component is involved.
"""

import pytest
import torch
from verl_modes import AGGREGATIONS

from rlkit.components.aggregation import (
    StepTotals,
)
from rlkit.components.clip import NoClip, PPOClip
from rlkit.components.ratio import LogProb, SequenceRatio, TokenRatio

CASES = [
    "near_onpolicy_token_adv",
    "extreme_ratios_token_adv",
    "extreme_ratios_seq_adv_ragged",
    "near_onpolicy_seq_adv_is_weights",
    "extreme_with_empty_row",
]
CONFIGS = [
    ("vanilla", "sym0.2_c3"),
    ("vanilla", "sym0.2_c10"),
    ("vanilla", "asym0.2_0.28_c3"),
    ("gspo", "sym0.2"),
    ("gspo", "gspo3e-4_4e-4"),
    ("gpg", "default"),
]


def compose(loss_mode: str, config: dict):
    """The rlkit components equivalent to a verl policy loss and its ActorConfig."""
    if loss_mode == "vanilla":
        return TokenRatio(), PPOClip(config["clip_ratio_low"], config["clip_ratio_high"], config["clip_ratio_c"])
    if loss_mode == "gspo":
        return SequenceRatio(), PPOClip(config["clip_ratio_low"], config["clip_ratio_high"])
    if loss_mode == "gpg":
        return LogProb(), NoClip()
    raise KeyError(loss_mode)


def policy_loss(inputs, ratio, clip, agg, log_prob, rows=slice(None), totals=None):
    mask = inputs["response_mask"][rows]
    out = clip(ratio(log_prob[rows], inputs["old_log_prob"][rows], mask), inputs["advantages"][rows], mask)
    loss_mat = out.loss  # [n, T]
    if inputs["rollout_is_weights"] is not None:
        loss_mat = loss_mat * inputs["rollout_is_weights"][rows]
    return agg(loss_mat, mask, totals), out


def _find(verl_cases, case, loss_mode, config_name, mode):
    (c,) = [c for c in verl_cases["pl_cases"] if c["name"] == case]
    found = [
        r for r in c["results"] if (r["loss_mode"], r["config_name"], r["agg_mode"]) == (loss_mode, config_name, mode)
    ]
    assert len(found) == 1, f"reference has {len(found)} results for {case}/{loss_mode}/{config_name}/{mode}"
    return c["inputs"], found[0]


@pytest.mark.parametrize("mode", list(AGGREGATIONS))
@pytest.mark.parametrize("loss_mode, config_name", CONFIGS, ids=[f"{m}-{n}" for m, n in CONFIGS])
@pytest.mark.parametrize("case", CASES)
def test_matches_verl(verl_cases, case, loss_mode, config_name, mode):
    inputs, ref = _find(verl_cases, case, loss_mode, config_name, mode)
    ratio, clip = compose(loss_mode, ref["config"])
    log_prob = inputs["log_prob"].clone().requires_grad_()
    loss, out = policy_loss(inputs, ratio, clip, AGGREGATIONS[mode], log_prob)
    (grad,) = torch.autograd.grad(loss, log_prob)
    assert loss.item() == pytest.approx(ref["loss"], rel=1e-5, abs=1e-5)
    torch.testing.assert_close(grad, ref["grad_log_prob"], rtol=1e-5, atol=1e-5)

    # clip metrics: mask-weighted fractions, as verl's actor/pg_clipfrac and actor/pg_clipfrac_lower
    num_tokens = inputs["response_mask"].sum()
    if ref["metrics"]:
        frac = out.clipped["fraction"].sum() / num_tokens
        dual = out.clipped["dual"].sum() / num_tokens
        assert frac.item() == pytest.approx(ref["metrics"]["actor/pg_clipfrac"], abs=1e-6)
        assert dual.item() == pytest.approx(ref["metrics"]["actor/pg_clipfrac_lower"], abs=1e-6)
        assert torch.equal(out.clipped["lower"] | out.clipped["upper"], out.clipped["fraction"])


@pytest.mark.parametrize("mode", list(AGGREGATIONS))
@pytest.mark.parametrize("loss_mode, config_name", CONFIGS, ids=[f"{m}-{n}" for m, n in CONFIGS])
def test_micro_batched_pipeline_matches_verl(verl_cases, loss_mode, config_name, mode):
    """The whole pipeline on uneven micro-batches (with the empty row in one of them) sums to verl's."""
    inputs, ref = _find(verl_cases, "extreme_with_empty_row", loss_mode, config_name, mode)
    ratio, clip = compose(loss_mode, ref["config"])
    log_prob = inputs["log_prob"].clone().requires_grad_()
    splits = [slice(0, 1), slice(1, 4), slice(4, 6)]
    mask = inputs["response_mask"]
    totals = StepTotals.from_masks([mask[s] for s in splits])
    loss = sum(policy_loss(inputs, ratio, clip, AGGREGATIONS[mode], log_prob, s, totals)[0] for s in splits)
    (grad,) = torch.autograd.grad(loss, log_prob)
    assert loss.item() == pytest.approx(ref["loss"], rel=1e-5, abs=1e-5)
    torch.testing.assert_close(grad, ref["grad_log_prob"], rtol=1e-5, atol=1e-5)
