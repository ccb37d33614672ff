"""The optimal token baseline (OTB): a per-position baseline weighted by the realized energy.

The optimal token baseline (arXiv:2602.07078; verl ``optimal_token_baseline``). With the reward-to-go ``G_t`` and the
cumulative path-variance proxy ``W_t = sum_{j<=t} (1 - 2 pi_j + sum_v pi(v)^2)`` (the squared norm of
the logit gradient of token ``j``, ``pi_j = pi_old(y_j)``), the variance-minimising baseline at
position ``t`` within a group of completions of one prompt is

    B_t = sum_i G_t^i W_t^i / (sum_i W_t^i + eps),     A_t = G_t - B_t.

With rollout-correction weights ``rho_t`` (``use_is_weights``), each ``w_j`` is scaled by ``rho_j^2``.
A prompt with a single completion gets ``B = 0`` (``A = G``). ``handle_zero_tail``: past the end of the
second-longest completion of a group, the longest one has no peer at its positions; its baseline there
is set to 0 rather than to (almost) its own return.

``sum_v pi(v)^2`` comes from the trainer's forward: ``rlkit.components.logprobs.sum_squared_probs``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlkit.components.advantage import Advantage, AdvantageInputs, _require
from rlkit.components.base import Need
from rlkit.components.groups import Groups


def _needs(use_is_weights: bool) -> frozenset[Need]:
    """The optimal baseline reads the policy's log-probs and sum pi^2 before the update, and the correction's
    weights if asked."""
    needs = {Need.OLD_LOGPROBS, Need.SUM_PI_SQUARED}
    return frozenset(needs | {Need.IS_WEIGHTS} if use_is_weights else needs)


def _returns_and_energy(inputs: AdvantageInputs, use_is_weights: bool, estimator: str) -> tuple[Tensor, Tensor]:
    """Reward-to-go ``G [N, T]`` and cumulative energy ``W [N, T]`` (both over the valid tokens)."""
    hint = "the trainer must compute it in its old log-prob forward when the advantage requires it."
    old_log_probs = _require(inputs, "old_log_probs", estimator, hint)  # [N, T]
    sum_pi_squared = _require(inputs, "sum_pi_squared", estimator, hint)  # [N, T]
    mask = inputs.mask.to(inputs.token_rewards.dtype)  # [N, T]
    returns = (inputs.token_rewards * mask).flip(-1).cumsum(-1).flip(-1)  # [N, T] reward-to-go
    energy = 1.0 - 2.0 * torch.exp(old_log_probs) + sum_pi_squared  # [N, T] ||s_j||^2
    if use_is_weights:
        is_weights = _require(
            inputs, "is_weights", estimator, "switch on a rollout correction, or set use_is_weights=false."
        )  # [N, T]
        energy = energy * is_weights.square()  # [N, T]
    return returns, (energy * mask).cumsum(-1)  # [N, T], [N, T]


def _group_baseline(
    groups: Groups, returns: Tensor, energy: Tensor, valid: Tensor, positions: Tensor, width: int, eps: float
) -> Tensor:
    """``B`` of every valid token ``[N, T]``: sums over the rows of its group at its position index."""
    key = groups.index.unsqueeze(-1) * width + positions  # [N, T] (group, position) cell of each token
    key = torch.where(valid, key, 0)  # [N, T]
    weight = torch.where(valid, energy, 0.0)  # [N, T]
    cells = groups.num_groups * width
    numerator = returns.new_zeros(cells).index_add_(0, key.flatten(), (returns * weight).flatten())  # [G * W]
    denominator = returns.new_zeros(cells).index_add_(0, key.flatten(), weight.flatten())  # [G * W]
    return (numerator / (denominator + eps))[key]  # [N, T]


def _zero_tail(groups: Groups, lengths: Tensor, rows: Tensor, positions: Tensor) -> Tensor:
    """``[N, T]`` True where a group's unique longest row runs past the second-longest row."""
    lengths = torch.where(rows, lengths, -torch.inf)  # [N] rows not in any group do not count
    longest = groups.max(lengths)  # [N]
    at_longest = rows & (lengths == longest)  # [N]
    unique = groups.sum(at_longest.to(lengths.dtype)) == 1  # [N]
    second = groups.max(torch.where(at_longest, -torch.inf, lengths))  # [N]
    tail = at_longest & unique & (longest > second)  # [N]
    return tail.unsqueeze(-1) & (positions >= second.unsqueeze(-1))  # [N, T]


