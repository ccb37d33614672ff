"""From a rollout's scores to the advantage estimator's inputs, with the KL penalty in the reward if asked.

Every family that computes advantages calls :func:`advantage_inputs`; a family configured with
``kl_in_reward`` holds a :class:`KLInReward`, a submodule so that its controller's coefficient lands in the
Lightning checkpoint (``<name>._extra_state``) and an adaptive ``beta`` resumes exactly.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
from torch import Tensor, nn

from rlkit.components.advantage import Advantage, AdvantageInputs
from rlkit.components.base import Need
from rlkit.components.kl_reward import KLPenalty
from rlkit.data.batch import Rollout
from rlkit.spine.metrics import StepMetrics
from rlkit.spine.policy import TokenScores
from rlkit.spine.reporting import settings


def sum_over_ranks(values: Tensor) -> Tensor:
    """``values`` summed over the data-parallel ranks (a copy; itself in one process)."""
    values = values.detach().clone()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(values)
    return values


class KLInReward(nn.Module):
    """Applies a :class:`~rlkit.components.kl_reward.KLPenalty` to a rollout and updates its controller.

    The controller sees the mean per-sequence KL of the whole step (summed over ranks: every rank keeps the
    same ``beta``) and the step's number of sequences, as verl's ``apply_kl_penalty``. Logs
    ``reward/kl_penalty`` (that mean KL) and ``reward/kl_coef`` (the ``beta`` used for this rollout).

    Args:
        penalty: the estimator and its coefficient controller.
    """

    def __init__(self, penalty: KLPenalty) -> None:
        super().__init__()
        self.penalty = penalty

    def get_extra_state(self) -> dict[str, float]:
        return {"coef": float(self.penalty.controller.coef)}

    def set_extra_state(self, state: dict[str, float]) -> None:
        self.penalty.controller.coef = state["coef"]

    def forward(
        self, token_rewards: Tensor, old_logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, metrics: StepMetrics
    ) -> Tensor:
        coef = self.penalty.controller.coef
        rewards, kl = self.penalty(token_rewards, old_logprobs, ref_logprobs, mask)  # [N, T], [N, T]
        per_sequence = kl.sum(-1) / mask.sum(-1).clamp(min=1)  # [N]
        count = per_sequence.new_tensor(float(len(mask)))
        totals = sum_over_ranks(torch.stack([per_sequence.sum(), count]).double())  # [2]
        current_kl = (totals[0] / totals[1].clamp(min=1)).item()
        self.penalty.controller.update(current_kl, int(totals[1].item()))
        metrics.update("reward/kl_penalty", per_sequence.mean() if len(mask) else 0.0, len(mask))
        metrics.update("reward/kl_coef", coef)
        return rewards


def advantage_inputs(
    advantage: Advantage,
    rollout: Rollout,
    metrics: StepMetrics,
    *,
    old_logprobs: Tensor,
    own: TokenScores | None = None,
    reference: Tensor | None = None,
    kl_in_reward: KLInReward | None = None,
    mask: Tensor | None = None,
    is_weights: Tensor | None = None,
    values: Tensor | None = None,
) -> AdvantageInputs:
    """The inputs ``advantage`` reads, by its declared needs: each score on its completion's last token (by
    the rollout's mask; an episode's per-turn rewards on its turns' last tokens, with its turn ids), the
    estimator's ``mask`` (None: the rollout's; a rollout correction's kept tokens), minus the KL penalty in
    the reward on that mask if any, and the optional inputs it needs (each reward function's scores, the
    scoring pass's ``own`` log-probs and ``sum pi^2``, correction weights, a critic's ``values``).
    ``old_logprobs`` are what the KL penalty compares with the reference."""
    needs = advantage.needs
    optional: dict[str, Tensor] = {}
    if Need.REWARD_TERMS in needs:
        terms = list(rollout.reward_terms.values())
        optional["reward_terms"] = torch.stack(terms, -1) if terms else rollout.scores.unsqueeze(-1)  # [N, K]
    if Need.SUM_PI_SQUARED in needs:
        optional.update(old_log_probs=own.logprobs, sum_pi_squared=own.sum_pi_squared)
    if Need.IS_WEIGHTS in needs:
        optional["is_weights"] = is_weights
    if Need.VALUES in needs:
        optional["values"] = values
    if rollout.token_rewards is None:
        inputs = AdvantageInputs.from_scores(
            rollout.scores, rollout.completion_mask, rollout.group_ids, baselines=rollout.baselines, **optional
        )
    else:  # episodes: per-turn rewards on each turn's last model token, the outcome on the last one
        inputs = AdvantageInputs(
            token_rewards=rollout.token_rewards * rollout.completion_mask,  # [N, T]
            mask=rollout.completion_mask,
            group_ids=rollout.group_ids,
            baselines=rollout.baselines,
            turn_ids=rollout.turn_ids,
            **optional,
        )
    if mask is not None:
        inputs = replace(inputs, mask=mask)
    if kl_in_reward is not None:
        inputs.token_rewards = kl_in_reward(inputs.token_rewards, old_logprobs, reference, inputs.mask, metrics)
    return inputs


def kl_in_reward_settings(kl_in_reward: KLInReward | None) -> dict[str, object]:
    """``kl_in_reward``'s estimator and controller settings, for the HPARAMS tab."""
    if kl_in_reward is None:
        return {"kl_in_reward": "none"}
    penalty = kl_in_reward.penalty
    return {**settings("kl_in_reward.kl", penalty.kl), **settings("kl_in_reward.controller", penalty.controller)}
