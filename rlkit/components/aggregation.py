"""Loss aggregation: reduce a per-token loss ``[N, T]`` to the scalar the optimizer sees.

Every aggregation divides by totals of the whole optimizer step (:class:`StepTotals`), never by
counts of the micro-batch at hand, so the micro-batch losses *sum* to the whole-step loss and
their gradients accumulate to the whole-step gradient, whatever the micro-batching and however
many data-parallel ranks.

Empty rows (a sequence with no valid token, e.g. fully masked by an overlong filter) contribute no
loss and are not counted as sequences, as in verl's ``agg_loss``: a masked-out completion does not
dilute the others. If the step has no valid token at all, every aggregation returns 0 (not NaN).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass

from torch import Tensor

from rlkit.components.base import Component


@dataclass(frozen=True)
class StepTotals:
    """Totals of the whole optimizer step: summed over all micro-batches and all ranks.

    Attributes:
        num_sequences: sequences in the optimizer step that have at least one valid token (empty
            rows carry no loss and are not counted, as in verl).
        num_tokens: valid (masked-in) tokens in the optimizer step.
        world_size: data-parallel ranks. DDP/FSDP *average* gradients over ranks, so each rank's
            loss is multiplied by ``world_size`` to make the global normaliser exact.
        max_length: the constant length normaliser of ``SeqMeanTokenSumNorm`` (e.g. the maximum
            completion length); ``None`` means the padded length ``T`` of the batch (verl's default).
    """

    num_sequences: int
    num_tokens: int
    world_size: int = 1
    max_length: int | None = None

    @classmethod
    def from_masks(cls, masks: Iterable[Tensor], world_size: int = 1, max_length: int | None = None) -> StepTotals:
        """Count the step's sequences and tokens from the ``[n, T]`` masks of its micro-batches.

        With several ranks, all-reduce (sum) the two counts across ranks before building the totals.
        """
        num_sequences = num_tokens = 0
        for mask in masks:
            num_sequences += int((mask.sum(dim=-1) > 0).sum())
            num_tokens += int(mask.sum())
        return cls(num_sequences, num_tokens, world_size, max_length)


def _resolve(mask: Tensor, totals: StepTotals | None) -> StepTotals:
    """The step totals; ``None`` means this micro-batch is the whole step."""
    return StepTotals.from_masks([mask]) if totals is None else totals


class Aggregation(Component):
    """Base of every aggregation.

    ``__call__(loss_mat, mask, totals=None)``: ``loss_mat`` and ``mask`` are one micro-batch's
    ``[n, T]``; with ``totals`` of the whole step, the micro-batch results *sum* to the whole-step
    loss. With ``totals=None`` the micro-batch is taken to be the whole step.
    """

    @abstractmethod
    def __call__(self, loss_mat: Tensor, mask: Tensor, totals: StepTotals | None = None) -> Tensor: ...


class TokenMean(Aggregation):
    """Mean over all valid tokens of the step (DAPO, Yu et al. 2025): ``sum_i,t l_i,t / sum_i |y_i|``.

    verl ``token-mean``.
    """

    def __call__(self, loss_mat: Tensor, mask: Tensor, totals: StepTotals | None = None) -> Tensor:
        totals = _resolve(mask, totals)
        total = (loss_mat * mask).sum()  # []
        return total * totals.world_size / max(totals.num_tokens, 1)


class TokenSum(Aggregation):
    """Sum over all valid tokens of the step: ``sum_i,t l_i,t``. verl ``token-sum``."""

    def __call__(self, loss_mat: Tensor, mask: Tensor, totals: StepTotals | None = None) -> Tensor:
        totals = _resolve(mask, totals)
        return (loss_mat * mask).sum() * totals.world_size


class SeqMeanTokenSum(Aggregation):
    """Mean over sequences of each sequence's token sum: ``(1/N) sum_i sum_t l_i,t``.

    verl ``seq-mean-token-sum``.
    """

    def __call__(self, loss_mat: Tensor, mask: Tensor, totals: StepTotals | None = None) -> Tensor:
        totals = _resolve(mask, totals)
        total = (loss_mat * mask).sum()  # []
        return total * totals.world_size / max(totals.num_sequences, 1)


class SeqMeanTokenMean(Aggregation):
    """GRPO's aggregation (Shao et al. 2024): ``(1/N) sum_i (1/|y_i|) sum_t l_i,t``.

    verl ``seq-mean-token-mean``; an empty row contributes 0.
    """

    def __call__(self, loss_mat: Tensor, mask: Tensor, totals: StepTotals | None = None) -> Tensor:
        totals = _resolve(mask, totals)
        lengths = mask.sum(dim=-1).clamp(min=1)  # [n]
        row_means = (loss_mat * mask).sum(dim=-1) / lengths  # [n]
        return row_means.sum() * totals.world_size / max(totals.num_sequences, 1)


class SeqMeanTokenSumNorm(Aggregation):
    """Dr.GRPO's aggregation (Liu et al. 2025): ``(1/N) sum_i sum_t l_i,t / L`` with a constant ``L``.

    ``L`` is ``totals.max_length``, or by default the padded length ``T`` of ``loss_mat`` (verl's
    ``seq-mean-token-sum-norm`` with its default ``loss_scale_factor``). Set ``max_length`` when
    micro-batches are padded to different lengths, otherwise they would use different ``L``. The update
    loop sets it to ``Rollout.max_new_tokens``: the completion limit of a turn, or of a multi-turn episode its
    whole response budget (``Environment.response_budget``).
    """

    def __call__(self, loss_mat: Tensor, mask: Tensor, totals: StepTotals | None = None) -> Tensor:
        totals = _resolve(mask, totals)
        length = loss_mat.shape[-1] if totals.max_length is None else totals.max_length
        total = (loss_mat * mask).sum()  # []
        return total * totals.world_size / (max(totals.num_sequences, 1) * length)
