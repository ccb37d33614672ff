"""Advantage estimators: verl 0.9.1's recorded numbers, hand-worked examples and invariants."""

import math
from pathlib import Path

import pytest
import torch

from rlkit.components.advantage import (
    GAE,
    GDPO,
    Advantage,
    AdvantageInputs,
    DiscountedReturn,
    GPGScaled,
    GreedyBaseline,
    GroupMean,
    GroupMeanWhitened,
    GroupNorm,
    LeaveOneOut,
    LengthWeightedBaseline,
    PassAtK,
)
from rlkit.components.base import Need
from rlkit.components.groups import Groups
from rlkit.components.optimal_baseline import MultiTurnOptimalTokenBaseline, OptimalTokenBaseline

REFERENCE = Path(__file__).resolve().parents[3] / "shared" / "reference" / "verl_cases.pt"


def _estimator(variant: str, params: dict) -> Advantage:
    """The rlkit estimator (with verl's settings) that reproduces a recorded verl variant."""
    if variant.startswith(("grpo_norm", "grpo_vectorized_norm")):
        return GroupNorm(eps=params["epsilon"]) if params["norm_adv_by_std_in_grpo"] else GroupMean()
    if variant.startswith("gae_"):
        return GAE(gamma=params["gamma"], lam=params["lam"])
    if variant.startswith("reinforce_plus_plus_gamma"):
        return DiscountedReturn(gamma=params["config"]["gamma"])
    if variant.startswith("grpo_passk"):
        return PassAtK(normalize_std=params["config"]["norm_adv_by_std_in_grpo"], eps=params["epsilon"])
    if variant.startswith("gdpo"):  # verl without gdpo_reward_keys: one reward, the summed score
        return GDPO(normalize_std=params["norm_adv_by_std_in_grpo"], eps=params["epsilon"])
    if variant.startswith(("optimal_token_baseline", "tir_optimal_token_baseline")):
        otb = MultiTurnOptimalTokenBaseline if variant.startswith("tir_") else OptimalTokenBaseline
        return otb(params["handle_zero_tail"], params["use_rollout_is_weights"], params["epsilon"])
    return {
        "rloo_vectorized": LeaveOneOut,
        "opo": LengthWeightedBaseline,
        "gpg": GPGScaled,
        "remax": GreedyBaseline,
        "reinforce_plus_plus_baseline": GroupMeanWhitened,
    }[variant]()


def _is_covered(variant: str) -> bool:
    try:
        _estimator(
            variant,
            {
                "epsilon": 1e-6,
                "norm_adv_by_std_in_grpo": True,
                "gamma": 1.0,
                "lam": 1.0,
                "config": {"gamma": 1.0, "norm_adv_by_std_in_grpo": True},
                "handle_zero_tail": True,
                "use_rollout_is_weights": False,
            },
        )
    except KeyError:
        return False
    return True


def _reference_pairs(errors: bool = False) -> list:
    """(case, variant) pairs rlkit covers: those verl computed, or with ``errors`` those where it raised."""
    if not REFERENCE.exists():  # the verl_cases fixture then fails with the path to fix
        return [pytest.param("missing", "missing", id="reference-missing")]
    cases = torch.load(REFERENCE, weights_only=True)["adv_cases"]
    return [
        pytest.param(case["name"], variant, id=f"{case['name']}-{variant}")
        for case in cases
        for variant, result in case["results"].items()
        if _is_covered(variant) and ("error" in result) == errors
    ]


def _case(verl_cases: dict, name: str) -> dict:
    return next(c for c in verl_cases["adv_cases"] if c["name"] == name)


def _inputs(case: dict) -> AdvantageInputs:
    raw = case["inputs"]
    return AdvantageInputs(
        token_rewards=raw["token_level_rewards"],
        mask=raw["response_mask"],
        group_ids=case["group_ids"],
        values=raw["values"],
        baselines=raw["reward_baselines"],
        reward_terms=raw["token_level_rewards"].sum(-1, keepdim=True),  # [N, 1]: verl's gdpo without keys
        old_log_probs=raw["old_log_probs"],
        sum_pi_squared=raw["sum_pi_squared"],
        is_weights=raw["rollout_is_weights"],
    )


