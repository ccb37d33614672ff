"""OnlineDPO: preference pairs from the policy's own rollouts (Guo et al. 2024, "Direct Language Model
Alignment from Online AI Feedback"; verl's and TRL's online DPO).

Each group's highest- and lowest-reward completions form a pair (a group whose rewards are all equal gives
none); a pairwise loss (``SigmoidDPO``, Rafailov et al. 2023; ``IPO``) compares their log-ratios to the
frozen reference. Written as a family from outside rlkit would be: only the spine's public face.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from rlkit.components.aggregation import StepTotals
from rlkit.components.pairwise import PairwiseLoss, best_and_worst
from rlkit.data.batch import Rollout
from rlkit.errors import ConfigError
from rlkit.spine import Family, LossInputs


class OnlineDPO(Family):
    """Online DPO: per pair ``loss(log pi(y_w) - log pi_ref(y_w), log pi(y_l) - log pi_ref(y_l))``, each
    completion's log-probs summed over its tokens, averaged over the optimizer step's pairs (all ranks).

    Args:
        loss: the pairwise loss (``SigmoidDPO`` with its ``beta``; ``IPO``).
        **shared: the settings every family shares (see :class:`~rlkit.spine.family.Family`); a pair's two
            rows must share a micro-batch, so ``loop.keep_groups`` must be true.
    """

    def __init__(self, loss: PairwiseLoss, **shared) -> None:
        super().__init__(**shared)
        if not self.spine.loop.keep_groups:
            raise ConfigError(
                "OnlineDPO scores a pair's two completions together: set --model.loop.keep_groups=true "
                "(configs/algorithms/online_dpo.yaml does)"
            )
        self.spine.declare(type(self), self.provides, loss=loss)
        self.loss = loss

    def training_step(self, rollout: Rollout, batch_idx: int) -> None:
        spine = self.spine
        step = spine.begin(rollout)
        pairs = best_and_worst(rollout.scores, rollout.group_ids, rollout.completion_mask.sum(-1) > 0)  # [P, 2]
        trained = self._pairs_rollout(rollout, pairs)
        _, frozen = spine.score_before_updates(self, trained)
        step.lap("logprob")
        spine.update(self, trained, LossInputs(ref_logprobs=frozen["reference"]), self._micro_step)
        step.lap("update")
        spine.finish(self, step, extra={"dpo/pairs": float(len(pairs))})

    def _pairs_rollout(self, rollout: Rollout, pairs: Tensor) -> Rollout:
        """The pairs' rows (chosen, rejected, ...), with at least one pair per mini-batch on every rank
        (ranks step together): a missing one is row 0 twice, its completion mask zeroed so it counts nowhere."""
        missing = max(self.spine.loop.minibatches - len(pairs), 0)
        rows = torch.cat([pairs.flatten(), torch.zeros(2 * missing, dtype=torch.long)])
        trained = rollout.select(rows.to(rollout.scores.device))
        if not missing:
            return trained
        pad = slice(len(rows) - 2 * missing, len(rows))
        mask, groups = trained.completion_mask.clone(), trained.group_ids.clone()
        mask[pad] = 0.0
        groups[pad] = int(groups.max()) + 1 + torch.arange(missing, device=groups.device).repeat_interleave(2)
        return replace(trained, completion_mask=mask, group_ids=groups)

    def _micro_step(self, micro: Rollout, inputs: LossInputs, totals: StepTotals) -> tuple[Tensor, dict[str, Tensor]]:
        mask = micro.completion_mask  # [n, T]
        logprobs = self.policy(micro, micro.temperature).logprobs  # [n, T]
        log_ratio = ((logprobs - inputs.ref_logprobs) * mask).sum(-1)  # [n] log pi(y) - log pi_ref(y)
        chosen, rejected = _pair_rows(micro)  # [p], [p]
        losses = self.loss(log_ratio[chosen], log_ratio[rejected])  # [p]
        margin = self.loss.beta * (log_ratio[chosen] - log_ratio[rejected]).detach()  # [p] implicit rewards' gap
        scale = totals.world_size / max(totals.num_sequences / 2, 1)  # 1 / pairs of the step (DDP averages)
        # 0 * the log-ratios: a micro-batch without a pair still backpropagates through every parameter
        loss = losses.sum() * scale + 0.0 * log_ratio.sum()
        terms = {
            "loss/policy": loss.detach(),
            "dpo/margin": margin.sum() * scale,
            "dpo/accuracy": (margin > 0).float().sum() * scale,
            "dpo/chosen_log_ratio": log_ratio[chosen].detach().sum() * scale,
            "dpo/rejected_log_ratio": log_ratio[rejected].detach().sum() * scale,
        }
        return loss, terms


def _pair_rows(micro: Rollout) -> tuple[Tensor, Tensor]:
    """The chosen and rejected row of each pair in ``micro`` (a pair: the two counted rows of one group,
    the chosen scored higher)."""
    counted = micro.completion_mask.sum(-1) > 0  # [n]
    chosen, rejected = [], []
    for group in torch.unique(micro.group_ids[counted]).tolist():
        rows = ((micro.group_ids == group) & counted).nonzero().flatten()  # [2]
        high = int(micro.scores[rows].argmax())
        chosen.append(rows[high])
        rejected.append(rows[1 - high])
    empty = torch.zeros(0, dtype=torch.long, device=micro.scores.device)
    return (torch.stack(chosen), torch.stack(rejected)) if chosen else (empty, empty)
