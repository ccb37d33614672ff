"""Distillation losses: hand-worked values, the top-k forward KL against brute force over the whole
vocabulary, and the expected gradient of each sampled-token estimator used as a supervised loss."""

import math

import pytest
import torch

from rlkit.components.distill import DistillInputs, ReverseKL, TopKForwardKL
from rlkit.components.kl import K1, K3
from rlkit.components.logprobs import gathered_log_probs, top_k_log_probs


def test_reverse_kl_hand_worked():
    """pi(y) = 1/2, pi_T(y) = 1/4: k1 = ln 2 = 0.693147; log r = -ln 2, r = 1/2, k3 = 1/2 + ln 2 - 1 = 0.193147.
    pi(y) = 1/4, pi_T(y) = 1/2: k1 = -ln 2; r = 2, k3 = 2 - ln 2 - 1 = 0.306853."""
    inputs = DistillInputs(
        logprobs=torch.tensor([[math.log(0.5), math.log(0.25)]]),
        teacher_logprobs=torch.tensor([[math.log(0.25), math.log(0.5)]]),
    )
    assert ReverseKL(K1())(inputs).flatten().tolist() == pytest.approx([0.693147, -0.693147], abs=1e-6)
    assert ReverseKL(K3())(inputs).flatten().tolist() == pytest.approx([0.193147, 0.306853], abs=1e-6)


def _top_inputs(p: list[float], q: list[float], k: int) -> DistillInputs:
    log_p, log_q = torch.tensor([p]).log(), torch.tensor([q]).log()  # [1, V]
    top = log_p.topk(k, dim=-1)
    return DistillInputs(
        logprobs=torch.zeros(1, 1),
        teacher_logprobs=torch.zeros(1, 1),
        top_logprobs=log_q.gather(-1, top.indices).unsqueeze(0),  # [1, 1, k]
        teacher_top_logprobs=top.values.unsqueeze(0),  # [1, 1, k]
    )


def test_top_k_forward_kl_hand_worked():
    """Teacher p = [0.5, 0.3, 0.2], student q = [0.25, 0.25, 0.5].
    k = 1: 0.5 ln(0.5/0.25) + rest 0.5 ln(0.5/0.75) = 0.346574 - 0.202733 = 0.143841;
           without the rest (verl): 0.346574.
    k = 3: 0.5 ln 2 + 0.3 ln 1.2 + 0.2 ln 0.4 = 0.346574 + 0.054696 - 0.183258 = 0.218012 (the full KL)."""
    p, q = [0.5, 0.3, 0.2], [0.25, 0.25, 0.5]
    assert TopKForwardKL(k=1)(_top_inputs(p, q, 1)).item() == pytest.approx(0.143841, abs=1e-5)
    assert TopKForwardKL(k=1, tail=False)(_top_inputs(p, q, 1)).item() == pytest.approx(0.346574, abs=1e-5)
    assert TopKForwardKL(k=3)(_top_inputs(p, q, 3)).item() == pytest.approx(0.218012, abs=1e-5)


def test_top_k_forward_kl_without_rest_clamps_at_zero():
    """Teacher p = [0.4, 0.6] top-1 is token 1; student q = [0.1, 0.9]: 0.6 ln(0.6/0.9) < 0 -> 0."""
    assert TopKForwardKL(k=1, tail=False)(_top_inputs([0.4, 0.6], [0.1, 0.9], 1)).item() == 0.0


