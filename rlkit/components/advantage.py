"""Advantage estimators: turn rewards (and values or baselines) into per-token advantages.

Vocabulary: ``N`` completions (rows), ``T`` completion length. Every estimator reads one
:class:`AdvantageInputs` and returns ``(advantages, returns)``, both ``[N, T]`` and zero outside the mask.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass

import torch
from torch import Tensor

from rlkit.components.base import Component, Need
from rlkit.components.groups import Groups
from rlkit.components.whiten import masked_whiten


@dataclass
class AdvantageInputs:
    """Everything any estimator may need, for one rollout batch.

    Attributes:
        token_rewards: ``[N, T]`` rewards per token; outcome rewards sit on the last valid token.
        mask: ``[N, T]`` response mask (1 for completion tokens that count; holes allowed).
        group_ids: ``[N]`` int64 id of the prompt each completion answers; groups may be
            non-contiguous, singletons, or of mixed size.
        values: ``[N, T]`` critic values (GAE only).
        baselines: ``[N]`` reward of the greedy completion of the same prompt (ReMax only).
        reward_terms: ``[N, K]`` each reward function's outcome score, in the order of the reward
            functions (GDPO only).
        old_log_probs: ``[N, T]`` the trainer's log-probs of the sampled tokens (optimal token baseline).
        sum_pi_squared: ``[N, T]`` ``sum_v pi(v)^2`` over the vocabulary at each position, from the same
            forward (optimal token baseline; see ``rlkit.components.logprobs.sum_squared_probs``).
        is_weights: ``[N, T]`` rollout-correction weights (optimal token baseline with ``use_is_weights``).
        turn_ids: ``[N, T]`` int64 model turn of each token of a multi-turn episode, -1 on environment tokens
            and padding (per-turn estimators); None: every row is one turn.
    """

    token_rewards: Tensor
    mask: Tensor
    group_ids: Tensor
    values: Tensor | None = None
    baselines: Tensor | None = None
    reward_terms: Tensor | None = None
    old_log_probs: Tensor | None = None
    sum_pi_squared: Tensor | None = None
    is_weights: Tensor | None = None
    turn_ids: Tensor | None = None

    @classmethod
    def from_scores(cls, scores: Tensor, mask: Tensor, group_ids: Tensor, **kwargs) -> AdvantageInputs:
        """Place each completion's outcome score ``[N]`` on its last valid token."""
        mask = mask.to(scores.dtype)
        positions = torch.arange(mask.shape[1], device=mask.device)  # [T]
        last = (mask * positions).argmax(dim=1)  # [N] index of last valid token (0 for an empty row)
        token_rewards = torch.zeros_like(mask)  # [N, T]
        token_rewards[torch.arange(mask.shape[0], device=mask.device), last] = scores
        return cls(token_rewards=token_rewards * mask, mask=mask, group_ids=group_ids, **kwargs)