@pytest.mark.parametrize(("case_name", "variant"), _reference_pairs())
def test_matches_verl(verl_cases, case_name, variant):
    """Advantages and returns equal verl's on every unmasked token, and are 0 elsewhere.

    verl leaves non-zero numbers outside the mask in two places, which rlkit zeros (the losses mask
    them anyway, so training is unchanged): ``gae`` returns whitened advantages and ``A + V`` on
    padding and holes, and ``remax`` on a hole keeps the reward-to-go there (it subtracts
    ``baseline * mask``). So both sides are compared after multiplying by the mask.
    """
    case = _case(verl_cases, case_name)
    ref = case["results"][variant]
    mask = case["inputs"]["response_mask"]
    advantages, returns = _estimator(variant, case["params"][variant])(_inputs(case))
    torch.testing.assert_close(advantages, ref["advantages"] * mask, atol=1e-5, rtol=0)
    torch.testing.assert_close(returns, ref["returns"] * mask, atol=1e-5, rtol=0)
    assert not (advantages * (1 - mask)).any() and not (returns * (1 - mask)).any()


@pytest.mark.parametrize(("case_name", "variant"), _reference_pairs(errors=True))
def test_raises_where_verl_raised(verl_cases, case_name, variant):
    """verl's grpo_passk refuses a group of one completion; so does PassAtK, with a message naming the fix."""
    case = _case(verl_cases, case_name)
    assert "at least 2 samples per group" in case["results"][variant]["error"]
    with pytest.raises(ValueError, match="at least 2 completions per prompt.*samples_per_prompt"):
        _estimator(variant, case["params"][variant])(_inputs(case))


def test_every_requested_variant_is_compared(verl_cases):
    wanted = {
        "grpo_passk_normTrue",
        "grpo_passk_normFalse",
        "gdpo_noconfig",
        "optimal_token_baseline_isFalse_zerotailTrue",
        "optimal_token_baseline_isFalse_zerotailFalse",
        "optimal_token_baseline_isTrue_zerotailTrue",
        "optimal_token_baseline_isTrue_zerotailFalse",
        "tir_optimal_token_baseline_isFalse_zerotailTrue",
        "tir_optimal_token_baseline_isFalse_zerotailFalse",
        "tir_optimal_token_baseline_isTrue_zerotailTrue",
        "tir_optimal_token_baseline_isTrue_zerotailFalse",
        "grpo_normTrue",
        "grpo_normFalse",
        "rloo_vectorized",
        "opo",
        "gpg",
        "remax",
        "reinforce_plus_plus_gamma1.0",
        "reinforce_plus_plus_gamma0.95",
        "reinforce_plus_plus_baseline",
    }
    for case in verl_cases["adv_cases"]:
        recorded = set(case["results"])
        assert wanted <= recorded
        assert any(v.startswith("gae_") for v in recorded)
        assert all(_is_covered(v) for v in wanted | {v for v in recorded if v.startswith("gae_")})


def test_leave_one_out_singleton_differs_from_verl_rloo(verl_cases):
    """verl's loop ``rloo`` keeps a singleton's raw reward; rlkit (like ``rloo_vectorized``) gives 0.

    A singleton has no other completion to form a baseline; its raw reward would be an unbaselined
    signal on a different scale from the rest of the batch. Elsewhere the two verl variants agree.
    """
    for case in verl_cases["adv_cases"]:
        mask = case["inputs"]["response_mask"]
        advantages, _ = LeaveOneOut()(_inputs(case))
        singleton = Groups(case["group_ids"]).count == 1  # [N]
        ref = case["results"]["rloo"]["advantages"]
        torch.testing.assert_close(advantages[~singleton], ref[~singleton], atol=1e-5, rtol=0)
        assert not advantages[singleton].any()
        scores = case["inputs"]["token_level_rewards"].sum(-1)
        torch.testing.assert_close(ref[singleton], scores[singleton, None] * mask[singleton])
    assert any((Groups(c["group_ids"]).count == 1).any() for c in verl_cases["adv_cases"])


# --- hand-worked examples -------------------------------------------------------------------------


