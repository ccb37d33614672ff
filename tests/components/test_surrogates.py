"""The surrogates beyond PPO's clip: hand-worked numbers, gradients and invariants.

CISPO, SAPO, DRO, DPPO (binary TV / binary KL), GMPO, Clip-Cov, KL-Cov. Their verl numbers are in
``test_policy_loss_reference.py``; here each formula is worked by hand.
"""

import math

import pytest
import torch

from rlkit.components.aggregation import SeqMeanTokenMean, StepTotals, TokenMean
from rlkit.components.clip import CISPO, DRO, SAPO, ClipInputs, NoClip, PPOClip
from rlkit.components.covariance import ClipCov, KLCov
from rlkit.components.dppo import DPPOBinaryKL, DPPOBinaryTV
from rlkit.components.gmpo import GMPO
from rlkit.components.ratio import LogProb, SequenceRatio, TokenRatio

F64 = torch.float64


def _t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


def _from_log_probs(log_prob, old, adv, mask=None, ratio=None) -> tuple[ClipInputs, torch.Tensor]:
    """ClipInputs built as the caller does: the ratio from the log-probs; ``log_prob`` requires grad."""
    log_prob = _t(log_prob).requires_grad_()
    old, adv = _t(old), _t(adv)
    mask = torch.ones_like(adv) if mask is None else _t(mask)
    ratio = (ratio or TokenRatio())(log_prob, old, mask)
    return ClipInputs(ratio=ratio, log_prob=log_prob, old_log_prob=old, advantages=adv, mask=mask), log_prob


def _grad(loss_mat: torch.Tensor, leaf: torch.Tensor) -> list:
    return torch.autograd.grad(loss_mat.sum(), leaf)[0][0].tolist()


def test_cispo_hand_worked():
    """eps 0.2: ratios [1.5, 0.5, 1.0] -> weights [1.2, 0.8, 1.0]; log pi [-0.5, -1, -2], A [1, -1, 2]:
    loss -w A log pi = [0.6, -0.8, 4]; gradient -w A = [-1.2, 0.8, -2] on every token (none zeroed);
    no gradient through the weight."""
    log_pi = [[-0.5, -1.0, -2.0]]
    old = [[-0.5 - math.log(1.5), -1.0 - math.log(0.5), -2.0]]
    inputs, leaf = _from_log_probs(log_pi, old, [[1.0, -1.0, 2.0]])
    out = CISPO(0.2, 0.2)(inputs)
    assert out.loss[0].tolist() == pytest.approx([0.6, -0.8, 4.0])
    assert _grad(out.loss, leaf) == pytest.approx([-1.2, 0.8, -2.0])
    assert out.clipped["fraction"][0].tolist() == [True, True, False]
    assert out.clipped["upper"][0].tolist() == [True, False, False]
    assert out.clipped["lower"][0].tolist() == [False, True, False]
    loose, _ = _from_log_probs(log_pi, old, [[1.0, -1.0, 2.0]])
    assert CISPO(10.0, 0.2)(loose).loss[0, 1].item() == pytest.approx(-0.5)  # no lower bound: w = 0.5


def test_cispo_on_policy_gradient_is_the_policy_gradient():
    """r = 1 inside the range: CISPO's gradient is -A grad log pi, as NoClip with TokenRatio."""
    gen = torch.Generator().manual_seed(3)
    log_prob = torch.randn(4, 5, generator=gen, dtype=F64)
    adv = torch.randn(4, 5, generator=gen, dtype=F64)
    grads = []
    for clip in (CISPO(), NoClip()):
        leaf = log_prob.clone().requires_grad_()
        inputs = ClipInputs(TokenRatio()(leaf, log_prob, torch.ones(4, 5)), leaf, log_prob, adv, torch.ones(4, 5))
        grads.append(torch.autograd.grad(TokenMean()(clip(inputs).loss, torch.ones(4, 5)), leaf)[0])
    torch.testing.assert_close(grads[0], grads[1])


