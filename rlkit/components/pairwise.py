"""Pairwise preference losses: a chosen and a rejected completion of one prompt, against a frozen reference.

Every loss reads the two sequences' log-ratios to the reference, ``c = log pi(y_w) - log pi_ref(y_w)`` and
``r = log pi(y_l) - log pi_ref(y_l)`` (sums over each completion's tokens), and returns the loss of each
pair from the margin ``h = c - r``. Vocabulary: ``P`` pairs.
"""

from __future__ import annotations

from abc import abstractmethod

import torch
import torch.nn.functional as F
from torch import Tensor

from rlkit.components.base import Component, Need


class PairwiseLoss(Component):
    """Base of pairwise preference losses: ``__call__(chosen, rejected) -> [P]`` from ``[P]`` log-ratios.

    Attributes:
        beta: the scale of the implicit reward ``beta * (log pi - log pi_ref)``.
    """

    needs = frozenset({Need.REFERENCE})
    beta: float

    @abstractmethod
    def __call__(self, chosen: Tensor, rejected: Tensor) -> Tensor: ...


def _check_beta(beta: float, name: str) -> None:
    if not beta > 0:
        raise ValueError(f"{name}: beta must be > 0 (DPO's usual 0.1), got {beta}.")


class SigmoidDPO(PairwiseLoss):
    """DPO's loss (Rafailov et al. 2023, eq. 7): ``-log sigmoid(beta * h)``; with label smoothing ``eps``
    (conservative DPO, Mitchell 2023; TRL's ``label_smoothing``) ``-(1 - eps) log sigmoid(beta h) - eps log
    sigmoid(-beta h)``, for preference labels flipped with probability ``eps``.

    Worked example: ``h = 0`` gives ``log 2 = 0.6931``; ``beta = 0.1, h = 10`` gives ``-log sigmoid(1) = 0.3133``.

    Args:
        beta: the implicit reward's scale.
        label_smoothing: ``eps`` in ``[0, 0.5)``.
    """

    def __init__(self, beta: float = 0.1, label_smoothing: float = 0.0) -> None:
        _check_beta(beta, "SigmoidDPO")
        if not 0.0 <= label_smoothing < 0.5:
            raise ValueError(f"SigmoidDPO: label_smoothing must lie in [0, 0.5), got {label_smoothing}.")
        self.beta = beta
        self.label_smoothing = label_smoothing

    def __call__(self, chosen: Tensor, rejected: Tensor) -> Tensor:
        logits = self.beta * (chosen - rejected)  # [P]
        eps = self.label_smoothing
        return -(1 - eps) * F.logsigmoid(logits) - eps * F.logsigmoid(-logits)  # [P]


class IPO(PairwiseLoss):
    """IPO (Azar et al. 2023, eq. 17): ``(h - 1 / (2 beta))^2``, a margin regressed to a target rather than
    pushed without bound (DPO over-fits deterministic preferences).

    Worked example: ``beta = 0.5, h = 0`` gives ``1``; ``h = 1`` gives ``0``.

    Args:
        beta: the regularisation; the target margin is ``1 / (2 beta)``.
    """

    def __init__(self, beta: float = 0.1) -> None:
        _check_beta(beta, "IPO")
        self.beta = beta

    def __call__(self, chosen: Tensor, rejected: Tensor) -> Tensor:
        return (chosen - rejected - 1.0 / (2.0 * self.beta)).square()  # [P]


def best_and_worst(scores: Tensor, group_ids: Tensor, valid: Tensor) -> Tensor:
    """``[P, 2]`` row indices of each group's highest- and lowest-scoring completion (OAIF's pairs, Guo et al.
    2024), among rows with ``valid`` set; a group whose valid rows all score the same gives no pair. Ties
    go to the first row, so the pairs are deterministic."""
    pairs = []
    for group in torch.unique(group_ids).tolist():
        rows = ((group_ids == group) & valid).nonzero().flatten()  # [g]
        if len(rows) < 2:
            continue
        group_scores = scores[rows]  # [g]
        best, worst = rows[group_scores.argmax()], rows[group_scores.argmin()]
        if group_scores.max() > group_scores.min():
            pairs.append(torch.stack([best, worst]))
    return torch.stack(pairs) if pairs else torch.zeros((0, 2), dtype=torch.long)  # [P, 2]