def _outcome_inputs(scores, group_ids, lengths=None, **kwargs) -> AdvantageInputs:
    """One completion per row; ``lengths`` unmasked tokens each (default 2), T = max length."""
    scores = torch.tensor(scores)
    lengths = torch.tensor(lengths if lengths is not None else [2] * len(scores))
    mask = (torch.arange(int(lengths.max())) < lengths[:, None]).float()  # [N, T]
    return AdvantageInputs.from_scores(scores, mask, torch.tensor(group_ids), **kwargs)


def _per_row(advantages: torch.Tensor) -> torch.Tensor:
    """The row's (constant) advantage, read from its first token."""
    return advantages[:, 0]


def test_group_norm_hand_worked():
    """Group [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735 -> ±0.86603.
    The singleton (reward 3) uses mean 0, std 1 -> 3."""
    adv, ret = GroupNorm(eps=0.0)(_outcome_inputs([1.0, 0.0, 0.0, 1.0, 3.0], [0, 0, 0, 0, 1]))
    a = 0.5 / (1 / 3) ** 0.5
    torch.testing.assert_close(_per_row(adv), torch.tensor([a, -a, -a, a, 3.0]))
    torch.testing.assert_close(ret, adv)


def test_group_norm_all_equal_group_is_zero_even_without_eps():
    adv, _ = GroupNorm(eps=0.0)(_outcome_inputs([0.1, 0.1, 0.1], [0, 0, 0]))
    assert torch.isfinite(adv).all() and adv.abs().max() < 1e-5


def test_group_mean_hand_worked():
    """Group [1, 2, 6]: mean 3 -> [-2, -1, 3]; singleton 5 -> 5 (mean 0)."""
    adv, _ = GroupMean()(_outcome_inputs([1.0, 2.0, 6.0, 5.0], [4, 4, 4, 9]))
    torch.testing.assert_close(_per_row(adv), torch.tensor([-2.0, -1.0, 3.0, 5.0]))


def test_leave_one_out_hand_worked():
    """Group [1, 2, 6]: 1 - (2+6)/2 = -3, 2 - (1+6)/2 = -1.5, 6 - (1+2)/2 = 4.5; singleton 5 -> 0."""
    adv, ret = LeaveOneOut()(_outcome_inputs([1.0, 2.0, 6.0, 5.0], [4, 4, 4, 9]))
    torch.testing.assert_close(_per_row(adv), torch.tensor([-3.0, -1.5, 4.5, 0.0]))
    torch.testing.assert_close(ret, adv)


def test_greedy_baseline_hand_worked():
    """Token rewards [0, 1, 2], greedy reward 1: reward-to-go [3, 3, 2], advantage [2, 2, 1].
    Second row, a hole at t=1: rewards [1, (9), 2] -> returns [3, 0, 2], advantages [2, 0, 1]."""
    inputs = AdvantageInputs(
        token_rewards=torch.tensor([[0.0, 1.0, 2.0], [1.0, 9.0, 2.0]]),
        mask=torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 1.0]]),
        group_ids=torch.tensor([0, 1]),
        baselines=torch.tensor([1.0, 1.0]),
    )
    adv, ret = GreedyBaseline()(inputs)
    torch.testing.assert_close(ret, torch.tensor([[3.0, 3.0, 2.0], [3.0, 0.0, 2.0]]))
    torch.testing.assert_close(adv, torch.tensor([[2.0, 2.0, 1.0], [2.0, 0.0, 1.0]]))


def test_discounted_return_hand_worked():
    """gamma = 0.5, rewards [1, 0, (9 on a hole), 4]: the hole is skipped (no reward, no discount),
    G = [1 + 0.5*2, 0 + 0.5*4, -, 4] = [2, 2, 0, 4]; over the 3 valid tokens mean 8/3, unbiased var
    (4/9 + 4/9 + 16/9) / 2 = 4/3, so A = [-0.57735, -0.57735, 0, 1.15470]."""
    inputs = AdvantageInputs(
        token_rewards=torch.tensor([[1.0, 0.0, 9.0, 4.0]]),
        mask=torch.tensor([[1.0, 1.0, 0.0, 1.0]]),
        group_ids=torch.tensor([0]),
    )
    adv, ret = DiscountedReturn(gamma=0.5)(inputs)
    torch.testing.assert_close(ret, torch.tensor([[2.0, 2.0, 0.0, 4.0]]))
    s = (4 / 3) ** 0.5
    torch.testing.assert_close(adv, torch.tensor([[-2 / 3 / s, -2 / 3 / s, 0.0, 4 / 3 / s]]))