def test_sapo_hand_worked():
    """f(r) = (4/tau) sigmoid(tau (r - 1)). r = 1: f = 2/tau, f' = 1 (plain policy gradient).
    r = 2, tau_pos = 1, A = 1: loss -4 sigmoid(1) = -2.924234; A = -1 uses tau_neg = 1.05: at r = 1
    the loss is +2/1.05 = 1.904762 with gradient d/dr = -A = 1."""
    ratio = _t([[1.0, 2.0, 1.0]]).requires_grad_()
    out = SAPO(1.0, 1.05)(ClipInputs(ratio, ratio, ratio.detach(), _t([[1.0, 1.0, -1.0]]), torch.ones(1, 3)))
    assert out.loss[0].tolist() == pytest.approx([-2.0, -4.0 / (1.0 + math.exp(-1.0)), 2.0 / 1.05])
    s = 1.0 / (1.0 + math.exp(-1.0))
    assert _grad(out.loss, ratio) == pytest.approx([-1.0, -4.0 * s * (1 - s), 1.0])
    assert not out.clipped["fraction"].any()


def test_dro_hand_worked():
    """LogProb ratio (verl's dro), beta 0.5: log pi = -1, log pi_old = -1.5, A = 2:
    loss = -2 * (-1) + 0.25 * 0.5^2 = 2.0625; gradient -A + beta (log pi - log pi_old) = -1.75.
    With TokenRatio: -A r + penalty, r = e^0.5."""
    inputs, leaf = _from_log_probs([[-1.0]], [[-1.5]], [[2.0]], ratio=LogProb())
    out = DRO(0.5)(inputs)
    assert out.loss.item() == pytest.approx(2.0625)
    assert _grad(out.loss, leaf) == pytest.approx([-1.75])
    inputs, leaf = _from_log_probs([[-1.0]], [[-1.5]], [[2.0]])
    assert DRO(0.5)(inputs).loss.item() == pytest.approx(-2.0 * math.exp(0.5) + 0.0625)


def test_dppo_binary_tv_hand_worked():
    """p_old = 0.5 everywhere, eps 0.2, truncation 3. A > 0: p = 0.8 moved up 0.3 > 0.2 -> dropped;
    p = 0.6 stays (weight r = 1.2, loss -1.2 log 0.6). A < 0: p = 0.2 moved down 0.3 -> dropped;
    p = 0.45 stays (r = 0.9, loss +0.9 log 0.45); p = 0.9 with A < 0 stays (it moved against its push)."""
    p = [0.8, 0.6, 0.2, 0.45, 0.9]
    adv = [[1.0, 1.0, -1.0, -1.0, -1.0]]
    inputs, leaf = _from_log_probs([[math.log(x) for x in p]], [[math.log(0.5)] * 5], adv)
    out = DPPOBinaryTV(0.2, 0.2, truncation=3.0)(inputs)
    expected = [0.0, -1.2 * math.log(0.6), 0.0, 0.9 * math.log(0.45), 1.8 * math.log(0.9)]
    assert out.loss[0].tolist() == pytest.approx(expected)
    assert _grad(out.loss, leaf) == pytest.approx([0.0, -1.2, 0.0, 0.9, 1.8])  # -A w on kept tokens
    assert out.clipped["fraction"][0].tolist() == [True, False, True, False, False]
    assert out.clipped["upper"][0].tolist() == [True, False, False, False, False]
    assert out.clipped["lower"][0].tolist() == [False, False, True, False, False]
    assert not out.clipped["truncated"].any()
    capped = DPPOBinaryTV(0.2, 0.2, truncation=1.5)(inputs)  # r = 1.8 on the last token -> 1.5
    assert capped.loss[0, 4].item() == pytest.approx(1.5 * math.log(0.9))
    assert capped.clipped["truncated"][0].tolist() == [False, False, False, False, True]