def _pair(n=2, t=5, v=11, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return 2 * torch.randn(n, t, v, generator=gen), 2 * torch.randn(n, t, v, generator=gen)  # [n, t, v] x2


def _top_k_loss(student: torch.Tensor, teacher: torch.Tensor, k: int, chunk_rows: int = 3) -> torch.Tensor:
    teacher_top, ids = top_k_log_probs(teacher, k, chunk_rows=chunk_rows)  # [n, t, k]
    inputs = DistillInputs(
        logprobs=torch.zeros(student.shape[:-1]),
        teacher_logprobs=torch.zeros(student.shape[:-1]),
        top_logprobs=gathered_log_probs(student, ids, chunk_rows=chunk_rows),  # [n, t, k]
        teacher_top_logprobs=teacher_top,
    )
    return TopKForwardKL(k=k)(inputs)  # [n, t]


def test_top_k_forward_kl_with_k_equal_v_is_the_full_forward_kl_value_and_gradient():
    student, teacher = _pair()
    weights = torch.rand(student.shape[:-1], generator=torch.Generator().manual_seed(1))  # [n, t]
    a = student.clone().requires_grad_()
    ours = _top_k_loss(a, teacher, k=student.shape[-1])  # [n, t]
    (grad,) = torch.autograd.grad((ours * weights).sum(), a)
    b = student.clone().requires_grad_()
    log_p, log_q = teacher.log_softmax(-1), b.log_softmax(-1)  # [n, t, v]
    full = (log_p.exp() * (log_p - log_q)).sum(-1)  # [n, t]
    (grad_full,) = torch.autograd.grad((full * weights).sum(), b)
    torch.testing.assert_close(ours, full, rtol=0, atol=1e-5)
    torch.testing.assert_close(grad, grad_full, rtol=0, atol=1e-5)


@pytest.mark.parametrize("k", [1, 4])
def test_top_k_forward_kl_is_the_kl_of_the_coarsened_distributions(k):
    """Brute force: merge every token outside the teacher's top-k into one outcome, take the full KL."""
    student, teacher = _pair(seed=2)
    a = student.clone().requires_grad_()
    ours = _top_k_loss(a, teacher, k)  # [n, t]
    (grad,) = torch.autograd.grad(ours.sum(), a)
    b = student.clone().requires_grad_()
    p, q = teacher.softmax(-1), b.softmax(-1)  # [n, t, v]
    in_top = torch.zeros_like(p, dtype=torch.bool).scatter_(-1, teacher.topk(k, dim=-1).indices, True)  # [n, t, v]
    coarse_p = torch.cat([p.where(in_top, 0), (p * ~in_top).sum(-1, keepdim=True)], -1)  # [n, t, v + 1]
    coarse_q = torch.cat([q.where(in_top, 0), (q * ~in_top).sum(-1, keepdim=True)], -1)  # [n, t, v + 1]
    brute = torch.xlogy(coarse_p, coarse_p).sum(-1) - torch.xlogy(coarse_p, coarse_q).sum(-1)  # [n, t]
    (grad_brute,) = torch.autograd.grad(brute.sum(), b)
    torch.testing.assert_close(ours, brute, rtol=0, atol=1e-5)
    torch.testing.assert_close(grad, grad_brute, rtol=0, atol=1e-5)
    assert (ours >= -1e-6).all() and (ours <= (p * (p.log() - q.log())).sum(-1) + 1e-5).all()  # below the full KL


def _expected_gradient(loss: ReverseKL, student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """``sum_y pi(y) grad_z loss(y)`` at one position: the exact expectation of the sampled-token gradient."""
    z = student.clone().requires_grad_()  # [V]
    log_pi, log_pi_t = z.log_softmax(-1), teacher.log_softmax(-1)  # [V]
    per_token = loss(DistillInputs(log_pi.unsqueeze(0), log_pi_t.unsqueeze(0)))  # [1, V]: every y at once
    (grad,) = torch.autograd.grad((log_pi.exp().detach() * per_token[0]).sum(), z)
    return grad


def test_sampled_token_estimators_as_supervised_losses_have_the_documented_expected_gradients():
    """K1: zero; K1 straight-through: the reverse KL's gradient; K3: the forward KL's gradient."""
    gen = torch.Generator().manual_seed(3)
    student, teacher = torch.randn(7, generator=gen), torch.randn(7, generator=gen)  # [V]
    z = student.clone().requires_grad_()
    log_q, log_p = z.log_softmax(-1), teacher.log_softmax(-1)
    (reverse,) = torch.autograd.grad((log_q.exp() * (log_q - log_p)).sum(), z)
    z = student.clone().requires_grad_()
    log_q = z.log_softmax(-1)
    (forward,) = torch.autograd.grad((log_p.exp() * (log_p - log_q)).sum(), z)
    torch.testing.assert_close(_expected_gradient(ReverseKL(K1()), student, teacher), torch.zeros(7), atol=1e-6, rtol=0)
    torch.testing.assert_close(_expected_gradient(ReverseKL(K1(straight_through=True)), student, teacher), reverse)
    torch.testing.assert_close(_expected_gradient(ReverseKL(K3()), student, teacher), forward)


def test_rejects_bad_settings():
    with pytest.raises(ValueError, match="k=0 must be >= 1"):
        TopKForwardKL(k=0)
    with pytest.raises(ValueError, match="must be a KL estimator"):
        ReverseKL("K1")
    with pytest.raises(ValueError, match="needs the student's and the teacher's top-k"):
        TopKForwardKL(k=2)(DistillInputs(torch.zeros(1, 1), torch.zeros(1, 1)))
