"""Importance ratios between the current policy and the policy that produced the rollout."""

from __future__ import annotations

from abc import abstractmethod

import torch
from torch import Tensor

from rlkit.components.base import Component, Need


class Ratio(Component):
    """Base of every importance ratio.

    ``__call__(log_prob, old_log_prob, mask)`` takes ``[N, T]`` tensors (``log_prob`` carries the
    gradient) and returns the ``[N, T]`` per-token ratio the clip acts on.
    """

    provides = frozenset({Need.RATIO})  # a ratio around 1; LogProb, which passes log pi, provides none

    @abstractmethod
    def __call__(self, log_prob: Tensor, old_log_prob: Tensor, mask: Tensor) -> Tensor: ...


def _check_bound(name: str, value: float | None, ratio: str, example: float) -> None:
    if value is not None and not value > 0:
        raise ValueError(f"{ratio}: {name}={value} must be > 0 (verl uses {example}), or None for no clamp.")


class TokenRatio(Ratio):
    """Per-token ratio of PPO (Schulman et al. 2017): ``r_t = pi(y_t) / pi_old(y_t)``.

    Computed as ``exp(clamp(log pi - log pi_old, -m, m))`` with ``m = max_abs_log_ratio``; the clamp (20
    in verl's ``vanilla``, ``cispo``, ``sapo`` and ``dppo_*`` losses) keeps far off-policy tokens
    finite, and has zero gradient where it is active. verl's ``clip_cov`` and ``kl_cov`` do not clamp:
    ``max_abs_log_ratio=None`` reproduces them.

    Args:
        max_abs_log_ratio: clamp ``log pi - log pi_old`` to ``[-m, m]`` before ``exp``; None: no clamp (a
            ratio then overflows to inf in float32 beyond ``log r`` ~88).
    """

    def __init__(self, max_abs_log_ratio: float | None = 20.0) -> None:
        _check_bound("max_abs_log_ratio", max_abs_log_ratio, "TokenRatio", 20.0)
        self.max_abs_log_ratio = max_abs_log_ratio

    def __call__(self, log_prob: Tensor, old_log_prob: Tensor, mask: Tensor) -> Tensor:
        log_ratio = log_prob - old_log_prob  # [N, T]
        if self.max_abs_log_ratio is not None:
            log_ratio = torch.clamp(log_ratio, min=-self.max_abs_log_ratio, max=self.max_abs_log_ratio)  # [N, T]
        return torch.exp(log_ratio)  # [N, T]


class SequenceRatio(Ratio):
    """Sequence-level ratio of GSPO (Zheng et al. 2025), in its token-level form.

    ``s_i = exp(mean_t (log pi - log pi_old))`` over the valid tokens of row ``i``, broadcast to
    tokens as ``s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)]``: the value of every token is ``s_i``, and
    with advantages constant along a row and ``SeqMeanTokenMean`` the gradient is exactly that of
    the sequence-level objective ``-A_i * s_i`` (``d s_i / d log pi_t = s_i / |y_i|``). The log-ratio
    is clamped above at ``max_log_ratio`` (10, as verl). An empty row gets ``s_i = 1``.

    Args:
        max_log_ratio: clamp ``log s_i,t`` above at this before ``exp``; None: no clamp.
    """

    def __init__(self, max_log_ratio: float | None = 10.0) -> None:
        _check_bound("max_log_ratio", max_log_ratio, "SequenceRatio", 10.0)
        self.max_log_ratio = max_log_ratio

    def __call__(self, log_prob: Tensor, old_log_prob: Tensor, mask: Tensor) -> Tensor:
        mask = mask.to(log_prob.dtype)  # [N, T]
        lengths = mask.sum(dim=-1).clamp(min=1)  # [N]
        seq_log_ratio = ((log_prob - old_log_prob) * mask).sum(dim=-1) / lengths  # [N]
        # value sg[log s_i], gradient that of log pi_t
        log_ratio = seq_log_ratio.detach().unsqueeze(-1) + log_prob - log_prob.detach()  # [N, T]
        if self.max_log_ratio is not None:
            log_ratio = torch.clamp(log_ratio, max=self.max_log_ratio)  # [N, T]
        return torch.exp(log_ratio)  # [N, T]


class LogProb(Ratio):
    """``log pi`` itself in place of the ratio: the REINFORCE / GPG surrogate (Chu et al. 2025).

    With ``NoClip`` the per-token loss is ``-A_t * log pi(y_t)`` (verl's ``gpg`` loss), whose gradient
    ``-A_t * grad log pi`` equals that of ``-A_t * r_t`` on-policy (``r_t = 1``, ``grad r_t = grad
    log pi``). Its value is not a ratio: do not combine it with a clip that bounds the ratio
    (``PPOClip``, ``CISPO``, ``SAPO``); ``DRO`` with ``LogProb`` is verl's ``dro`` loss.
    """

    provides = frozenset()

    def __call__(self, log_prob: Tensor, old_log_prob: Tensor, mask: Tensor) -> Tensor:
        return log_prob  # [N, T]