def _check(eps: float, estimator: str) -> None:
    if eps < 0:
        raise ValueError(f"{estimator}: eps must be >= 0, got {eps}; the usual value is 1e-8.")


class OptimalTokenBaseline(Advantage):
    """The optimal token baseline at each position ``t`` of the completion (verl ``optimal_token_baseline``).

    Positions are the columns of ``[N, T]``: tokens of different completions at the same column share a
    baseline. See the module docstring for the formula. Returns are the reward-to-go.

    Worked example (one group, rewards 1 and 0 on the last of 2 tokens, ``W = [1, 2]`` in both rows,
    ``eps = 0``, no zero tail): ``G = [[1, 1], [0, 0]]``, ``B = [0.5, 0.5]``, ``A = [[0.5, 0.5], [-0.5, -0.5]]``.

    Args:
        handle_zero_tail: zero the baseline of a group's unique longest completion past the end of the
            second-longest one (verl's default True).
        use_is_weights: scale the energy by the squared rollout-correction weights (needs a correction
            on; verl uses them whenever its rollout correction is on).
        eps: added to the denominator.
    """

    def __init__(self, handle_zero_tail: bool = True, use_is_weights: bool = False, eps: float = 1e-8) -> None:
        _check(eps, "OptimalTokenBaseline")
        self.handle_zero_tail = handle_zero_tail
        self.use_is_weights = use_is_weights
        self.eps = eps
        self.use_is_weights = use_is_weights
        self.needs = _needs(use_is_weights)

    def __call__(self, inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
        returns, energy = _returns_and_energy(inputs, self.use_is_weights, "OptimalTokenBaseline")  # [N, T] x 2
        mask = inputs.mask.to(returns.dtype)  # [N, T]
        valid = mask.bool()  # [N, T]
        groups = Groups(inputs.group_ids)
        positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)  # [N, T]
        baseline = _group_baseline(groups, returns, energy, valid, positions, mask.shape[1], self.eps)  # [N, T]
        baseline = torch.where((groups.count > 1).unsqueeze(-1), baseline, 0.0)  # [N, T]
        if self.handle_zero_tail:
            everyone = torch.ones_like(groups.count, dtype=torch.bool)  # [N] verl counts empty rows here
            tail = _zero_tail(groups, mask.sum(-1), everyone & (groups.count > 1), positions)  # [N, T]
            baseline = torch.where(tail, 0.0, baseline)  # [N, T]
        return (returns - baseline) * mask, returns * mask


class MultiTurnOptimalTokenBaseline(Advantage):
    """The optimal token baseline over the *valid* tokens of multi-turn completions (verl
    ``tir_optimal_token_baseline``).

    Positions count only valid tokens: the ``k``-th generated token of every completion shares a
    baseline, whatever tool output (mask holes) came before it. Empty completions are left out of their
    group. Otherwise as :class:`OptimalTokenBaseline`; returns are the reward-to-go.

    Args:
        handle_zero_tail: zero the baseline of a group's unique longest completion past the end of the
            second-longest one.
        use_is_weights: scale the energy by the squared rollout-correction weights.
        eps: added to the denominator.
    """

    def __init__(self, handle_zero_tail: bool = True, use_is_weights: bool = False, eps: float = 1e-8) -> None:
        _check(eps, "MultiTurnOptimalTokenBaseline")
        self.handle_zero_tail = handle_zero_tail
        self.use_is_weights = use_is_weights
        self.eps = eps
        self.use_is_weights = use_is_weights
        self.needs = _needs(use_is_weights)

    def __call__(self, inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
        returns, energy = _returns_and_energy(inputs, self.use_is_weights, "MultiTurnOptimalTokenBaseline")
        mask = inputs.mask.to(returns.dtype)  # [N, T]
        valid = mask.bool()  # [N, T]
        groups = Groups(inputs.group_ids)
        positions = valid.long().cumsum(-1) - 1  # [N, T] index among the row's valid tokens
        lengths = mask.sum(-1)  # [N]
        present = lengths > 0  # [N] empty completions are in no group
        peers = groups.sum(present.to(mask.dtype))  # [N] non-empty completions of the prompt
        baseline = _group_baseline(groups, returns, energy, valid, positions, mask.shape[1], self.eps)  # [N, T]
        baseline = torch.where((peers > 1).unsqueeze(-1), baseline, 0.0)  # [N, T]
        if self.handle_zero_tail:
            tail = _zero_tail(groups, lengths, present & (peers > 1), positions)  # [N, T]
            baseline = torch.where(tail, 0.0, baseline)  # [N, T]
        return (returns - baseline) * mask, returns * mask
