"""Log-probabilities of the sampled tokens without a full ``[N, T, V]`` log-softmax.

``log pi(y_t) = z_t[y_t] - logsumexp(z_t)`` with ``z = logits / temperature``; its gradient is
``d/dz = (onehot(y_t) - softmax(z_t)) * g / temperature``. Both are computed chunk by chunk over
positions, in float32 per chunk, so memory beyond the logits and their gradient is one chunk.
Chunks are views of ``logits`` (several whole rows when rows are short, pieces of a row when it is
long), so a shifted slice such as ``logits[:, :-1]`` is never copied.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _scaled(chunk: Tensor, temperature: float) -> Tensor:
    """``chunk / temperature`` in float32; no copy for float32 logits at temperature 1."""
    chunk = chunk.float()  # [r, V]
    return chunk if temperature == 1.0 else chunk / temperature


def position_chunks(B: int, T: int, chunk_rows: int):
    """``(rows, cols)`` slices covering ``[B, T]`` positions, about ``chunk_rows`` at a time: whole rows of
    several sequences when they are short (fewer Python steps), pieces of one sequence when it is long."""
    if T <= chunk_rows:
        per_chunk = max(chunk_rows // max(T, 1), 1)
        for b in range(0, B, per_chunk):
            yield slice(b, b + per_chunk), slice(None)
    else:
        for b in range(B):
            for start in range(0, T, chunk_rows):
                yield slice(b, b + 1), slice(start, start + chunk_rows)


class _ChunkedTokenLogProbs(torch.autograd.Function):
    """Forward: gather minus logsumexp per chunk. Backward: ``(onehot - softmax) * g`` per chunk."""

    @staticmethod
    def forward(ctx, logits: Tensor, token_ids: Tensor, chunk_rows: int, temperature: float) -> Tensor:
        z3 = logits.reshape(-1, *logits.shape[-2:])  # [B, T, V] a view (only leading dims merge)
        ids = token_ids.reshape(-1, token_ids.shape[-1], 1)  # [B, T, 1]
        out = torch.empty(z3.shape[:2], device=logits.device, dtype=torch.float32)  # [B, T]
        lse = torch.empty_like(out)  # [B, T]
        for rows, cols in position_chunks(*z3.shape[:2], chunk_rows):
            z = _scaled(z3[rows, cols], temperature)  # [b, r, V]
            lse[rows, cols] = torch.logsumexp(z, dim=-1)  # [b, r]
            out[rows, cols] = z.gather(-1, ids[rows, cols]).squeeze(-1)  # [b, r]
        out -= lse
        ctx.save_for_backward(logits, token_ids, lse)
        ctx.chunk_rows, ctx.temperature = chunk_rows, temperature
        return out.reshape(token_ids.shape)  # [N, T] float32

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        logits, token_ids, lse = ctx.saved_tensors
        chunk_rows, temperature = ctx.chunk_rows, ctx.temperature
        z3 = logits.reshape(-1, *logits.shape[-2:])  # [B, T, V]
        ids = token_ids.reshape(-1, token_ids.shape[-1], 1)  # [B, T, 1]
        g = grad_out.reshape(*z3.shape[:2], 1).float() / temperature  # [B, T, 1]
        grad = torch.empty(z3.shape, device=logits.device, dtype=logits.dtype)  # [B, T, V] needed anyway
        fp32 = grad.dtype == torch.float32
        for rows, cols in position_chunks(*z3.shape[:2], chunk_rows):
            z = _scaled(z3[rows, cols], temperature)  # [b, r, V] may be a view of logits: no in-place
            target = grad[rows, cols]  # [b, r, V] view; float32 gradients are written in place
            work = torch.sub(z, lse[rows, cols, None], out=target) if fp32 else z - lse[rows, cols, None]
            work.exp_().mul_(-g[rows, cols])  # -softmax * g
            work.scatter_add_(-1, ids[rows, cols], g[rows, cols])  # + onehot * g
            if not fp32:
                target.copy_(work)
        return grad.reshape(logits.shape), None, None, None


def token_log_probs(logits: Tensor, token_ids: Tensor, chunk_rows: int = 512, temperature: float = 1.0) -> Tensor:
    """``log_softmax(logits / temperature).gather(token_ids)`` without materialising ``[N, T, V]``.

    Args:
        logits: ``[N, T, V]`` (any float dtype; each chunk is computed in float32).
        token_ids: ``[N, T]`` int64 ids of the sampled tokens.
        chunk_rows: positions processed at once; memory per chunk is about ``2 * chunk_rows * V``
            float32 values.
        temperature: divide the logits by this before the softmax (the sampling temperature).

    Returns:
        ``[N, T]`` float32 log-probabilities whatever the dtype of ``logits`` (a bf16 log-prob is off by
        up to ~0.4% of its value, which moves the ratio ``exp(log pi - log pi_old)`` by percents).
    """
    if chunk_rows < 1:
        raise ValueError(f"token_log_probs chunk_rows={chunk_rows} must be >= 1 (e.g. 512).")
    if not temperature > 0:
        raise ValueError(f"token_log_probs temperature={temperature} must be > 0 (1.0 leaves logits unchanged).")
    if logits.dim() < 2 or logits.shape[:-1] != token_ids.shape:
        raise ValueError(
            f"token_log_probs: logits {tuple(logits.shape)} and token_ids {tuple(token_ids.shape)} disagree; "
            "logits must be token_ids.shape + (V,) (shift logits by one position for next-token ids)."
        )
    return _ChunkedTokenLogProbs.apply(logits, token_ids, chunk_rows, temperature)


@torch.no_grad()
def sum_squared_probs(logits: Tensor, chunk_rows: int = 512, temperature: float = 1.0) -> Tensor:
    """``sum_v softmax(logits / temperature)_v^2`` per position, ``[N, T]`` float32, chunk by chunk.

    Computed as ``exp(logsumexp(2 z) - 2 logsumexp(z))`` with ``z = logits / temperature``, which never
    forms the ``[N, T, V]`` probabilities. It is 1 for a one-hot distribution and ``1 / V`` for a uniform
    one. The optimal token baseline needs it (``AdvantageInputs.sum_pi_squared``); no gradient.

    Args:
        logits: ``[N, T, V]`` (any float dtype; each chunk is computed in float32).
        chunk_rows: positions processed at once.
        temperature: the sampling temperature, as for ``token_log_probs``.
    """
    if chunk_rows < 1:
        raise ValueError(f"sum_squared_probs chunk_rows={chunk_rows} must be >= 1 (e.g. 512).")
    if not temperature > 0:
        raise ValueError(f"sum_squared_probs temperature={temperature} must be > 0 (1.0 leaves logits unchanged).")
    z3 = logits.reshape(-1, *logits.shape[-2:])  # [B, T, V] a view
    out = torch.empty(z3.shape[:2], device=logits.device, dtype=torch.float32)  # [B, T]
    for b in range(z3.shape[0]):
        for start in range(0, z3.shape[1], chunk_rows):
            z = _scaled(z3[b, start : start + chunk_rows], temperature)  # [r, V]
            out[b, start : start + chunk_rows] = torch.exp(
                torch.logsumexp(2.0 * z, dim=-1) - 2.0 * torch.logsumexp(z, dim=-1)
            )  # [r]
    return out.reshape(logits.shape[:-1])  # [N, T]