def test_group_mean_whitened_hand_worked():
    """Group [1, 3] -> [-1, 1]; lengths 1 and 3 give tokens [-1 | 1, 1, 1]: mean 0.5, unbiased var
    (2.25 + 3 * 0.25) / 3 = 1, so A = [-1.5 | 0.5, 0.5, 0.5]."""
    adv, ret = GroupMeanWhitened()(_outcome_inputs([1.0, 3.0], [0, 0], lengths=[1, 3]))
    torch.testing.assert_close(adv, torch.tensor([[-1.5, 0.0, 0.0], [0.5, 0.5, 0.5]]))
    torch.testing.assert_close(ret, adv)


def test_length_weighted_baseline_hand_worked():
    """Rewards [2, 6], lengths [1, 3]: b = (1*2 + 3*6) / 4 = 5, A = [-3, 1]; singleton 7 keeps 7."""
    adv, _ = LengthWeightedBaseline()(_outcome_inputs([2.0, 6.0, 7.0], [0, 0, 1], lengths=[1, 3, 2]))
    torch.testing.assert_close(_per_row(adv), torch.tensor([-3.0, 1.0, 7.0]))
    torch.testing.assert_close(adv[0], torch.tensor([-3.0, 0.0, 0.0]))


def test_gpg_hand_worked():
    """Groups [1, 0] and [0, 0]: 1 nonzero reward in N = 4, alpha = 4; centred [0.5, -0.5, 0, 0]
    -> A = [2, -2, 0, 0]."""
    adv, _ = GPGScaled()(_outcome_inputs([1.0, 0.0, 0.0, 0.0], [0, 0, 1, 1]))
    torch.testing.assert_close(_per_row(adv), torch.tensor([2.0, -2.0, 0.0, 0.0]))


def test_gae_hand_worked_with_hole():
    """gamma = lam = 0.5, rewards [0, 0, 1], values [1, 2, 3], plus a hole at t=2 (value 99, reward 5)
    that GAE skips: delta = [0 + 0.5*2 - 1, 0 + 0.5*3 - 2, 1 - 3] = [0, -0.5, -2],
    A = [0 + 0.25*(-1), -0.5 + 0.25*(-2), -2] = [-0.25, -1, -2], returns A + V = [0.75, 1, 1]."""
    inputs = AdvantageInputs(
        token_rewards=torch.tensor([[0.0, 0.0, 5.0, 1.0]]),
        mask=torch.tensor([[1.0, 1.0, 0.0, 1.0]]),
        group_ids=torch.tensor([0]),
        values=torch.tensor([[1.0, 2.0, 99.0, 3.0]]),
    )
    adv, ret = GAE(gamma=0.5, lam=0.5, whiten=False)(inputs)
    torch.testing.assert_close(adv, torch.tensor([[-0.25, -1.0, 0.0, -2.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.75, 1.0, 0.0, 1.0]]))
    # Whitened: [-0.25, -1, -2] has mean -13/12 and unbiased var 0.77083 (worked by the definition).
    whitened, same_returns = GAE(gamma=0.5, lam=0.5)(inputs)
    valid = torch.tensor([-0.25, -1.0, -2.0])
    expected = (valid - valid.mean()) / valid.std()
    torch.testing.assert_close(whitened[0, [0, 1, 3]], expected)
    torch.testing.assert_close(same_returns, ret)


def test_gae_lam_zero_is_one_step_td():
    """lam = 0: A_t = r_t + gamma V_{t+1} - V_t exactly (no whitening)."""
    g = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    inputs = AdvantageInputs(rewards, torch.ones(3, 5), torch.arange(3), values=values)
    adv, _ = GAE(gamma=0.9, lam=0.0, whiten=False)(inputs)
    next_values = torch.cat([values[:, 1:], torch.zeros(3, 1)], dim=1)
    torch.testing.assert_close(adv, rewards + 0.9 * next_values - values)


