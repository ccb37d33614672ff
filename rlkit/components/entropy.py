"""Entropy of the policy's next-token distribution, from logits, chunk by chunk.

``H = -sum_v p_v log p_v`` with ``p = softmax(z)``; its gradient is ``dH/dz_v = -p_v (log p_v + H)``.
A custom autograd function computes both one chunk of positions at a time (in float32), saving only
the logits (already kept by the graph) and ``H``: no ``[N, T, V]`` softmax is stored for backward,
and chunks are views, so a slice such as ``logits[:, :-1]`` is never copied. Logits of ``-inf``
(a masked vocabulary) contribute ``0 log 0 = 0`` where the plain formula gives NaN.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlkit.components.logprobs import position_chunks


def _p_log_p(log_p: Tensor) -> Tensor:
    """``p log p`` with ``0 log 0 = 0``: logits of -inf (masked vocabulary) give 0, not NaN."""
    return torch.where(log_p > -torch.inf, log_p.exp() * log_p, 0.0)  # [..., V]


class _ChunkedEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, chunk_rows: int) -> Tensor:
        z3 = logits.reshape(-1, *logits.shape[-2:])  # [B, T, V] a view (only leading dims merge)
        entropy = torch.empty(z3.shape[:2], device=logits.device, dtype=torch.float32)  # [B, T]
        for rows, cols in position_chunks(*z3.shape[:2], chunk_rows):
            log_p = torch.log_softmax(z3[rows, cols].float(), dim=-1)  # [b, r, V]
            entropy[rows, cols] = -_p_log_p(log_p).sum(dim=-1)  # [b, r]
        ctx.save_for_backward(logits, entropy)
        ctx.chunk_rows = chunk_rows
        return entropy.reshape(logits.shape[:-1])  # [...] float32

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        logits, entropy = ctx.saved_tensors
        chunk_rows = ctx.chunk_rows
        z3 = logits.reshape(-1, *logits.shape[-2:])  # [B, T, V]
        g = grad_out.reshape(*z3.shape[:2], 1).float()  # [B, T, 1]
        grad = torch.empty(z3.shape, device=logits.device, dtype=logits.dtype)  # [B, T, V]
        for rows, cols in position_chunks(*z3.shape[:2], chunk_rows):
            log_p = torch.log_softmax(z3[rows, cols].float(), dim=-1)  # [b, r, V]
            # dH/dz = -p (log p + H)
            p_log_p = _p_log_p(log_p)  # [b, r, V]
            grad[rows, cols] = (p_log_p + log_p.exp() * entropy[rows, cols, None]) * -g[rows, cols]
        return grad.reshape(logits.shape), None


def entropy_from_logits(logits: Tensor, chunk_rows: int = 512) -> Tensor:
    """Entropy of ``softmax(logits)`` over the last dimension: ``[..., V] -> [...]``.

    Args:
        logits: ``[..., V]`` with at least 2 dimensions (any float dtype; each chunk is computed in
            float32).
        chunk_rows: positions processed at once; memory per chunk is a few ``chunk_rows * V`` float32
            values.

    Returns:
        ``[...]`` float32 entropies in nats (verl's ``entropy_from_logits``).
    """
    if chunk_rows < 1:
        raise ValueError(f"entropy_from_logits chunk_rows={chunk_rows} must be >= 1 (e.g. 512).")
    if logits.dim() < 2:
        raise ValueError(
            f"entropy_from_logits expects [..., V] with >= 2 dims, got {tuple(logits.shape)}: unsqueeze(0)."
        )
    return _ChunkedEntropy.apply(logits, chunk_rows)
