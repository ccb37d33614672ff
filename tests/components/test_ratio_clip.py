"""Ratios and clips: hand-worked numbers, on-policy invariants, GSPO's sequence-level gradient."""

import math

import pytest
import torch

from rlkit.components.aggregation import SeqMeanTokenMean, TokenMean
from rlkit.components.clip import ClipInputs, NoClip, PPOClip
from rlkit.components.ratio import LogProb, SequenceRatio, TokenRatio


def _inputs(ratio, advantages, mask=None, log_prob=None, old_log_prob=None) -> ClipInputs:
    """ClipInputs for clips that read only the ratio (the log-probs are placeholders)."""
    mask = torch.ones_like(advantages) if mask is None else mask
    log_prob = torch.zeros_like(advantages) if log_prob is None else log_prob
    old = torch.zeros_like(advantages) if old_log_prob is None else old_log_prob
    return ClipInputs(ratio=ratio, log_prob=log_prob, old_log_prob=old, advantages=advantages, mask=mask)


def test_token_ratio_hand_worked():
    """log pi - log pi_old = [ln 2, -ln 2, 30] -> r = [2, 0.5, e^20] (clamped at 20, zero gradient)."""
    log_prob = torch.tensor([[math.log(2.0), 0.0, 30.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[0.0, math.log(2.0), 0.0]], dtype=torch.float64)
    ratio = TokenRatio()(log_prob, old, torch.ones(1, 3))
    torch.testing.assert_close(ratio, torch.tensor([[2.0, 0.5, math.exp(20.0)]], dtype=torch.float64))
    (grad,) = torch.autograd.grad(ratio.sum(), log_prob)
    torch.testing.assert_close(grad, torch.tensor([[2.0, 0.5, 0.0]], dtype=torch.float64))  # d r / d log pi = r


def test_sequence_ratio_hand_worked():
    """Row 0: log-ratios [0.2, 0.4, (5.0 masked)] -> mean 0.3 -> s = e^0.3 on every token.
    Row 1 is empty -> s = 1. Gradient of sum_t w_t s_i,t w.r.t. log pi_t is s_i * w_t (token form)."""
    log_prob = torch.tensor([[0.2, 0.4, 5.0], [1.0, 2.0, 3.0]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(2, 3, dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    ratio = SequenceRatio()(log_prob, old, mask)
    s = math.exp(0.3)
    torch.testing.assert_close(ratio, torch.tensor([[s, s, s], [1.0, 1.0, 1.0]], dtype=torch.float64))
    w = torch.tensor([[1.0, 2.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    (grad,) = torch.autograd.grad((ratio * w).sum(), log_prob)
    torch.testing.assert_close(grad, torch.tensor([[s, 2 * s, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64))


def test_sequence_ratio_clamps_log_ratio_at_10():
    log_prob = torch.tensor([[12.0, 14.0]])
    ratio = SequenceRatio()(log_prob, torch.zeros(1, 2), torch.ones(1, 2))
    torch.testing.assert_close(ratio, torch.full((1, 2), math.exp(10.0)))


def test_log_prob_ratio_is_log_pi():
    log_prob = torch.tensor([[-0.5, -2.0]], requires_grad=True)
    out = NoClip()(_inputs(LogProb()(log_prob, torch.zeros(1, 2), torch.ones(1, 2)), torch.tensor([[2.0, -1.0]])))
    torch.testing.assert_close(out.loss, torch.tensor([[1.0, -2.0]]))  # -A log pi


# ratio, advantage -> worked by hand with eps = 0.2, dual clip c = 3:
#   r=1.5 A=+1: max(-1.5, -1.2) = -1.2        clipped, upper
#   r=0.5 A=+1: max(-0.5, -0.8) = -0.5        not clipped
#   r=1.1 A=-1: max( 1.1,  1.1) =  1.1        not clipped (equal is not "clipped")
#   r=0.5 A=-1: max( 0.5,  0.8) =  0.8        clipped, lower
#   r=5.0 A=-1: max( 5.0,  1.2) =  5.0 -> min(5.0, 3) = 3   dual
RATIO = [1.5, 0.5, 1.1, 0.5, 5.0]
ADV = [1.0, 1.0, -1.0, -1.0, -1.0]


def _clip(clip, ratio=RATIO, adv=ADV):
    ratio = torch.tensor([ratio], dtype=torch.float64, requires_grad=True)
    out = clip(_inputs(ratio, torch.tensor([adv], dtype=torch.float64)))
    (grad,) = torch.autograd.grad(out.loss.sum(), ratio)
    return out, grad[0].tolist()


def test_ppo_clip_symmetric_dual_hand_worked():
    out, grad = _clip(PPOClip(0.2, dual_clip=3.0))
    assert out.loss[0].tolist() == pytest.approx([-1.2, -0.5, 1.1, 0.8, 3.0])
    assert grad == pytest.approx([0.0, -1.0, 1.0, 0.0, 0.0])  # clipped tokens carry no gradient
    assert out.clipped["fraction"][0].tolist() == [True, False, False, True, False]
    assert out.clipped["upper"][0].tolist() == [True, False, False, False, False]
    assert out.clipped["lower"][0].tolist() == [False, False, False, True, False]
    assert out.clipped["dual"][0].tolist() == [False, False, False, False, True]


def test_ppo_clip_without_dual_and_clip_higher():
    out, _ = _clip(PPOClip(0.2))
    assert out.loss[0].tolist() == pytest.approx([-1.2, -0.5, 1.1, 0.8, 5.0])
    assert not out.clipped["dual"].any()
    out, _ = _clip(PPOClip(0.2, eps_high=0.28))  # DAPO clip-higher: r=1.5, A=+1 -> -1.28
    assert out.loss[0].tolist() == pytest.approx([-1.28, -0.5, 1.1, 0.8, 5.0])
    out, _ = _clip(PPOClip(0.2, eps_high=0.6))  # upper bound 1.6 > 1.5: no longer clipped
    assert out.loss[0, 0].item() == pytest.approx(-1.5) and not out.clipped["upper"].any()


def test_clip_masks_exclude_padding():
    ratio, adv = torch.tensor([[3.0, 3.0]]), torch.tensor([[1.0, 1.0]])
    out = PPOClip(0.2)(_inputs(ratio, adv, torch.tensor([[1.0, 0.0]])))
    assert out.clipped["fraction"].tolist() == [[True, False]]


def test_no_clip_hand_worked():
    out, grad = _clip(NoClip())
    assert out.loss[0].tolist() == pytest.approx([-1.5, -0.5, 1.1, 0.5, 5.0])
    assert grad == pytest.approx([-1.0, -1.0, 1.0, 1.0, 1.0])
    assert set(out.clipped) == {"fraction", "lower", "upper", "dual"} and not any(m.any() for m in out.clipped.values())


@pytest.mark.parametrize("ratio_cls", [TokenRatio, SequenceRatio])
@pytest.mark.parametrize(
    "clip", [PPOClip(0.2), PPOClip(0.2, 0.28), PPOClip(0.1, dual_clip=3.0), PPOClip(0.2, 0.28, 1.5)], ids=repr
)
def test_on_policy_clip_equals_unclipped(ratio_cls, clip):
    """On-policy (log pi = log pi_old) r = 1: every clip gives the unclipped loss and gradient."""
    gen = torch.Generator().manual_seed(0)
    log_prob = torch.randn(6, 5, generator=gen, dtype=torch.float64).requires_grad_()
    adv, mask = (
        torch.randn(6, 5, generator=gen, dtype=torch.float64),
        (torch.rand(6, 5, generator=gen) > 0.3).double(),
    )
    results = []
    for c in (clip, NoClip()):
        out = c(_inputs(ratio_cls()(log_prob, log_prob.detach(), mask), adv, mask))
        loss = TokenMean()(out.loss, mask)
        results.append((loss, torch.autograd.grad(loss, log_prob)[0]))
        assert not out.clipped["fraction"].any()
    torch.testing.assert_close(results[0], results[1])


def test_on_policy_log_prob_surrogate_has_ratio_gradient():
    """GPG/REINFORCE: grad of -A log pi equals grad of -A r at r = 1."""
    gen = torch.Generator().manual_seed(1)
    log_prob = torch.randn(4, 3, generator=gen, dtype=torch.float64).requires_grad_()
    adv, mask = torch.randn(4, 3, generator=gen, dtype=torch.float64), torch.ones(4, 3, dtype=torch.float64)
    grads = []
    for ratio in (LogProb(), TokenRatio()):
        loss = TokenMean()(NoClip()(_inputs(ratio(log_prob, log_prob.detach(), mask), adv, mask)).loss, mask)
        grads.append(torch.autograd.grad(loss, log_prob)[0])
    torch.testing.assert_close(grads[0], grads[1])


@pytest.mark.parametrize("eps", [0.2, 1e-3], ids=["wide", "narrow"])
def test_gspo_gradient_is_sequence_level(eps):
    """Token form + SeqMeanTokenMean == (1/N) sum_i max(-A_i s_i, -A_i clip(s_i)) computed directly."""
    gen = torch.Generator().manual_seed(2)
    n, t = 6, 7
    log_prob = (-torch.rand(n, t, generator=gen, dtype=torch.float64)).requires_grad_()
    old = log_prob.detach() + 0.05 * torch.randn(n, t, generator=gen, dtype=torch.float64)
    lengths = torch.tensor([7, 3, 1, 5, 6, 2])
    mask = (torch.arange(t) < lengths[:, None]).double()  # [N, T]
    adv_seq = torch.randn(n, generator=gen, dtype=torch.float64)  # [N]
    adv = adv_seq[:, None].expand(n, t)  # [N, T] constant along the row, as GSPO assumes

    clip = PPOClip(eps)
    token_form = SeqMeanTokenMean()(clip(_inputs(SequenceRatio()(log_prob, old, mask), adv, mask)).loss, mask)
    (grad_token,) = torch.autograd.grad(token_form, log_prob)

    s = torch.exp(((log_prob - old) * mask).sum(-1) / lengths)  # [N]
    direct = torch.maximum(-adv_seq * s, -adv_seq * s.clamp(1 - eps, 1 + eps)).mean()
    (grad_direct,) = torch.autograd.grad(direct, log_prob)
    torch.testing.assert_close(token_form, direct)
    torch.testing.assert_close(grad_token, grad_direct)
    assert grad_token.abs().sum() > 0


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"eps_low": 0.0}, "eps_low"),
        ({"eps_low": 1.0}, "eps_low"),
        ({"eps_low": -0.1}, "eps_low"),
        ({"eps_high": 0.0}, "eps_high"),
        ({"eps_high": -0.2}, "eps_high"),
        ({"dual_clip": 1.0}, "dual_clip"),
        ({"dual_clip": 0.5}, "dual_clip"),
    ],
)
def test_ppo_clip_rejects_bad_hyper_parameters(kwargs, words):
    with pytest.raises(ValueError, match=words):
        PPOClip(**kwargs)


def test_ppo_clip_defaults_are_symmetric():
    clip = PPOClip()
    assert (clip.eps_low, clip.eps_high, clip.dual_clip) == (0.2, 0.2, None)


def test_token_ratio_without_clamp_and_validation():
    """max_abs_log_ratio=None (verl's clip_cov/kl_cov) keeps e^30 and its gradient; <= 0 is refused."""
    log_prob = torch.tensor([[30.0]], dtype=torch.float64, requires_grad=True)
    ratio = TokenRatio(max_abs_log_ratio=None)(log_prob, torch.zeros(1, 1, dtype=torch.float64), torch.ones(1, 1))
    assert ratio.item() == pytest.approx(math.exp(30.0))
    (grad,) = torch.autograd.grad(ratio.sum(), log_prob)
    assert grad.item() == pytest.approx(math.exp(30.0))
    assert TokenRatio(5.0)(log_prob.detach(), torch.zeros(1, 1, dtype=torch.float64), torch.ones(1, 1)).item() == (
        pytest.approx(math.exp(5.0))
    )
    with pytest.raises(ValueError, match="max_abs_log_ratio"):
        TokenRatio(max_abs_log_ratio=0.0)
    with pytest.raises(ValueError, match="max_log_ratio"):
        SequenceRatio(max_log_ratio=-1.0)