def test_pass_at_k_hand_worked():
    """Group [1, 0, 0, 0]: best 1, second 0, unbiased std 0.5 -> A = [2, 0, 0, 0] ([1, 0, 0, 0] without
    the std). Group [1, 1, 0] ties for the best -> all 0. Group [3, 5]: std sqrt(2) -> [0, 2/sqrt(2)]."""
    inputs = _outcome_inputs([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 3.0, 5.0], [0, 0, 0, 0, 1, 1, 1, 2, 2])
    adv, ret = PassAtK(eps=0.0)(inputs)
    torch.testing.assert_close(_per_row(adv), torch.tensor([2.0, 0, 0, 0, 0, 0, 0, 0, 2 / 2**0.5]))
    torch.testing.assert_close(ret, adv)
    adv, _ = PassAtK(normalize_std=False)(inputs)
    torch.testing.assert_close(_per_row(adv), torch.tensor([1.0, 0, 0, 0, 0, 0, 0, 0, 2.0]))


def test_gdpo_hand_worked():
    """Format [1, 1, 0, 0] and accuracy [1, 0, 1, 0] each normalise to +-0.866 (std 0.57735); the sum
    [1.732, 0, 0, -1.732] whitens (one token per row: mean 0, unbiased var 2) to [1.2247, 0, 0, -1.2247].
    Weights [1, 0] keep the format term only: +-0.866 whitens to +-0.866 (var 1)."""
    inputs = _outcome_inputs([2.0, 1.0, 1.0, 0.0], [0, 0, 0, 0], lengths=[1, 1, 1, 1])
    inputs.reward_terms = torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
    adv, ret = GDPO(eps=0.0)(inputs)
    torch.testing.assert_close(_per_row(adv), torch.tensor([1.5**0.5, 0.0, 0.0, -(1.5**0.5)]), atol=1e-5, rtol=0)
    torch.testing.assert_close(ret, adv)
    adv, _ = GDPO(weights=[1.0, 0.0], eps=0.0)(inputs)
    a = 0.75**0.5
    torch.testing.assert_close(_per_row(adv), torch.tensor([a, a, -a, -a]), atol=1e-5, rtol=0)
    # a reward function that does not apply (NaN) counts as 0, as in the weighted total: row 3's accuracy
    # was 0 already, so the advantages are those above
    inputs.reward_terms[3, 1] = torch.nan
    adv, _ = GDPO(eps=0.0)(inputs)
    torch.testing.assert_close(_per_row(adv), torch.tensor([1.5**0.5, 0.0, 0.0, -(1.5**0.5)]), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="2 weights for 3 reward functions"):
        GDPO(weights=[1.0, 1.0])(
            AdvantageInputs.from_scores(
                torch.ones(2), torch.ones(2, 1), torch.zeros(2, dtype=torch.long), reward_terms=torch.ones(2, 3)
            )
        )


def _otb_inputs(rewards, mask, group_ids, energy=1.0):
    """Each valid token's energy 1 - 2 pi + sum pi^2 = ``energy`` (pi = 0.25, sum pi^2 = energy - 0.5)."""
    rewards, mask = torch.tensor(rewards), torch.tensor(mask)
    return AdvantageInputs(
        token_rewards=rewards,
        mask=mask,
        group_ids=torch.tensor(group_ids),
        old_log_probs=torch.full_like(mask, math.log(0.25)),
        sum_pi_squared=torch.full_like(mask, energy - 0.5),
    )


def test_optimal_token_baseline_hand_worked():
    """Row a: 3 tokens, reward 1 at the end; row b: 1 token, reward 0; every energy 1, so W = [1, 2, 3]
    and [1]. Position 0: B = (1 * 1 + 0 * 1) / 2 = 0.5. Positions 1-2 hold row a alone: B = G = 1, so
    A = 0 there; with the zero tail (past row b's end, row a has no peer) B = 0 and A = G = 1."""
    inputs = _otb_inputs([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]], [[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]], [0, 0])
    adv, ret = OptimalTokenBaseline(handle_zero_tail=False, eps=0.0)(inputs)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.0, 0.0], [-0.5, 0.0, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    adv, _ = OptimalTokenBaseline(eps=0.0)(inputs)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 1.0, 1.0], [-0.5, 0.0, 0.0]]))
    alone, _ = OptimalTokenBaseline()(_otb_inputs([[0.0, 2.0]], [[1.0, 1.0]], [3]))  # a single completion
    torch.testing.assert_close(alone, torch.tensor([[2.0, 2.0]]))