class Advantage(Component):
    """Base of every advantage estimator.

    ``needs`` (see :class:`~rlkit.components.base.Need`) says which optional :class:`AdvantageInputs` an
    estimator reads, so the family and the data side produce them: ``VALUES`` (a critic's values: only an
    actor-critic family provides them), ``GREEDY_BASELINES`` (ReMax), ``REWARD_TERMS`` (GDPO),
    ``OLD_LOGPROBS`` and ``SUM_PI_SQUARED`` (the optimal token baseline), ``IS_WEIGHTS``
    (rollout-correction weights, an instance setting where an estimator can use them or not).
    """

    @abstractmethod
    def __call__(self, inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
        """Return ``(advantages [N, T], returns [N, T])``, both multiplied by the mask."""


def _check_unit_interval(name: str, value: float, estimator: str) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(
            f"{estimator}: {name} must lie in [0, 1], got {value}. Use {name}=1.0 for no discounting "
            f"(the usual choice for LM outcome rewards) or a value just below 1 such as 0.99."
        )


def _require(inputs: AdvantageInputs, name: str, estimator: str, hint: str) -> Tensor:
    value = getattr(inputs, name)
    if value is None:
        raise ValueError(f"{estimator} needs AdvantageInputs.{name}, which is None: {hint}")
    return value


def _outcome(inputs: AdvantageInputs) -> tuple[Tensor, Tensor, Groups]:
    """The per-sequence score (sum of token rewards, as verl), the float mask and the groups."""
    scores = inputs.token_rewards.sum(-1)  # [N]
    mask = inputs.mask.to(scores.dtype)  # [N, T]
    return scores, mask, Groups(inputs.group_ids)


def _group_normalised(groups: Groups, scores: Tensor, eps: float) -> Tensor:
    """``(r - mean_g) / (std_g + eps)`` per row ``[N]``; a singleton uses mean 0, std 1 (verl ``grpo``)."""
    several = groups.count > 1  # [N]
    mean = torch.where(several, groups.mean(scores), 0.0)  # [N]
    std = torch.where(several, groups.std(scores), 1.0)  # [N]
    scale = std + eps  # [N]
    # eps=0 on an all-equal group would be 0/0: such a group carries no signal, so 0.
    return torch.where(scale > 0, (scores - mean) / scale, 0.0)  # [N]


def _check_eps(eps: float, estimator: str) -> None:
    if eps < 0:
        raise ValueError(f"{estimator}: eps must be >= 0, got {eps}; the usual value is 1e-6.")


def _group_mean_or_zero(groups: Groups, scores: Tensor) -> Tensor:
    """Group mean, with a singleton's baseline taken as 0 (verl ``grpo``: no peers, no baseline)."""
    return torch.where(groups.count > 1, groups.mean(scores), 0.0)  # [N]


def _reverse_discounted_sum(rewards: Tensor, mask: Tensor, discount: float) -> Tensor:
    """``R_t = r_t + discount * R_next`` over the unmasked tokens, right to left, ``[N, T]``.

    Masked positions (padding, or holes such as tool output inside a multi-turn completion) are
    skipped: they neither add their reward nor discount, and the running sum passes through them.
    """
    valid = mask.bool()  # [N, T]
    running = rewards.new_zeros(rewards.shape[0])  # [N]
    out = torch.zeros_like(rewards)  # [N, T]
    for t in reversed(range(rewards.shape[1])):  # a loop over time, not samples or groups
        running = torch.where(valid[:, t], rewards[:, t] + discount * running, running)  # [N]
        out[:, t] = running
    return out * mask


class GroupNorm(Advantage):
    """GRPO: group-normalised outcome reward (Shao et al. 2024, DeepSeekMath).

    ``A_i = (r_i - mean_g) / (std_g + eps)`` on every token, with ``r_i = Σ_t r_{i,t}`` and the
    unbiased std over the group ``g`` of completion ``i``. A singleton group uses mean 0 and std 1
    (as verl ``grpo``). Returns equal the advantages.

    Worked example (eps=0): group ``[1, 0, 0, 1]`` has mean 0.5 and std ``sqrt(4 * 0.25 / 3)
    = 0.57735``, so ``A = ±0.5 / 0.57735 = ±0.86603``; a singleton with reward 3 keeps ``A = 3``.

    Args:
        eps: added to the group std before dividing; keeps all-equal groups (std 0) at advantage 0.
    """

    def __init__(self, eps: float = 1e-6) -> None:
        _check_eps(eps, "GroupNorm")
        self.eps = eps

    def __call__(self, inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
        scores, mask, groups = _outcome(inputs)  # [N], [N, T]
        advantages = _group_normalised(groups, scores, self.eps).unsqueeze(-1) * mask  # [N, T]
        return advantages, advantages


class GroupMean(Advantage):
    """Dr.GRPO: group-mean baseline without std normalisation (Liu et al. 2025, "Understanding
    R1-Zero-Like Training").

    ``A_i = r_i - mean_g`` on every token (verl ``grpo`` with ``norm_adv_by_std_in_grpo=False``); a
    singleton group uses mean 0. Returns equal the advantages.

    Worked example: group ``[1, 2, 6]`` has mean 3, so ``A = [-2, -1, 3]``.
    """

    def __call__(self, inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
        scores, mask, groups = _outcome(inputs)  # [N], [N, T]
        advantages = (scores - _group_mean_or_zero(groups, scores)).unsqueeze(-1) * mask  # [N, T]
        return advantages, advantages


class LeaveOneOut(Advantage):
    """RLOO: leave-one-out baseline (Ahmadian et al. 2024, "Back to Basics").

    ``A_i = r_i - (Σ_{j in g, j != i} r_j) / (n_g - 1)`` on every token; returns equal the advantages.

    A singleton group has no other completion to form a baseline, so its advantage is 0 (as verl
    ``rloo_vectorized``). verl's loop version ``rloo`` instead keeps the raw reward: an unbaselined
    signal on another scale than the rest of the batch, which for 0/1 rewards only ever pushes up.
    With 0, every group's advantages sum to 0.

    Worked example: group ``[1, 2, 6]`` gives ``A = [1 - 4, 2 - 3.5, 6 - 1.5] = [-3, -1.5, 4.5]``.
    """

    def __call__(self, inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
        scores, mask, groups = _outcome(inputs)  # [N], [N, T]
        loo = scores - groups.leave_one_out_mean(scores)  # [N]
        advantages = torch.where(groups.count > 1, loo, 0.0).unsqueeze(-1) * mask  # [N, T]
        return advantages, advantages


class GreedyBaseline(Advantage):
    """ReMax: the greedy completion's reward as baseline (Li et al. 2023).

    ``A_{i,t} = Σ_{s>=t} r_{i,s} - b_i`` with ``b_i`` the reward of the greedy completion of the same
    prompt (``inputs.baselines [N]``); returns are the reward-to-go ``Σ_{s>=t} r_{i,s}``.

    Worked example: token rewards ``[0, 1, 2]``, baseline 1: returns ``[3, 3, 2]``, ``A = [2, 2, 1]``.
    """

    needs = frozenset({Need.GREEDY_BASELINES})

    def __call__(self, inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
        baselines = _require(
            inputs,
            "baselines",
            "GreedyBaseline (ReMax)",
            "the data side must also generate one greedy completion per prompt and pass its "
            "reward, one value per row [N].",
        )
        mask = inputs.mask.to(inputs.token_rewards.dtype)  # [N, T]
        masked = inputs.token_rewards * mask  # [N, T]
        returns = masked.flip(-1).cumsum(-1).flip(-1) * mask  # [N, T] reward-to-go
        advantages = (returns - baselines.unsqueeze(-1)) * mask  # [N, T]
        return advantages, returns


class DiscountedReturn(Advantage):
    """REINFORCE++: discounted return-to-go, whitened over the batch (Hu 2025).

    ``G_t = r_t + gamma * G_{t+1}``, ``A = (G - mean) / std`` over all unmasked tokens of the batch;
    returns are ``G``. Holes in the mask are skipped: the return flows through them undiscounted
    (as verl 0.9.1).

    Worked example (gamma=0.5): rewards ``[1, 0, 4]`` give ``G = [1 + 0.5*2, 0 + 0.5*4, 4] = [2, 2, 4]``;
    mean 8/3, unbiased var 4/3, so ``A = [-0.57735, -0.57735, 1.15470]``.

    Args:
        gamma: discount per token, in [0, 1]; 1.0 is the undiscounted return.
    """

    def __init__(self, gamma: float = 1.0) -> None:
        _check_unit_interval("gamma", gamma, "DiscountedReturn")
        self.gamma = gamma

    def __call__(self, inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
        mask = inputs.mask.to(inputs.token_rewards.dtype)  # [N, T]
        returns = _reverse_discounted_sum(inputs.token_rewards, mask, self.gamma)  # [N, T]
        advantages = masked_whiten(returns, mask) * mask  # [N, T]
        return advantages, returns


class GroupMeanWhitened(Advantage):
    """REINFORCE++-baseline: group-mean baseline, then whitening over the batch (Hu 2025).

    ``A_i = r_i - mean_g`` on every token (singleton: mean 0), then ``(A - mean) / std`` over all
    unmasked tokens of the batch (so a long completion weighs more in the statistics). Returns equal
    the advantages.

    Worked example: group rewards ``[1, 3]`` give ``[-1, 1]``; with lengths 1 and 3 the tokens are
    ``[-1, 1, 1, 1]``: mean 0.5, unbiased var 1, so ``A = [-1.5], [0.5, 0.5, 0.5]``.
    """

    def __call__(self, inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
        scores, mask, groups = _outcome(inputs)  # [N], [N, T]
        centred = (scores - _group_mean_or_zero(groups, scores)).unsqueeze(-1) * mask  # [N, T]
        advantages = masked_whiten(centred, mask) * mask  # [N, T]
        return advantages, advantages


class LengthWeightedBaseline(Advantage):
    """OPO: length-weighted group baseline (Hao et al. 2025, "On-Policy RL with Optimal Reward
    Baseline").

    ``A_i = r_i - b_g`` with ``b_g = Σ_{j in g} l_j r_j / Σ_{j in g} l_j`` and ``l_j`` the number of
    unmasked tokens; returns equal the advantages. A singleton group uses baseline 0 and keeps its
    reward (as verl ``opo``; the formula alone would give it 0).

    Worked example: rewards ``[2, 6]`` with lengths ``[1, 3]``: ``b = (2 + 18) / 4 = 5``,
    ``A = [-3, 1]``.
    """

    def __call__(self, inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
        scores, mask, groups = _outcome(inputs)  # [N], [N, T]
        lengths = mask.sum(-1)  # [N]
        baseline = torch.where(groups.count > 1, groups.weighted_mean(scores, lengths), 0.0)  # [N]
        advantages = (scores - baseline).unsqueeze(-1) * mask  # [N, T]
        return advantages, advantages


class GPGScaled(Advantage):
    """GPG: group-mean advantage scaled by the valid-sample ratio (Chu et al. 2025, "GPG").

    ``A_i = alpha * (r_i - mean_g)`` with ``alpha = N / max(1, #{i : r_i != 0})`` over the batch
    (verl ``gpg`` semantics, ``f_norm = 1``); a singleton group uses mean 0. Returns equal the
    advantages.

    Worked example: groups ``[1, 0]`` and ``[0, 0]``: one nonzero reward in 4, ``alpha = 4``, so
    ``A = [2, -2, 0, 0]``.
    """

    def __call__(self, inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
        scores, mask, groups = _outcome(inputs)  # [N], [N, T]
        alpha = scores.shape[0] / torch.count_nonzero(scores).clamp(min=1)  # []
        centred = scores - _group_mean_or_zero(groups, scores)  # [N]
        advantages = (alpha * centred).unsqueeze(-1) * mask  # [N, T]
        return advantages, advantages


class GAE(Advantage):
    """Generalised advantage estimation for a critic (Schulman et al. 2016).

    ``delta_t = r_t + gamma * V_{t+1} - V_t``, ``A_t = delta_t + gamma * lam * A_{t+1}``, computed over
    the unmasked tokens only: a hole in the mask (tool output) is skipped, its value and reward
    unused, and ``t+1`` is the next unmasked token (as verl). Returns are ``A + V`` before whitening;
    the advantages are then whitened over the batch if ``whiten``.

    Worked example (gamma=lam=0.5, no whitening): rewards ``[0, 0, 1]``, values ``[1, 2, 3]``:
    ``delta = [0 + 1 - 1, 0 + 1.5 - 2, 1 - 3] = [0, -0.5, -2]``,
    ``A = [0 + 0.25 * -1, -0.5 + 0.25 * -2, -2] = [-0.25, -1, -2]``, returns ``[0.75, 1, 1]``.

    Args:
        gamma: discount per token, in [0, 1].
        lam: GAE trade-off in [0, 1]: 0 is the one-step TD error, 1 the Monte-Carlo return minus V.
        whiten: whiten the advantages over the unmasked tokens of the batch (as verl).
    """

    needs = frozenset({Need.VALUES})

    def __init__(self, gamma: float = 1.0, lam: float = 1.0, whiten: bool = True) -> None:
        _check_unit_interval("gamma", gamma, "GAE")
        if not 0.0 <= lam <= 1.0:
            raise ValueError(
                f"GAE: lam must lie in [0, 1], got {lam}. Use lam=1.0 (Monte-Carlo, the usual choice "
                "for LM post-training) or e.g. 0.95 for a lower-variance estimate."
            )
        self.gamma = gamma
        self.lam = lam
        self.whiten = whiten

    def __call__(self, inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
        values = _require(
            inputs,
            "values",
            "GAE",
            "the data side must run the critic on each completion and pass its values, [N, T] "
            "like token_rewards (or pick a critic-free estimator such as GroupNorm).",
        ).detach()  # [N, T]
        rewards = inputs.token_rewards  # [N, T]
        mask = inputs.mask.to(rewards.dtype)  # [N, T]
        valid = mask.bool()  # [N, T]
        next_value = values.new_zeros(values.shape[0])  # [N] V of the next unmasked token
        running = values.new_zeros(values.shape[0])  # [N] A of the next unmasked token
        advantages = torch.zeros_like(values)  # [N, T]
        for t in reversed(range(values.shape[1])):  # a loop over time, not samples or groups
            delta = rewards[:, t] + self.gamma * next_value - values[:, t]  # [N]
            running = torch.where(valid[:, t], delta + self.gamma * self.lam * running, running)  # [N]
            next_value = torch.where(valid[:, t], values[:, t], next_value)  # [N]
            advantages[:, t] = running
        returns = (advantages + values) * mask  # [N, T]
        if self.whiten:
            advantages = masked_whiten(advantages, mask)  # [N, T]
        return advantages * mask, returns


class PassAtK(Advantage):
    """Pass@k GRPO: only each group's best completion is credited (verl ``grpo_passk``, after
    arXiv:2503.19595).

    The group's unique best completion gets ``A = (r_max - r_second) / (std_g + eps)`` on every token
    (``r_max - r_second`` without ``normalize_std``), every other completion 0; with a tie for the best
    the group's advantages are all 0. ``std_g`` is the unbiased std of the group. Like verl, a group of
    one completion is an error. Returns equal the advantages.

    Worked example: group ``[1, 0, 0, 0]``: ``r_max - r_second = 1``, std ``0.5``, so ``A = [2, 0, 0, 0]``
    (``[1, 0, 0, 0]`` without ``normalize_std``); group ``[1, 1, 0]`` gives all zeros.

    Args:
        normalize_std: divide by the group's std (verl's ``norm_adv_by_std_in_grpo``).
        eps: added to the group std before dividing.
    """

    def __init__(self, normalize_std: bool = True, eps: float = 1e-6) -> None:
        _check_eps(eps, "PassAtK")
        self.normalize_std = normalize_std
        self.eps = eps

    def __call__(self, inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
        scores, mask, groups = _outcome(inputs)  # [N], [N, T]
        if (groups.count < 2).any():
            raise ValueError(
                "PassAtK needs at least 2 completions per prompt (it credits the best over the second best), "
                "but a group has 1: set data.samples_per_prompt >= 2 and do not filter groups down to one."
            )
        best = groups.max(scores)  # [N]
        at_best = scores == best  # [N]
        ties = groups.sum(at_best.to(scores.dtype))  # [N] completions sharing the best score
        second = groups.max(torch.where(at_best, -torch.inf, scores))  # [N] best of the others
        winner = at_best & (ties == 1)  # [N]
        margin = torch.where(winner, best - second, 0.0)  # [N]
        if self.normalize_std:
            margin = margin / (groups.std(scores) + self.eps)  # [N]
        advantages = margin.unsqueeze(-1) * mask  # [N, T]
        return advantages, advantages


class GDPO(Advantage):
    """GDPO: each reward function normalised within its group before the sum (arXiv:2601.05242;
    verl ``gdpo``).

    ``A = whiten(sum_k w_k GRPO(r_k))``: every reward function's score ``r_k`` (``inputs.reward_terms``,
    ``[N, K]``) is group-normalised on its own as ``GroupNorm`` does (``r_k - mean_g`` without
    ``normalize_std``), so a reward with a large scale does not drown a small one; the weighted sum is
    then whitened over all valid tokens of the batch. With one reward function this is verl's ``gdpo``
    without its per-key config (GRPO, then whitening). A NaN score (a reward function that does not apply
    to that completion) counts as 0, as in the weighted total. Returns equal the advantages.

    Worked example (one group, ``eps=0``): format ``[1, 1, 0, 0]`` and accuracy ``[1, 0, 1, 0]`` each
    normalise to ``+-0.866``, summing to ``[1.732, 0, 0, -1.732]``; one token per row whitens that to
    ``[1.225, 0, 0, -1.225]`` (mean 0, unbiased std 1).

    Args:
        weights: one weight per reward function, in their order; None weighs each by 1.
        normalize_std: divide each reward's centred score by its group std.
        eps: added to the group std before dividing.
    """

    needs = frozenset({Need.REWARD_TERMS})

    def __init__(self, weights: list[float] | None = None, normalize_std: bool = True, eps: float = 1e-6) -> None:
        _check_eps(eps, "GDPO")
        self.weights = None if weights is None else [float(w) for w in weights]
        self.normalize_std = normalize_std
        self.eps = eps

    def __call__(self, inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
        terms = _require(
            inputs,
            "reward_terms",
            "GDPO",
            "the caller must pass each reward function's score per completion, [N, K] (the rollout's reward_terms).",
        ).nan_to_num(nan=0.0)  # [N, K]
        _, mask, groups = _outcome(inputs)  # [N, T]
        if self.weights is not None and len(self.weights) != terms.shape[-1]:
            raise ValueError(
                f"GDPO has {len(self.weights)} weights for {terms.shape[-1]} reward functions: give one weight "
                "per reward function, in their order, or none."
            )
        weights = terms.new_tensor(self.weights) if self.weights is not None else terms.new_ones(terms.shape[-1])  # [K]
        total = terms.new_zeros(terms.shape[0])  # [N]
        for k in range(terms.shape[-1]):  # a loop over reward functions, not groups
            score = terms[:, k]  # [N]
            normed = (
                _group_normalised(groups, score, self.eps)
                if self.normalize_std
                else score - _group_mean_or_zero(groups, score)
            )  # [N]
            total = total + weights[k] * normed  # [N]
        advantages = masked_whiten(total.unsqueeze(-1) * mask, mask) * mask  # [N, T]
        return advantages, advantages
