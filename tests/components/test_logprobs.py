"""token_log_probs: chunked log-softmax-and-gather equals the full one, values and gradients."""

import math

import pytest
import torch

from rlkit.components.logprobs import sum_squared_probs, token_log_probs


def _reference(logits, ids, temperature=1.0):
    return torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)


def _data(n=3, t=7, v=23, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    logits = (4 * torch.randn(n, t, v, generator=gen)).to(dtype)
    ids = torch.randint(0, v, (n, t), generator=gen)
    weights = torch.randn(n, t, generator=gen)
    return logits, ids, weights


def test_hand_worked():
    """logits [0, ln 3] (p = [1/4, 3/4]): log p = [ln 1/4, ln 3/4];
    gradient of the id-1 log-prob: onehot - p = [-1/4, 1/4]."""
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]], requires_grad=True)
    out = token_log_probs(logits, torch.tensor([[0, 1]]))
    assert out[0].tolist() == pytest.approx([math.log(0.25), math.log(0.75)])
    (grad,) = torch.autograd.grad(out[0, 1], logits)
    assert grad[0, 1].tolist() == pytest.approx([-0.25, 0.25]) and grad[0, 0].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("chunk_rows", [1, 3, 7, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_full_log_softmax_fp32(chunk_rows, temperature):
    logits, ids, weights = _data()
    a = logits.clone().requires_grad_()
    ours = token_log_probs(a, ids, chunk_rows=chunk_rows, temperature=temperature)
    (grad,) = torch.autograd.grad((ours * weights).sum(), a)
    b = logits.clone().requires_grad_()
    ref = _reference(b, ids, temperature)
    (grad_ref,) = torch.autograd.grad((ref * weights).sum(), b)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(grad, grad_ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("chunk_rows", [2, 1000])  # pieces of a row; several whole rows per chunk
def test_non_contiguous_shifted_view(chunk_rows):
    logits, ids, weights = _data(t=8)
    full = logits.clone().requires_grad_()
    ours = token_log_probs(full[:, :-1], ids[:, 1:], chunk_rows=chunk_rows)
    (grad,) = torch.autograd.grad((ours * weights[:, 1:]).sum(), full)
    ref_in = logits.clone().requires_grad_()
    ref = _reference(ref_in[:, :-1], ids[:, 1:])
    (grad_ref,) = torch.autograd.grad((ref * weights[:, 1:]).sum(), ref_in)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(grad, grad_ref, rtol=0, atol=1e-5)


def test_bf16_computes_in_fp32():
    logits, ids, weights = _data(dtype=torch.bfloat16)
    a = logits.clone().requires_grad_()
    ours = token_log_probs(a, ids, chunk_rows=4)
    assert ours.dtype == torch.float32
    ref = _reference(logits, ids)  # the fp32 log-softmax of the same bf16 logits
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)
    (ours * weights).sum().backward()
    b = logits.float().requires_grad_()
    (_reference(b, ids) * weights).sum().backward()
    assert a.grad.dtype == torch.bfloat16
    torch.testing.assert_close(a.grad.float(), b.grad, rtol=1e-2, atol=1e-2)  # bf16 rounding of the gradient


@pytest.mark.parametrize("case", ["entropy_3x5x11", "entropy_6x7x13"])
def test_matches_verl_logprobs_from_logits(verl_cases, case):
    (c,) = [c for c in verl_cases["entropy_cases"] if c["name"] == case]
    ours = token_log_probs(c["inputs"]["logits"], c["inputs"]["labels"], chunk_rows=4)
    torch.testing.assert_close(ours, c["results"]["logprobs_from_logits"], rtol=1e-5, atol=1e-5)


def test_rejects_bad_arguments():
    logits, ids, _ = _data()
    with pytest.raises(ValueError, match="chunk_rows"):
        token_log_probs(logits, ids, chunk_rows=0)
    with pytest.raises(ValueError, match="temperature"):
        token_log_probs(logits, ids, temperature=0.0)
    with pytest.raises(ValueError, match="shift"):
        token_log_probs(logits, ids[:, 1:])


def test_does_not_modify_logits():
    logits, ids, weights = _data()
    a = logits.clone().requires_grad_()
    (token_log_probs(a, ids, chunk_rows=5) * weights).sum().backward()
    assert torch.equal(a.detach(), logits)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sum_squared_probs_matches_the_full_softmax(temperature):
    """sum_v softmax(z / tau)_v^2 chunk by chunk equals the [N, T, V] computation; 1 for a one-hot row,
    1/V for a uniform one (hand-worked ends); bf16 logits are computed in float32."""
    logits, _, _ = _data()
    ref = (logits.float() / temperature).softmax(-1).square().sum(-1)
    torch.testing.assert_close(sum_squared_probs(logits, chunk_rows=3, temperature=temperature), ref)
    edges = torch.tensor([[[1e4, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]])
    torch.testing.assert_close(sum_squared_probs(edges), torch.tensor([[1.0, 0.25]]))
    torch.testing.assert_close(
        sum_squared_probs(logits.bfloat16()), logits.bfloat16().float().softmax(-1).square().sum(-1)
    )
    with pytest.raises(ValueError, match="chunk_rows"):
        sum_squared_probs(logits, chunk_rows=0)