def test_multi_turn_optimal_token_baseline_aligns_valid_tokens():
    """Row a = [tok, (tool output), tok] with reward 1, row b = [tok, tok, pad] with reward 0; energy 1.
    By column (OptimalTokenBaseline): column 0 B = 0.5; column 2 holds row a alone (W = 2): B = 1, A = 0.
    By valid token (multi-turn): a's 2nd token meets b's 2nd token, both W = 2: B = 0.5, A = 0.5."""
    inputs = _otb_inputs([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]], [[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]], [0, 0])
    by_column, _ = OptimalTokenBaseline(eps=0.0)(inputs)
    torch.testing.assert_close(by_column, torch.tensor([[0.5, 0.0, 0.0], [-0.5, 0.0, 0.0]]))
    by_token, ret = MultiTurnOptimalTokenBaseline(eps=0.0)(inputs)
    torch.testing.assert_close(by_token, torch.tensor([[0.5, 0.0, 0.5], [-0.5, -0.5, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0]]))


def test_optimal_token_baseline_is_weights_scale_the_energy():
    """use_is_weights: each token's energy times rho^2. Row a's weight 2 (energy 4) against row b's 1:
    B = (1 * 4 + 0 * 1) / 5 = 0.8 at the single position."""
    inputs = _otb_inputs([[1.0], [0.0]], [[1.0], [1.0]], [0, 0])
    inputs.is_weights = torch.tensor([[2.0], [1.0]])
    adv, _ = OptimalTokenBaseline(use_is_weights=True, eps=0.0)(inputs)
    torch.testing.assert_close(adv, torch.tensor([[0.2], [-0.8]]))


# --- invariants ------------------------------------------------------------------------------------

ALL = [
    GroupNorm(),
    GroupMean(),
    LeaveOneOut(),
    GreedyBaseline(),
    DiscountedReturn(gamma=0.9),
    GroupMeanWhitened(),
    LengthWeightedBaseline(),
    GPGScaled(),
    GAE(gamma=0.99, lam=0.95),
    PassAtK(),
    PassAtK(normalize_std=False),
    GDPO(weights=[1.0, 0.5]),
    OptimalTokenBaseline(),
    OptimalTokenBaseline(handle_zero_tail=False, use_is_weights=True),
    MultiTurnOptimalTokenBaseline(),
    MultiTurnOptimalTokenBaseline(handle_zero_tail=False, use_is_weights=True),
]
IDS = [f"{type(e).__name__}{i}" for i, e in enumerate(ALL)]