def test_dppo_binary_kl_hand_worked():
    """p_old = 0.5. p = 0.8: kl = 0.5 ln(0.5/0.8) + 0.5 ln(0.5/0.2) = 0.223144 > 0.2 -> with A > 0
    dropped, with eps_high 0.25 kept. p = 0.3 with A > 0 moved down: kept whatever its KL."""
    kl = 0.5 * math.log(0.5 / 0.8) + 0.5 * math.log(0.5 / 0.2)
    assert kl == pytest.approx(0.223144, abs=1e-6)
    inputs, _ = _from_log_probs([[math.log(0.8), math.log(0.3)]], [[math.log(0.5)] * 2], [[1.0, 1.0]])
    out = DPPOBinaryKL(0.2, 0.2)(inputs)
    assert out.clipped["fraction"][0].tolist() == [True, False]
    assert out.loss[0, 0].item() == 0.0 and out.loss[0, 1].item() == pytest.approx(-0.6 * math.log(0.3))
    assert not DPPOBinaryKL(0.2, 0.25)(inputs).clipped["fraction"].any()
    negative, _ = _from_log_probs([[math.log(0.2)]], [[math.log(0.5)]], [[-1.0]])  # kl(0.5 -> 0.2) = 0.223
    assert DPPOBinaryKL(0.2, 0.2)(negative).clipped["lower"].all()


def test_gmpo_hand_worked():
    """One row, log-ratios [0.1, 0.6], eps 0.4. A = +1: the ceiling clips 0.6 -> 0.4, mean 0.25,
    loss -e^0.25 with gradient -e^0.25 / 2 on the first token, 0 on the clipped one.
    A = -1: the ceiling does not apply (pessimistic side), mean 0.35, loss +e^0.35, gradient e^0.35/2."""
    inputs, leaf = _from_log_probs([[0.1, 0.6]], [[0.0, 0.0]], [[1.0, 1.0]])
    loss = SeqMeanTokenMean()(GMPO(0.4, 0.4)(inputs).loss, inputs.mask)
    assert loss.item() == pytest.approx(-math.exp(0.25))
    assert torch.autograd.grad(loss, leaf)[0][0].tolist() == pytest.approx([-math.exp(0.25) / 2, 0.0])
    inputs, leaf = _from_log_probs([[0.1, 0.6]], [[0.0, 0.0]], [[-1.0, -1.0]])
    out = GMPO(0.4, 0.4)(inputs)
    loss = SeqMeanTokenMean()(out.loss, inputs.mask)
    assert loss.item() == pytest.approx(math.exp(0.35))
    assert torch.autograd.grad(loss, leaf)[0][0].tolist() == pytest.approx([math.exp(0.35) / 2] * 2)
    # as verl's metric, "lower" counts A < 0 tokens outside the range, even where the min kept them
    assert out.clipped["lower"][0].tolist() == [False, True]
    assert GMPO(0.4, 0.4)(_from_log_probs([[0.1, 0.6]], [[0.0, 0.0]], [[1.0, 1.0]])[0]).clipped["upper"][
        0
    ].tolist() == [False, True]


def test_gmpo_gradient_is_the_sequence_objective():
    """Token form + SeqMeanTokenMean == (1/N) sum_i -A_i exp(mean_t c_t) computed directly."""
    gen = torch.Generator().manual_seed(4)
    n, t = 5, 6
    log_prob = (-torch.rand(n, t, generator=gen, dtype=F64)).requires_grad_()
    old = log_prob.detach() + 0.5 * torch.randn(n, t, generator=gen, dtype=F64)
    lengths = torch.tensor([6, 3, 1, 5, 2])
    mask = (torch.arange(t) < lengths[:, None]).to(F64)
    adv_seq = torch.randn(n, generator=gen, dtype=F64)
    adv = adv_seq[:, None].expand(n, t)
    inputs = ClipInputs(TokenRatio()(log_prob, old, mask), log_prob, old, adv, mask)
    token_form = SeqMeanTokenMean()(GMPO(0.2, 0.3)(inputs).loss, mask)
    (grad_token,) = torch.autograd.grad(token_form, log_prob)
    lr = log_prob - old
    sign = torch.sign(adv)
    c = sign * torch.minimum(sign * lr, sign * lr.clamp(-0.2, 0.3))
    direct = (-adv_seq * torch.exp((c * mask).sum(-1) / lengths)).mean()
    (grad_direct,) = torch.autograd.grad(direct, log_prob)
    torch.testing.assert_close(token_form, direct)
    torch.testing.assert_close(grad_token, grad_direct)
    assert (grad_token == 0).any() and grad_token.abs().sum() > 0  # some tokens were clipped


