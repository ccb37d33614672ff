"""GMPO: the geometric mean of clipped token ratios as the sequence ratio."""

from __future__ import annotations

import torch

from rlkit.components.clip import Clip, ClipInputs, ClipOutput, _check_eps


class GMPO(Clip):
    """Geometric-Mean Policy Optimization (Zhao et al. 2025, arXiv:2507.20673; verl ``geo_mean``).

    Each token's log-ratio ``l_t = log pi - log pi_old`` is clipped in log space on the side its
    advantage pushes, ``c_t = sgn(A) min(sgn(A) l_t, sgn(A) clamp(l_t, -eps_low, eps_high))``; the row's
    ratio is their geometric mean ``s_i = exp(mean_t c_t)`` and its loss ``-A_i s_i`` with ``A_i`` the
    row's mean advantage (GMPO assumes one advantage per sequence). In token form every token carries
    ``-A_i sg[s_i] exp(c_t - sg[c_t])``: with ``SeqMeanTokenMean`` this is exactly the sequence loss and
    its gradient (verl ignores the aggregation it is given and takes the mean over rows). GMPO's
    geometric mean is its own sequence ratio: the Ratio component's output is not used.

    Where rlkit differs from verl 0.9.1 (kept, and tested): verl averages over *all* rows, so an empty
    row dilutes the mean, while rlkit's aggregation counts only rows with a token (as verl's own
    ``agg_loss``); and rollout-correction weights multiply each token (an arithmetic mean over the row),
    where verl's ``geo_mean`` takes their geometric mean.

    ``clipped``: ``"upper"`` tokens with ``A > 0`` whose log-ratio left ``[-eps_low, eps_high]`` (verl's
    ``actor/pg_clipfrac``), ``"lower"`` the same for ``A < 0`` (verl's ``actor/pg_clipfrac_lower``),
    ``"fraction"`` either; as verl's metrics they count a token outside the range even on the side
    where the pessimistic ``min`` keeps its log-ratio. verl's example uses ``eps_low = eps_high = 0.4``.

    Args:
        eps_low: log-ratio floor ``-eps_low`` (applies where ``A < 0``); > 0.
        eps_high: log-ratio ceiling ``eps_high`` (applies where ``A > 0``); > 0.
    """

    def __init__(self, eps_low: float = 0.4, eps_high: float = 0.4):
        _check_eps("eps_low", eps_low, "GMPO", "the log-ratio floor is -eps_low (GMPO's example: 0.4).")
        _check_eps("eps_high", eps_high, "GMPO", "the log-ratio ceiling is eps_high (GMPO's example: 0.4).")
        self.eps_low = eps_low
        self.eps_high = eps_high

    def __call__(self, inputs: ClipInputs) -> ClipOutput:
        mask = inputs.mask.to(inputs.log_prob.dtype)  # [N, T]
        advantages = inputs.advantages  # [N, T]
        log_ratio = inputs.log_prob - inputs.old_log_prob  # [N, T]
        bounded = torch.clamp(log_ratio, -self.eps_low, self.eps_high)  # [N, T]
        sign = torch.sign(advantages)  # [N, T]
        clipped_log_ratio = sign * torch.minimum(sign * log_ratio, sign * bounded)  # [N, T]
        lengths = mask.sum(dim=-1).clamp(min=1)  # [N]
        seq_log_ratio = (clipped_log_ratio * mask).sum(dim=-1) / lengths  # [N]
        seq_advantage = (advantages * mask).sum(dim=-1) / lengths  # [N]
        # value s_i on every token; gradient that of c_t (so the row mean recovers d s_i)
        token_form = torch.exp(seq_log_ratio.detach()).unsqueeze(-1) * torch.exp(
            clipped_log_ratio - clipped_log_ratio.detach()
        )  # [N, T]
        loss = -seq_advantage.unsqueeze(-1) * token_form  # [N, T]
        left = (log_ratio != bounded) & inputs.mask.bool()  # [N, T]
        upper, lower = left & (advantages > 0), left & (advantages < 0)  # [N, T]
        return ClipOutput(loss=loss, clipped={"fraction": upper | lower, "lower": lower, "upper": upper})