def _random_inputs(seed: int = 0, groups: int = 5, smallest: int = 1) -> AdvantageInputs:
    """Mixed group sizes (``smallest``..4), interleaved rows, ragged masks with a hole, dense-ish rewards."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.arange(groups) % (5 - smallest) + smallest  # [G]
    group_ids = torch.repeat_interleave(torch.arange(groups), sizes)  # [N]
    group_ids = group_ids[torch.randperm(len(group_ids), generator=g)]
    n, t = len(group_ids), 7
    lengths = torch.randint(2, t + 1, (n,), generator=g)  # [N]
    mask = (torch.arange(t) < lengths[:, None]).float()  # [N, T]
    mask[::3, 1] = 0.0  # holes
    rewards = torch.randn(n, t, generator=g) * mask  # [N, T]
    return AdvantageInputs(
        token_rewards=rewards,
        mask=mask,
        group_ids=group_ids,
        values=torch.randn(n, t, generator=g),
        baselines=torch.randn(n, generator=g),
        reward_terms=torch.randint(0, 2, (n, 2), generator=g).float(),
        old_log_probs=-torch.rand(n, t, generator=g) * 3,
        sum_pi_squared=torch.rand(n, t, generator=g),
        is_weights=torch.rand(n, t, generator=g) + 0.5,
    )


def _smallest(estimator: Advantage) -> int:
    return 2 if isinstance(estimator, PassAtK) else 1  # pass@k needs two completions per prompt


def _take_rows(inputs: AdvantageInputs, rows: torch.Tensor, group_ids=None) -> AdvantageInputs:
    return AdvantageInputs(
        token_rewards=inputs.token_rewards[rows],
        mask=inputs.mask[rows],
        group_ids=inputs.group_ids[rows] if group_ids is None else group_ids,
        values=inputs.values[rows],
        baselines=inputs.baselines[rows],
        reward_terms=inputs.reward_terms[rows],
        old_log_probs=inputs.old_log_probs[rows],
        sum_pi_squared=inputs.sum_pi_squared[rows],
        is_weights=inputs.is_weights[rows],
    )


@pytest.mark.parametrize("estimator", ALL, ids=IDS)
def test_permuting_rows_permutes_advantages(estimator):
    inputs = _random_inputs(smallest=_smallest(estimator))
    perm = torch.randperm(len(inputs.group_ids), generator=torch.Generator().manual_seed(1))
    adv, ret = estimator(inputs)
    adv_p, ret_p = estimator(_take_rows(inputs, perm))
    torch.testing.assert_close(adv_p, adv[perm])
    torch.testing.assert_close(ret_p, ret[perm])


@pytest.mark.parametrize("estimator", ALL, ids=IDS)
def test_group_ids_are_labels_only(estimator):
    inputs = _random_inputs(smallest=_smallest(estimator))
    labels = torch.tensor([7, 100, -3, 2**40, 5])  # arbitrary int64, out of order
    relabelled = _take_rows(inputs, torch.arange(len(inputs.group_ids)), labels[inputs.group_ids])
    for got, want in zip(estimator(relabelled), estimator(inputs), strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("estimator", ALL, ids=IDS)
def test_outputs_are_zero_outside_mask_and_accept_bool_mask(estimator):
    inputs = _random_inputs(smallest=_smallest(estimator))
    adv, ret = estimator(inputs)
    outside = inputs.mask == 0
    assert not adv[outside].any() and not ret[outside].any()
    as_bool = _take_rows(inputs, torch.arange(len(inputs.group_ids)))
    as_bool.mask = inputs.mask.bool()
    for got, want in zip(estimator(as_bool), (adv, ret), strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("estimator", [LeaveOneOut(), GroupMean(), LengthWeightedBaseline()], ids=str)
def test_group_advantages_sum_to_zero(estimator):
    """Each baseline is a (weighted) group mean: Σ_i A_i (weighted by length for OPO) is 0 per
    group of 2 or more (RLOO: Σ_i (r_i - (S - r_i)/(n-1)) = S - (nS - S)/(n-1) = 0)."""
    inputs = _random_inputs(groups=8)
    adv, _ = estimator(inputs)
    groups = Groups(inputs.group_ids)
    per_row = adv.sum(-1) if isinstance(estimator, LengthWeightedBaseline) else adv[:, 0]  # [N]
    sums = groups.sum(per_row)[groups.count > 1]
    torch.testing.assert_close(sums, torch.zeros_like(sums), atol=1e-5, rtol=0)


class _CountTorchCalls(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("estimator", ALL, ids=IDS)
def test_no_python_loop_over_groups(estimator):
    """The number of torch calls does not grow with the number of groups (same N and T)."""

    def count(group_ids):
        g = torch.Generator().manual_seed(0)
        n, t = len(group_ids), 6
        inputs = AdvantageInputs(
            token_rewards=torch.randn(n, t, generator=g),
            mask=torch.ones(n, t),
            group_ids=group_ids,
            values=torch.randn(n, t, generator=g),
            baselines=torch.randn(n, generator=g),
            reward_terms=torch.randn(n, 2, generator=g),
            old_log_probs=-torch.rand(n, t, generator=g),
            sum_pi_squared=torch.rand(n, t, generator=g),
            is_weights=torch.rand(n, t, generator=g),
        )
        with _CountTorchCalls() as counter:
            estimator(inputs)
        return counter.calls

    n = 64
    assert count(torch.arange(n) // 32) == count(torch.arange(n) // 2)  # 2 groups vs 32 groups


# --- validation ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: GroupNorm(eps=-1e-6), "eps must be >= 0"),
        (lambda: DiscountedReturn(gamma=1.5), r"gamma must lie in \[0, 1\].*gamma=1.0"),
        (lambda: DiscountedReturn(gamma=-0.1), r"gamma must lie in \[0, 1\]"),
        (lambda: GAE(gamma=2.0), r"GAE: gamma must lie in \[0, 1\]"),
        (lambda: GAE(lam=-0.5), r"GAE: lam must lie in \[0, 1\].*lam=1.0"),
        (lambda: GAE(lam=1.01), r"lam must lie in \[0, 1\]"),
        (lambda: PassAtK(eps=-1.0), "eps must be >= 0"),
        (lambda: GDPO(eps=-1.0), "eps must be >= 0"),
        (lambda: OptimalTokenBaseline(eps=-1.0), "eps must be >= 0"),
    ],
)
def test_bad_hyper_parameters_raise(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_boundary_hyper_parameters_are_accepted():
    GroupNorm(eps=0.0), DiscountedReturn(gamma=0.0), GAE(gamma=0.0, lam=0.0), GAE(gamma=1.0, lam=1.0)


def test_missing_inputs_raise_naming_estimator_and_fix():
    inputs = _outcome_inputs([1.0, 0.0], [0, 0])
    with pytest.raises(ValueError, match=r"GAE needs AdvantageInputs.values.*critic"):
        GAE()(inputs)
    with pytest.raises(ValueError, match=r"GreedyBaseline \(ReMax\) needs AdvantageInputs.baselines.*greedy"):
        GreedyBaseline()(inputs)
    expected = {
        GAE: {Need.VALUES},
        GreedyBaseline: {Need.GREEDY_BASELINES},
        GDPO: {Need.REWARD_TERMS},
        OptimalTokenBaseline: {Need.OLD_LOGPROBS, Need.SUM_PI_SQUARED},
        MultiTurnOptimalTokenBaseline: {Need.OLD_LOGPROBS, Need.SUM_PI_SQUARED},
    }
    for estimator in ALL:
        wanted = set(expected.get(type(estimator), set()))
        if getattr(estimator, "use_is_weights", False):
            wanted.add(Need.IS_WEIGHTS)
        assert set(estimator.needs) == wanted, type(estimator).__name__
    with pytest.raises(ValueError, match=r"GDPO needs AdvantageInputs.reward_terms.*\[N, K\]"):
        GDPO()(inputs)
    with pytest.raises(ValueError, match=r"OptimalTokenBaseline needs AdvantageInputs.old_log_probs"):
        OptimalTokenBaseline()(inputs)
    inputs.old_log_probs = inputs.sum_pi_squared = torch.zeros_like(inputs.mask)
    with pytest.raises(ValueError, match=r"needs AdvantageInputs.is_weights.*rollout correction"):
        MultiTurnOptimalTokenBaseline(use_is_weights=True)(inputs)


@pytest.mark.parametrize("group_ids", [torch.tensor([0.0, 1.0]), torch.tensor([[0, 1]])], ids=["float", "2d"])
def test_bad_group_ids_raise(group_ids):
    with pytest.raises(ValueError, match="group_ids must be"):
        Groups(group_ids)


def test_groups_statistics_hand_worked():
    """ids [7, 3, 7, 7, 100] -> groups {7: [1, 2, 6]}, {3: [4]}, {100: [5]}:
    count [3, 1, 3, 3, 1]; mean 3 for group 7; unbiased std sqrt((4 + 1 + 9) / 2) = sqrt(7);
    leave-one-out of 1 is (2 + 6)/2 = 4, of 2 is 3.5, of 6 is 1.5; singletons 0 (std and LOO)."""
    groups = Groups(torch.tensor([7, 3, 7, 7, 100]))
    x = torch.tensor([1.0, 4.0, 2.0, 6.0, 5.0])
    assert groups.count.tolist() == [3, 1, 3, 3, 1]
    torch.testing.assert_close(groups.mean(x), torch.tensor([3.0, 4.0, 3.0, 3.0, 5.0]))
    s7 = 7**0.5
    torch.testing.assert_close(groups.std(x), torch.tensor([s7, 0.0, s7, s7, 0.0]))
    torch.testing.assert_close(groups.leave_one_out_mean(x), torch.tensor([4.0, 0.0, 3.5, 1.5, 0.0]))
    w = torch.tensor([1.0, 2.0, 1.0, 2.0, 0.0])  # group 7: (1 + 2 + 12) / 4 = 3.75; group 100: 0/0 -> 0
    torch.testing.assert_close(groups.weighted_mean(x, w), torch.tensor([3.75, 4.0, 3.75, 3.75, 0.0]))
