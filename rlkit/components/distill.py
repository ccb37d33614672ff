"""Distillation losses: how far the student is from a frozen teacher, per token of the student's own rollout.

On-policy distillation samples completions from the student and lets the teacher score every token
(Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes"
(GKD); Gu et al. 2024, "MiniLLM: Knowledge Distillation of Large Language Models"; Thinking Machines 2025,
"On-Policy Distillation"). A loss maps :class:`DistillInputs` to a per-token divergence ``D_t [N, T]``; the
family either uses ``A_t = -D_t`` as a policy-gradient advantage or backpropagates ``D_t`` directly.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass

import torch
from torch import Tensor

from rlkit.components.base import Component, Need
from rlkit.components.kl import KL


@dataclass
class DistillInputs:
    """What a distillation loss reads for ``n`` completions of ``T`` tokens.

    Attributes:
        logprobs: ``[n, T]`` the student's log-probs of the sampled tokens (may carry the gradient).
        teacher_logprobs: ``[n, T]`` the teacher's log-probs of the same tokens.
        top_logprobs: ``[n, T, k]`` the student's log-probs of the teacher's top-k tokens at each position
            (may carry the gradient); None for losses with ``top_k = 0``.
        teacher_top_logprobs: ``[n, T, k]`` the teacher's log-probs of its top-k tokens.
    """

    logprobs: Tensor
    teacher_logprobs: Tensor
    top_logprobs: Tensor | None = None
    teacher_top_logprobs: Tensor | None = None


class DistillationLoss(Component):
    """Base of every distillation loss: ``__call__(inputs) -> [n, T]`` per-token loss.

    ``top_k`` says how many of the teacher's most likely tokens per position the loss reads (0: only the
    sampled token), so the family asks the teacher for exactly those.
    """

    needs = frozenset({Need.OLD_LOGPROBS, Need.TEACHER})

    top_k: int = 0

    @abstractmethod
    def __call__(self, inputs: DistillInputs) -> Tensor: ...


class ReverseKL(DistillationLoss):
    """Reverse KL ``KL(pi || pi_T)`` estimated on the sampled token (Gu et al. 2024; Thinking Machines 2025).

    ``D_t = estimator(log pi(y_t), log pi_T(y_t))`` with ``y_t ~ pi``: ``K1`` gives ``log pi - log pi_T``,
    whose negative is Thinking Machines' per-token advantage; ``K3`` gives ``r - log r - 1`` with
    ``r = pi_T / pi`` (both unbiased, K3 >= 0 with lower variance; Schulman 2020).

    As a policy-gradient signal (``A_t = -D_t``) either estimator works. Backpropagated directly, the
    gradient is the estimator's own: ``K1``'s is ``grad log pi``, zero in expectation, so nothing is
    learnt; ``K1(straight_through=True)`` takes ``(log pi - log pi_T) grad log pi``, the unbiased gradient
    of the reverse KL (per token, without the future terms); ``K3``'s gradient is that of the forward KL.

    Args:
        estimator: the KL estimator of :mod:`rlkit.components.kl` (``K1``, ``K3``, ...).
    """

    def __init__(self, estimator: KL) -> None:
        if not isinstance(estimator, KL):
            raise ValueError(f"ReverseKL estimator must be a KL estimator such as K1 or K3, got {estimator!r}")
        self.estimator = estimator

    def __call__(self, inputs: DistillInputs) -> Tensor:
        return self.estimator(inputs.logprobs, inputs.teacher_logprobs)  # [n, T]


class TopKForwardKL(DistillationLoss):
    """Forward KL ``KL(pi_T || pi)`` over the teacher's top-k tokens, the rest as one outcome (GKD).

    With ``S_t`` the teacher's ``k`` most likely tokens at position ``t``, ``p = pi_T``, ``q = pi``,
    ``p_rest = 1 - sum_S p`` and ``q_rest = 1 - sum_S q``::

        D_t = sum_{j in S_t} p_j (log p_j - log q_j) + p_rest (log p_rest - log q_rest)

    the KL between both distributions coarsened to ``k + 1`` outcomes: ``>= 0``, equal to the full
    forward KL when ``k = V`` and a lower bound of it otherwise. The gradient reaches the student's
    logits through the ``k`` gathered log-probs (memory ``[N, T, k]``, never ``[N, T, V]``). Rest masses
    are floored at ``1e-6`` (float32 rounding of ``1 - sum`` near 1) so no ``0 * log 0`` appears.
    ``tail=False`` keeps only the top-k terms, clamped at 0, as verl's ``forward_kl_topk``.

    Args:
        k: teacher tokens per position (verl's default is 128; more costs memory ``[N, T, k]`` floats).
        tail: count the teacher's remaining mass as one outcome (a proper KL); False: verl's truncated sum.
    """

    REST_FLOOR = 1e-6

    def __init__(self, k: int = 16, tail: bool = True) -> None:
        if k < 1:
            raise ValueError(f"TopKForwardKL k={k} must be >= 1 (tokens of the teacher per position, e.g. 16).")
        self.top_k = k
        self.tail = tail

    def __call__(self, inputs: DistillInputs) -> Tensor:
        if inputs.top_logprobs is None or inputs.teacher_top_logprobs is None:
            raise ValueError("TopKForwardKL needs the student's and the teacher's top-k log-probs (top_logprobs)")
        log_p, log_q = inputs.teacher_top_logprobs, inputs.top_logprobs  # [n, T, k]
        loss = (log_p.exp() * (log_p - log_q)).sum(-1)  # [n, T]
        if not self.tail:
            return loss.clamp(min=0.0)  # [n, T]
        log_p_rest = _log_rest(log_p, self.REST_FLOOR)  # [n, T]
        log_q_rest = _log_rest(log_q, self.REST_FLOOR)  # [n, T]
        return loss + log_p_rest.exp() * (log_p_rest - log_q_rest)  # [n, T]


def _log_rest(top_logprobs: Tensor, floor: float) -> Tensor:
    """``log(max(1 - sum_k exp(top_logprobs), floor))`` per position, accurate when the sum is near 1."""
    rest = -torch.expm1(torch.logsumexp(top_logprobs, dim=-1))  # [n, T] 1 - sum_k p_k
    return torch.clamp(rest, min=floor).log()  # [n, T]
