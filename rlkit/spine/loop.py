"""The update loop every family shares: epochs x mini-batches x micro-batches of one rollout.

One rollout gives ``ppo_epochs x minibatches`` optimizer steps. Each mini-batch is accumulated over
micro-batches that change memory only, never the maths: the family's loss is aggregated with the
totals of the whole optimizer step (:class:`~rlkit.components.aggregation.StepTotals`, summed over
micro-batches and data-parallel ranks), so the micro-batch losses sum to the mini-batch loss.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import torch
import torch.distributed as dist
from torch import Tensor

from rlkit.components.aggregation import StepTotals
from rlkit.data.batch import Rollout, trim_rollout
from rlkit.data.packing import packed_micro_batches, split_to_count, token_budget_micro_batches, unit_micro_batches
from rlkit.errors import ConfigError, NonFiniteError
from rlkit.seeding import run_seed
from rlkit.spine.metrics import StepMetrics
from rlkit.spine.settings import LoopSettings


@dataclass
class LossInputs:
    """Per-token inputs a family's loss reads besides the rollout, each ``[N, T]`` or None.

    Computed once per rollout, before its updates; the loop hands each micro-batch its rows.

    Attributes:
        old_logprobs: the trainer's log-probs of the sampled tokens before the updates (the ratio's
            denominator), at the sampling temperature.
        advantages: per-token advantages.
        ref_logprobs: a frozen reference policy's log-probs (KL term).
        teacher_logprobs: a frozen teacher's log-probs of the sampled tokens (distillation).
        teacher_top_logprobs: ``[N, T, k]`` the teacher's k most likely tokens' log-probs (distillation).
        teacher_top_ids: ``[N, T, k]`` their ids.
        returns: value targets (actor-critic).
        old_values: the critic's values before the updates (value clipping).
        is_weights: rollout-correction weights multiplying each token's policy loss.
        selected: tokens a step-level rule picked for the current optimizer step (``SelectingClip``),
            filled by the loop's ``prepare_step`` for the mini-batch's rows.
    """

    old_logprobs: Tensor | None = None
    advantages: Tensor | None = None
    ref_logprobs: Tensor | None = None
    teacher_logprobs: Tensor | None = None
    teacher_top_logprobs: Tensor | None = None
    teacher_top_ids: Tensor | None = None
    returns: Tensor | None = None
    old_values: Tensor | None = None
    is_weights: Tensor | None = None
    selected: Tensor | None = None

    def select(self, rows: Tensor, width: int | None = None) -> LossInputs:
        """These inputs restricted to ``rows`` (an index tensor) and to the first ``width`` completion
        columns (None: all), as :func:`~rlkit.data.batch.trim_rollout` cuts a micro-batch."""
        columns = slice(None, width)
        return LossInputs(
            **{f.name: None if (v := getattr(self, f.name)) is None else v[rows, columns] for f in fields(self)}
        )


#: ``micro_step(micro, inputs, totals) -> (loss, terms)``: the micro-batch's share of the optimizer step's
#: loss (a scalar to backpropagate) and named scalar terms to log (each the micro-batch's share too).
MicroStep = Callable[[Rollout, LossInputs, StepTotals], tuple[Tensor, dict[str, Tensor]]]

#: ``prepare_step(rows, inputs, step) -> inputs``: called before each optimizer step with its rows (and the
#: step's index within the rollout), for inputs that depend on the whole step (a covariance selection).
PrepareStep = Callable[[Tensor, LossInputs, int], LossInputs]


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def step_totals(mask: Tensor, max_length: int | None, world_size: int = 1) -> StepTotals:
    """The sequences (with at least one valid token) and tokens of ``mask [n, T]``, summed over ranks."""
    counts = torch.stack([(mask.sum(-1) > 0).sum(), mask.sum()]).to(torch.float64)  # [2]
    if world_size > 1 and _distributed():
        dist.all_reduce(counts)
    return StepTotals(int(counts[0].item()), int(counts[1].item()), world_size, max_length)


def finite_everywhere(loss: Tensor) -> bool:
    """Whether ``loss`` is finite on every rank (one flag all-reduced: all ranks stop together)."""
    bad = (~torch.isfinite(loss.detach())).to(torch.float32).reshape(1)  # [1]
    if _distributed():
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return bad.item() == 0


@dataclass(frozen=True)
class MicroBatch:
    """One forward/backward's rows of a mini-batch; ``in_loss=False``: a padding pass (no token counts)."""

    rows: Tensor
    in_loss: bool = True

    def __len__(self) -> int:
        return len(self.rows)


