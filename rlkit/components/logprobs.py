"""Log-probabilities of chosen tokens without a full ``[N, T, V]`` log-softmax.

``log pi(y_t) = z_t[y_t] - logsumexp(z_t)`` with ``z = logits / temperature``; its gradient is
``d/dz = (onehot(y_t) - softmax(z_t)) * g / temperature``. Both are computed chunk by chunk over
positions, in float32 per chunk, so memory beyond the logits and their gradient is one chunk.
Chunks are views of ``logits`` (several whole rows when rows are short, pieces of a row when it is
long), so a shifted slice such as ``logits[:, :-1]`` is never copied.

The same holds for ``K`` tokens per position (a distillation teacher's top-k): the gradient is
``(sum_k onehot(y_tk) g_tk - softmax(z_t) sum_k g_tk) / temperature``.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _scaled(chunk: Tensor, temperature: float) -> Tensor:
    """``chunk / temperature`` in float32; no copy for float32 logits at temperature 1."""
    chunk = chunk.float()  # [..., V]
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


def _check(chunk_rows: int, temperature: float, name: str) -> None:
    if chunk_rows < 1:
        raise ValueError(f"{name} chunk_rows={chunk_rows} must be >= 1 (e.g. 512).")
    if not temperature > 0:
        raise ValueError(f"{name} temperature={temperature} must be > 0 (1.0 leaves logits unchanged).")


class _ChunkedTokenLogProbs(torch.autograd.Function):
    """Forward: gather minus logsumexp per chunk. Backward: ``(onehot - softmax) * g`` per chunk.

    ``token_ids`` is ``logits.shape[:-1] + (K,)``: K chosen tokens per position (1 for the sampled one).
    """

    @staticmethod
    def forward(ctx, logits: Tensor, token_ids: Tensor, chunk_rows: int, temperature: float) -> Tensor:
        z3 = logits.reshape(-1, *logits.shape[-2:])  # [B, T, V] a view (only leading dims merge)
        ids = token_ids.reshape(*z3.shape[:2], token_ids.shape[-1])  # [B, T, K]
        out = torch.empty(ids.shape, device=logits.device, dtype=torch.float32)  # [B, T, K]
        lse = torch.empty(z3.shape[:2], device=logits.device, dtype=torch.float32)  # [B, T]
        for rows, cols in position_chunks(*z3.shape[:2], chunk_rows):
            z = _scaled(z3[rows, cols], temperature)  # [b, r, V]
            lse[rows, cols] = torch.logsumexp(z, dim=-1)  # [b, r]
            out[rows, cols] = z.gather(-1, ids[rows, cols])  # [b, r, K]
        out -= lse.unsqueeze(-1)
        ctx.save_for_backward(logits, ids, lse)
        ctx.chunk_rows, ctx.temperature = chunk_rows, temperature
        return out.reshape(token_ids.shape)  # [N, T, K] float32

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        logits, ids, lse = ctx.saved_tensors  # ids [B, T, K]
        chunk_rows, temperature = ctx.chunk_rows, ctx.temperature
        z3 = logits.reshape(-1, *logits.shape[-2:])  # [B, T, V]
        g = grad_out.reshape(ids.shape).float() / temperature  # [B, T, K]
        g_total = g.sum(-1, keepdim=True)  # [B, T, 1]
        grad = torch.empty(z3.shape, device=logits.device, dtype=logits.dtype)  # [B, T, V] needed anyway
        fp32 = grad.dtype == torch.float32
        for rows, cols in position_chunks(*z3.shape[:2], chunk_rows):
            z = _scaled(z3[rows, cols], temperature)  # [b, r, V] may be a view of logits: no in-place
            target = grad[rows, cols]  # [b, r, V] view; float32 gradients are written in place
            work = torch.sub(z, lse[rows, cols, None], out=target) if fp32 else z - lse[rows, cols, None]
            work.exp_().mul_(-g_total[rows, cols])  # -softmax * sum_k g_k
            work.scatter_add_(-1, ids[rows, cols], g[rows, cols])  # + sum_k onehot_k * g_k
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
    _check(chunk_rows, temperature, "token_log_probs")
    if logits.dim() < 2 or logits.shape[:-1] != token_ids.shape:
        raise ValueError(
            f"token_log_probs: logits {tuple(logits.shape)} and token_ids {tuple(token_ids.shape)} disagree; "
            "logits must be token_ids.shape + (V,) (shift logits by one position for next-token ids)."
        )
    return _ChunkedTokenLogProbs.apply(logits, token_ids.unsqueeze(-1), chunk_rows, temperature).squeeze(-1)


def gathered_log_probs(logits: Tensor, token_ids: Tensor, chunk_rows: int = 512, temperature: float = 1.0) -> Tensor:
    """``log_softmax(logits / temperature).gather(-1, token_ids)`` for K tokens per position, chunked.

    The student's log-probs at a teacher's top-k ids (distillation), with the gradient, never forming
    ``[N, T, V]`` log-probs.

    Args:
        logits: ``[N, T, V]``.
        token_ids: ``[N, T, K]`` int64 ids.
        chunk_rows: positions processed at once (see :func:`token_log_probs`).
        temperature: divide the logits by this before the softmax.

    Returns:
        ``[N, T, K]`` float32 log-probabilities.
    """
    _check(chunk_rows, temperature, "gathered_log_probs")
    if logits.dim() < 2 or token_ids.dim() != logits.dim() or logits.shape[:-1] != token_ids.shape[:-1]:
        raise ValueError(
            f"gathered_log_probs: logits {tuple(logits.shape)} and token_ids {tuple(token_ids.shape)} disagree; "
            "token_ids must be logits.shape[:-1] + (K,)."
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
    _check(chunk_rows, temperature, "sum_squared_probs")
    z3 = logits.reshape(-1, *logits.shape[-2:])  # [B, T, V] a view
    out = torch.empty(z3.shape[:2], device=logits.device, dtype=torch.float32)  # [B, T]
    for rows, cols in position_chunks(*z3.shape[:2], chunk_rows):
        z = _scaled(z3[rows, cols], temperature)  # [b, r, V]
        out[rows, cols] = torch.exp(torch.logsumexp(2.0 * z, dim=-1) - 2.0 * torch.logsumexp(z, dim=-1))  # [b, r]
    return out.reshape(logits.shape[:-1])  # [N, T]


@torch.no_grad()
def top_k_log_probs(logits: Tensor, k: int, chunk_rows: int = 512, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """The ``k`` most likely tokens per position and their log-probs, chunked, without gradient.

    Args:
        logits: ``[N, T, V]`` (each chunk computed in float32).
        k: tokens per position, ``1 <= k <= V``.
        chunk_rows: positions processed at once.
        temperature: divide the logits by this before the softmax.

    Returns:
        ``(log_probs [N, T, k] float32, ids [N, T, k] int64)``, most likely first.
    """
    _check(chunk_rows, temperature, "top_k_log_probs")
    if not 1 <= k <= logits.shape[-1]:
        raise ValueError(f"top_k_log_probs: k={k} must be in [1, V={logits.shape[-1]}] (the vocabulary size).")
    z3 = logits.reshape(-1, *logits.shape[-2:])  # [B, T, V] a view
    values = torch.empty(*z3.shape[:2], k, device=logits.device, dtype=torch.float32)  # [B, T, k]
    ids = torch.empty(*z3.shape[:2], k, device=logits.device, dtype=torch.long)  # [B, T, k]
    for rows, cols in position_chunks(*z3.shape[:2], chunk_rows):
        z = _scaled(z3[rows, cols], temperature)  # [b, r, V]
        top = z.topk(k, dim=-1)  # [b, r, k]
        values[rows, cols] = top.values - torch.logsumexp(z, dim=-1, keepdim=True)  # [b, r, k]
        ids[rows, cols] = top.indices  # [b, r, k]
    shape = (*logits.shape[:-1], k)
    return values.reshape(shape), ids.reshape(shape)