# covariance: A = [2, 0, 0, -1], log pi = [0, -1, -1, -2] -> means 0.25 and -1,
# cov = [1.75 * 1, -0.25 * 0, -0.25 * 0, -1.25 * -1] = [1.75, 0, 0, 1.25]
COV_ADV = [[2.0, 0.0, 0.0, -1.0]]
COV_LOGP = [[0.0, -1.0, -1.0, -2.0]]


def test_kl_cov_hand_worked():
    """select_fraction 0.25 of 4 tokens -> the top 1 by covariance: token 0 (1.75) gets coef |log r|."""
    inputs, _ = _from_log_probs(COV_LOGP, [[-0.5, -1.0, -1.0, -2.0]], COV_ADV, ratio=TokenRatio(None))
    clip = KLCov(select_fraction=0.25, coef=0.1)
    assert clip.select(inputs)[0].tolist() == [True, False, False, False]
    out = clip(inputs)
    expected = [-2.0 * math.exp(0.5) + 0.1 * 0.5, 0.0, 0.0, 1.0]
    assert out.loss[0].tolist() == pytest.approx(expected)
    assert KLCov(select_fraction=0.5).select(inputs)[0].tolist() == [True, False, False, True]


def test_clip_cov_hand_worked():
    """On-policy, no PPO clip. Candidates 1 < cov < 5: tokens 0 (1.75) and 3 (1.25); select_fraction 0.25
    draws 1 of them, which leaves the loss. cov_lower 1.5 leaves token 0 as the only candidate."""
    inputs, _ = _from_log_probs(COV_LOGP, COV_LOGP, COV_ADV, ratio=TokenRatio(None))
    out = ClipCov(select_fraction=0.25)(inputs)
    chosen = out.clipped["selected"][0].tolist()
    assert sum(chosen) == 1 and (chosen[0] or chosen[3])
    kept = [-a for a in COV_ADV[0]]  # -A r with r = 1
    assert out.loss[0].tolist() == pytest.approx([0.0 if c else k for c, k in zip(chosen, kept, strict=True)])
    only = ClipCov(select_fraction=0.25, cov_lower=1.5)(inputs)
    assert only.clipped["selected"][0].tolist() == [True, False, False, False]
    # the draw follows the generator: both candidates come up over a few seeds
    picks = {tuple(ClipCov(select_fraction=0.25, seed=s).select(inputs)[0].tolist()) for s in range(20)}
    assert picks == {(True, False, False, False), (False, False, False, True)}


def test_clip_cov_excludes_tokens_ppo_already_clipped():
    """Token 0 (cov 1.75) has r = 2 with A > 0: PPO clips it, so it is no candidate; token 3 is chosen."""
    inputs, _ = _from_log_probs(COV_LOGP, [[-math.log(2.0), -1.0, -1.0, -2.0]], COV_ADV, ratio=TokenRatio(None))
    out = ClipCov(select_fraction=0.25)(inputs)
    assert out.clipped["fraction"][0].tolist() == [True, False, False, False]
    assert out.clipped["selected"][0].tolist() == [False, False, False, True]