class UpdateLoop:
    """``ppo_epochs`` passes over a rollout, each in ``minibatches`` optimizer steps of micro-batches.

    Every micro-batch is cut to its own longest prompt and completion before its forward. With
    ``micro_batch_tokens`` the mini-batch's rows are sorted by length and each micro-batch holds as many as
    fit ``rows x its longest row <= micro_batch_tokens`` (padding included; with ``pack_sequences`` real
    tokens only; a longer row goes alone), so rows of similar length share a micro-batch; with both limits a
    micro-batch keeps both. With ``keep_groups`` the unit of shuffling, splitting and planning is a group
    (the rows of one ``group_id``), never cut. Under data parallelism every rank runs as many micro-batches
    as the rank that needs most (a rank that cannot split further runs a copy of one micro-batch with no
    token in the loss: the collectives stay in step, the maths does not change).

    Args:
        settings: the loop's settings (:class:`~rlkit.spine.settings.LoopSettings`).
    """

    def __init__(self, settings: LoopSettings | None = None) -> None:
        settings = settings or LoopSettings()
        self.settings = settings
        self.ppo_epochs = settings.ppo_epochs
        self.minibatches = settings.minibatches
        self.micro_batch_size = settings.micro_batch_size
        self.micro_batch_tokens = settings.micro_batch_tokens
        self.pack_sequences = settings.pack_sequences
        self.keep_groups = settings.keep_groups
        self.seed = run_seed(settings.seed)

    @property
    def on_policy(self) -> bool:
        """One optimizer step per rollout: the policy being trained is the one that scored it."""
        return self.ppo_epochs == 1 and self.minibatches == 1

    def check_rows(self, rows_per_rank: int, groups_per_rank: int) -> None:
        """Every rank must hold at least one row (one group with ``keep_groups``) per mini-batch: an empty
        mini-batch would desynchronise the ranks."""
        held, what = (groups_per_rank, "groups") if self.keep_groups else (rows_per_rank, "completions")
        if held < self.minibatches:
            raise ConfigError(
                f"each rank holds {held} {what} per rollout, fewer than model.loop.minibatches="
                f"{self.minibatches}: lower model.loop.minibatches or raise data.prompts_per_step"
                + ("" if self.keep_groups else " / data.samples_per_prompt")
            )

    def _units(self, rows: Tensor, rollout: Rollout) -> list[list[int]]:
        """Positions (into ``rows``) of each unit: one row, or with ``keep_groups`` each group's rows."""
        if not self.keep_groups:
            return [[i] for i in range(len(rows))]
        units: dict[int, list[int]] = {}
        for position, group in enumerate(rollout.group_ids[rows].tolist()):
            units.setdefault(group, []).append(position)
        return list(units.values())

    def minibatch_rows(self, rollout: Rollout, epoch: int) -> list[Tensor]:
        """The rows of each of the epoch's mini-batches: a shuffle drawn from ``(seed, rollout, epoch)``
        (exact on resume), split into ``minibatches`` parts (of whole groups with ``keep_groups``)."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + rollout.iteration * 101 + epoch)
        device = rollout.completion_mask.device
        if not self.keep_groups:
            order = torch.randperm(len(rollout), generator=generator).to(device)  # [N]
            return list(order.tensor_split(self.minibatches))
        units = self._units(torch.arange(len(rollout)), rollout)
        shuffled = [units[k] for k in torch.randperm(len(units), generator=generator).tolist()]
        return [
            torch.tensor([row for unit in part for row in unit], dtype=torch.long, device=device)
            for part in _split_evenly(shuffled, self.minibatches)
        ]

    def micro_batches(self, rows: Tensor, rollout: Rollout) -> list[MicroBatch]:
        """Split one mini-batch's row indices (of ``rollout``) into micro-batches."""
        units = self._units(rows, rollout)
        lengths = rollout.attention_mask[rows].sum(-1)  # [n] prompt + completion tokens of each row
        if self.micro_batch_tokens is None:
            plan = [[row for unit in units for row in unit]]
        elif self.keep_groups:
            plan = unit_micro_batches(units, lengths, self.micro_batch_tokens, packed=self.pack_sequences)
        else:
            plan_by = packed_micro_batches if self.pack_sequences else token_budget_micro_batches
            plan = plan_by(lengths, self.micro_batch_tokens)
        if self.micro_batch_size is not None:  # the row limit too
            plan = [part for batch in plan for part in self._cut(batch, units, self.micro_batch_size)]
        padding = 0
        if _distributed():  # every rank must run as many backward passes (and collectives) as the others
            count = torch.tensor([len(plan)], device=rows.device)
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
            wanted = int(count.item())
            if self.keep_groups:
                plan = _split_units_to_count(plan, units, wanted)
            else:
                plan = split_to_count(plan, min(wanted, len(rows)))
            padding = wanted - len(plan)
        batches = [MicroBatch(rows[torch.tensor(batch, dtype=torch.long, device=rows.device)]) for batch in plan]
        return batches + [MicroBatch(batches[-1].rows, in_loss=False)] * padding

    def _cut(self, batch: list[int], units: list[list[int]], size: int) -> list[list[int]]:
        """``batch`` in parts of at most ``size`` rows (of whole units with ``keep_groups``; a larger unit alone)."""
        if not self.keep_groups:
            return [batch[i : i + size] for i in range(0, len(batch), size)]
        unit_of = {row: k for k, unit in enumerate(units) for row in unit}
        parts: list[list[int]] = []
        for k in dict.fromkeys(unit_of[row] for row in batch):
            if parts and len(parts[-1]) + len(units[k]) <= size:
                parts[-1].extend(units[k])
            else:
                parts.append(list(units[k]))
        return parts

    def micro_rollouts(self, rollout: Rollout, rows: Tensor):
        """Yield ``(micro_rows, micro)``: each micro-batch's row indices and its rows of ``rollout``,
        cut to their own longest prompt and completion (``micro.completion_mask.shape[1]`` columns)."""
        for batch in self.micro_batches(rows, rollout):
            micro = trim_rollout(rollout.select(batch.rows))
            if not batch.in_loss:  # a rank's padding micro-batch: the same passes, no token in the loss
                micro = replace(micro, completion_mask=torch.zeros_like(micro.completion_mask))
            yield batch.rows, micro

    def run(
        self,
        module,
        rollout: Rollout,
        inputs: LossInputs,
        micro_step: MicroStep,
        optimizer_step: Callable[[], None],
        metrics: StepMetrics,
        world_size: int = 1,
        prepare_step: PrepareStep | None = None,
    ) -> None:
        """Run every optimizer step of ``rollout``.

        ``prepare_step`` (optional) completes the inputs once per optimizer step, from all its rows;
        ``micro_step`` returns the micro-batch's loss share; the loop checks it is finite on every rank,
        backpropagates it with ``module.manual_backward`` (so precision plugins and strategies apply),
        logs its terms weighted by the micro-batch's share of the step, and calls ``optimizer_step``
        after each mini-batch.
        """
        mask = rollout.completion_mask  # [N, T]
        step = 0
        for epoch in range(self.ppo_epochs):
            for rows in self.minibatch_rows(rollout, epoch):
                totals = step_totals(mask[rows], rollout.max_new_tokens, world_size)
                step_inputs = inputs if prepare_step is None else prepare_step(rows, inputs, step)
                step += 1
                for micro_rows, micro in self.micro_rollouts(rollout, rows):
                    if self.pack_sequences:  # the forward computes real tokens only
                        metrics.update("perf/padding_fraction", torch.zeros(()), micro.attention_mask.sum())
                    else:
                        positions = micro.attention_mask.numel()
                        padding = 1.0 - micro.attention_mask.sum() / positions
                        metrics.update("perf/padding_fraction", padding, positions)  # of what the forward computes
                    micro_inputs = step_inputs.select(micro_rows, micro.completion_mask.shape[1])
                    loss, terms = micro_step(micro, micro_inputs, totals)
                    if not finite_everywhere(loss):
                        bad = [name for name, value in terms.items() if not torch.isfinite(value).all()]
                        raise NonFiniteError(
                            f"the loss of rollout {rollout.iteration} is {loss.item()} (non-finite: "
                            f"{', '.join(bad) or 'loss'}). Lower the learning rate, check the rewards for NaN/inf, "
                            "keep model.optim.max_grad_norm set, or use fp32/bf16 rather than fp16; resume from the "
                            "last checkpoint with --ckpt_path=last."
                        )
                    module.manual_backward(loss)
                    # this micro-batch's share of the step: with W ranks each holds ~1/W of the rows and its
                    # aggregated values carry the factor W, so the shares sum to ~W and the weighted mean is exact
                    counted = int((micro.completion_mask.sum(-1) > 0).sum())
                    share = counted * totals.world_size / max(totals.num_sequences, 1)
                    for name, value in terms.items():
                        if share:
                            metrics.update(name, value.detach() / share, share)
                optimizer_step()


def _split_evenly(units: list, parts: int) -> list[list]:
    """``units`` in ``parts`` consecutive slices whose sizes differ by at most one (as ``tensor_split``)."""
    size, extra = divmod(len(units), parts)
    out, start = [], 0
    for k in range(parts):
        stop = start + size + (1 if k < extra else 0)
        out.append(units[start:stop])
        start = stop
    return out


def _split_units_to_count(plan: list[list[int]], units: list[list[int]], count: int) -> list[list[int]]:
    """Split micro-batches at unit boundaries (the one of most units first) until there are ``count`` or
    every micro-batch holds one unit."""
    unit_of = {row: k for k, unit in enumerate(units) for row in unit}
    plan = [list(batch) for batch in plan]
    while len(plan) < count:
        held = [list(dict.fromkeys(unit_of[row] for row in batch)) for batch in plan]
        k = max(range(len(plan)), key=lambda i: (len(held[i]), -i))
        if len(held[k]) < 2:
            break
        half = held[k][: (len(held[k]) + 1) // 2]
        first = [row for row in plan[k] if unit_of[row] in half]
        plan[k : k + 1] = [first, [row for row in plan[k] if unit_of[row] not in half]]
    return plan
