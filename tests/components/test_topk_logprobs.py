"""gathered_log_probs and top_k_log_probs: K tokens per position, chunked, equal the full log-softmax."""

import math

import pytest
import torch

from rlkit.components.logprobs import gathered_log_probs, top_k_log_probs


def _data(n=3, t=7, v=23, k=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = 4 * torch.randn(n, t, v, generator=gen)  # [n, t, v]
    ids = torch.randint(0, v, (n, t, k), generator=gen)  # [n, t, k] repeats allowed
    weights = torch.randn(n, t, k, generator=gen)  # [n, t, k]
    return logits, ids, weights


def test_hand_worked_gather_of_two_ids():
    """logits [0, ln 3] (p = [1/4, 3/4]); ids [1, 0] give [ln 3/4, ln 1/4]. The gradient of
    log p_1 + 2 log p_0 is onehot_1 + 2 onehot_0 - 3 p = [2 - 3/4, 1 - 9/4] = [1.25, -1.25]."""
    logits = torch.tensor([[[0.0, math.log(3.0)]]], requires_grad=True)  # [1, 1, 2]
    out = gathered_log_probs(logits, torch.tensor([[[1, 0]]]))  # [1, 1, 2]
    assert out.flatten().tolist() == pytest.approx([math.log(0.75), math.log(0.25)])
    (grad,) = torch.autograd.grad(out[0, 0, 0] + 2 * out[0, 0, 1], logits)
    assert grad.flatten().tolist() == pytest.approx([1.25, -1.25])


@pytest.mark.parametrize("chunk_rows", [1, 3, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gather_matches_full_log_softmax(chunk_rows, temperature):
    logits, ids, weights = _data()
    a = logits.clone().requires_grad_()
    ours = gathered_log_probs(a[:, :-1], ids[:, 1:], chunk_rows=chunk_rows, temperature=temperature)
    (grad,) = torch.autograd.grad((ours * weights[:, 1:]).sum(), a)
    b = logits.clone().requires_grad_()
    ref = torch.log_softmax(b[:, :-1] / temperature, dim=-1).gather(-1, ids[:, 1:])  # [n, t-1, k]
    (grad_ref,) = torch.autograd.grad((ref * weights[:, 1:]).sum(), b)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(grad, grad_ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("chunk_rows", [1, 4, 1000])
def test_top_k_matches_full_log_softmax(chunk_rows):
    logits, _, _ = _data()
    values, ids = top_k_log_probs(logits, 5, chunk_rows=chunk_rows, temperature=0.7)
    full = torch.log_softmax(logits / 0.7, dim=-1)  # [n, t, v]
    ref = full.topk(5, dim=-1)
    torch.testing.assert_close(values, ref.values, rtol=0, atol=1e-5)
    assert torch.equal(ids, ref.indices)
    assert values.shape == (3, 7, 5) and not values.requires_grad


def test_rejects_bad_arguments():
    logits, ids, _ = _data()
    with pytest.raises(ValueError, match=r"k=24 must be in \[1, V=23\]"):
        top_k_log_probs(logits, 24)
    with pytest.raises(ValueError, match="token_ids must be"):
        gathered_log_probs(logits, ids[:, 1:])
    with pytest.raises(ValueError, match="chunk_rows"):
        gathered_log_probs(logits, ids, chunk_rows=0)