@pytest.mark.parametrize("clip", [ClipCov(select_fraction=0.3, cov_lower=0.0), KLCov(select_fraction=0.3)], ids=repr)
def test_selection_over_the_step_makes_micro_batches_exact(clip):
    """select() on the whole step, sliced per micro-batch, sums to the whole step's loss and gradient;
    selecting inside each micro-batch (verl's behaviour) does not."""
    gen = torch.Generator().manual_seed(5)
    n, t = 6, 5
    log_prob = (-torch.rand(n, t, generator=gen, dtype=F64) * 2).requires_grad_()
    old = log_prob.detach() + 0.1 * torch.randn(n, t, generator=gen, dtype=F64)
    adv = torch.randn(n, 1, generator=gen, dtype=F64).expand(n, t) * 2
    mask = (torch.rand(n, t, generator=gen) > 0.2).to(F64)
    ratio = TokenRatio()

    def loss_of(rows, totals, selected):
        inputs = ClipInputs(
            ratio(log_prob[rows], old[rows], mask[rows]),
            log_prob[rows],
            old[rows],
            adv[rows],
            mask[rows],
            None if selected is None else selected[rows],
        )
        return TokenMean()(clip(inputs).loss, mask[rows], totals)

    whole = loss_of(slice(None), None, None)
    (whole_grad,) = torch.autograd.grad(whole, log_prob)
    step = ClipInputs(ratio(log_prob, old, mask).detach(), log_prob.detach(), old, adv, mask)
    selected = clip.select(step)
    splits = [slice(0, 2), slice(2, 3), slice(3, 6)]
    totals = StepTotals.from_masks([mask[s] for s in splits])
    micro = sum(loss_of(s, totals, selected) for s in splits)
    torch.testing.assert_close(micro, whole)
    torch.testing.assert_close(torch.autograd.grad(micro, log_prob)[0], whole_grad)
    local = sum(loss_of(s, totals, None) for s in splits)
    assert not torch.allclose(local, whole)


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda: CISPO(eps_low=0.0), "eps_low"),
        (lambda: CISPO(eps_high=-1.0), "eps_high"),
        (lambda: SAPO(tau_pos=0.0), "tau_pos"),
        (lambda: SAPO(tau_neg=-1.0), "tau_neg"),
        (lambda: DRO(beta=0.0), "beta"),
        (lambda: DPPOBinaryTV(eps_low=0.0), "eps_low"),
        (lambda: DPPOBinaryKL(truncation=0.0), "truncation"),
        (lambda: GMPO(eps_high=0.0), "eps_high"),
        (lambda: ClipCov(eps_low=1.0), "eps_low"),
        (lambda: ClipCov(select_fraction=0.0), "select_fraction"),
        (lambda: ClipCov(cov_lower=5.0, cov_upper=1.0), "cov_lower"),
        (lambda: KLCov(select_fraction=1.5), "select_fraction"),
        (lambda: KLCov(coef=-0.1), "coef"),
    ],
)
def test_bad_hyper_parameters_raise(make, words):
    with pytest.raises(ValueError, match=words):
        make()


@pytest.mark.parametrize(
    "clip",
    [CISPO(), SAPO(), DRO(), DPPOBinaryTV(), DPPOBinaryKL(), GMPO(), ClipCov(), KLCov(), PPOClip(0.2), NoClip()],
    ids=lambda c: type(c).__name__,
)
@pytest.mark.parametrize("ratio_cls", [TokenRatio, SequenceRatio])
def test_every_surrogate_is_finite_with_empty_rows_and_masks_its_metrics(clip, ratio_cls):
    gen = torch.Generator().manual_seed(6)
    log_prob = -torch.rand(4, 5, generator=gen)
    old = log_prob + 0.3 * torch.randn(4, 5, generator=gen)
    mask = torch.ones(4, 5)
    mask[1] = 0.0
    mask[2, 3:] = 0.0
    adv = torch.randn(4, 5, generator=gen)
    out = clip(ClipInputs(ratio_cls()(log_prob, old, mask), log_prob, old, adv, mask))
    assert torch.isfinite(out.loss).all()
    assert all(not (where & ~mask.bool()).any() for where in out.clipped.values())
