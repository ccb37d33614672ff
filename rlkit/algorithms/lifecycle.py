"""What every family does when a fit or a validation starts and before its updates, written once.

A family module provides ``loop`` (:class:`~rlkit.algorithms.loop.UpdateLoop`), ``metrics``
(:class:`~rlkit.algorithms.metrics.StepMetrics`), ``policy``, ``_reference`` (a list holding the frozen
reference policy, or empty) and ``hparams_for_logging()``; its hooks call these functions.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import Tensor

from rlkit.algorithms.evaluation import HeldOutEvaluation
from rlkit.algorithms.policy import TokenScores, score_rollout
from rlkit.algorithms.reporting import write_hparams
from rlkit.algorithms.sync import WeightSync
from rlkit.data.batch import Rollout


def family_callbacks() -> list[pl.Callback]:
    """The engine seam and the held-out evaluation, which no run may go without."""
    return [WeightSync(), HeldOutEvaluation()]


def place_frozen_models(module: pl.LightningModule) -> None:
    """Move the frozen models (kept out of the module's state) to the module's device."""
    for model in module._reference:
        model.to(module.device)


def start_fit(module: pl.LightningModule) -> None:
    """Check that every rank holds a row per mini-batch, move the metric states and frozen models to the
    device, and record the run's settings for TensorBoard's HPARAMS tab."""
    data = module.trainer.datamodule
    module.loop.check_rows(data.prompts_per_step // module.trainer.world_size * data.samples_per_prompt)
    module.metrics.to(module.device)
    place_frozen_models(module)
    write_hparams(module.logger, module.hparams_for_logging())


def score_before_updates(
    module: pl.LightningModule, rollout: Rollout, **options
) -> tuple[TokenScores | None, dict[str, Tensor]]:
    """The policy's no-grad scores of ``rollout`` and, by name, the reference's log-probs
    (``ref_logprobs``), in the update loop's micro-batches; ``options`` go to
    :func:`~rlkit.algorithms.policy.score_rollout` (``own``, ``sum_pi_squared``, ``critic``). No pass at
    all (``None, {}``) when neither the policy nor a reference nor a critic is to score."""
    frozen = {"ref_logprobs": module._reference[0]} if module._reference else {}
    if not (options.get("own", True) or frozen or options.get("critic") is not None):
        return None, {}
    micro_batches = module.loop.micro_rollouts(rollout, torch.arange(len(rollout), device=module.device))
    return score_rollout(module.policy, rollout, micro_batches, frozen, **options)
