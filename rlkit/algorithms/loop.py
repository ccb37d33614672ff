"""The update loop every family shares: epochs x mini-batches x micro-batches of one rollout.

One rollout gives ``ppo_epochs x minibatches`` optimizer steps. Each mini-batch is accumulated over
micro-batches that change memory only, never the maths: the family's loss is aggregated with the
totals of the whole optimizer step (:class:`~rlkit.components.aggregation.StepTotals`, summed over
micro-batches and data-parallel ranks), so the micro-batch losses sum to the mini-batch loss.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist
from torch import Tensor

from rlkit.algorithms.metrics import StepMetrics
from rlkit.components.aggregation import StepTotals
from rlkit.data.batch import Rollout, trim_rollout
from rlkit.data.packing import packed_micro_batches, split_to_count, token_budget_micro_batches
from rlkit.errors import ConfigError, NonFiniteError


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


class UpdateLoop:
    """``ppo_epochs`` passes over a rollout, each in ``minibatches`` optimizer steps of micro-batches.

    Every micro-batch is cut to its own longest prompt and completion before its forward.

    Args:
        ppo_epochs: passes over each rollout.
        minibatches: optimizer steps per pass (the rows shuffled, then split into this many).
        micro_batch_size: at most this many rows per forward/backward (None: no row limit).
        micro_batch_tokens: at most this many tokens per forward/backward (verl's ``use_dynamic_bsz`` /
            ``ppo_max_token_len_per_gpu``): the mini-batch's rows sorted by length, each micro-batch as many
            as fit ``rows x its longest row <= micro_batch_tokens`` (padding included; with
            ``pack_sequences`` real tokens only; a longer row goes alone). Rows of similar length share a
            micro-batch, so little is spent on padding. With both limits a micro-batch keeps both. Under
            data parallelism every rank runs as many micro-batches as the rank that needs most.
        seed: seed of the mini-batch shuffles (drawn from ``(seed, rollout, epoch)``: exact on resume).
        pack_sequences: the policy's forwards run on each micro-batch's real tokens packed into one row
            (verl's ``use_remove_padding``); ``micro_batch_tokens`` then counts real tokens only.
    """

    def __init__(
        self,
        ppo_epochs: int = 1,
        minibatches: int = 1,
        micro_batch_size: int | None = None,
        seed: int = 0,
        micro_batch_tokens: int | None = None,
        pack_sequences: bool = False,
    ):
        if ppo_epochs < 1:
            raise ConfigError(f"model.ppo_epochs must be >= 1, got {ppo_epochs}")
        if minibatches < 1:
            raise ConfigError(f"model.minibatches must be >= 1, got {minibatches}")
        if micro_batch_size is not None and micro_batch_size < 1:
            raise ConfigError(f"model.micro_batch_size must be >= 1 or null, got {micro_batch_size}")
        if micro_batch_tokens is not None and micro_batch_tokens < 1:
            raise ConfigError(f"model.micro_batch_tokens must be >= 1 or null, got {micro_batch_tokens}")
        self.ppo_epochs = ppo_epochs
        self.minibatches = minibatches
        self.micro_batch_size = micro_batch_size
        self.micro_batch_tokens = micro_batch_tokens
        self.seed = seed
        self.pack_sequences = pack_sequences

    @property
    def on_policy(self) -> bool:
        """One optimizer step per rollout: the policy being trained is the one that scored it."""
        return self.ppo_epochs == 1 and self.minibatches == 1

    def check_rows(self, rows_per_rank: int) -> None:
        """Every rank must hold at least one row per mini-batch (an empty one would desynchronise ranks)."""
        if rows_per_rank < self.minibatches:
            raise ConfigError(
                f"each rank holds {rows_per_rank} completions per rollout, fewer than model.minibatches="
                f"{self.minibatches}: lower model.minibatches or raise data.prompts_per_step / data.samples_per_prompt"
            )

    def micro_batches(self, rows: Tensor, rollout: Rollout) -> list[Tensor]:
        """Split one mini-batch's row indices (of ``rollout``) into micro-batches."""
        if self.micro_batch_tokens is None:
            return list(rows.split(self.micro_batch_size or len(rows)))
        lengths = rollout.attention_mask[rows].sum(-1)  # [n] prompt + completion tokens of each row
        plan_by = packed_micro_batches if self.pack_sequences else token_budget_micro_batches
        plan = plan_by(lengths, self.micro_batch_tokens)
        if self.micro_batch_size is not None:  # the row limit too
            size = self.micro_batch_size
            plan = [batch[i : i + size] for batch in plan for i in range(0, len(batch), size)]
        if _distributed():  # every rank must run as many backward passes (and collectives) as the others
            count = torch.tensor([len(plan)], device=rows.device)
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
            plan = split_to_count(plan, int(count.item()))
        return [rows[torch.tensor(batch, device=rows.device)] for batch in plan]

    def micro_rollouts(self, rollout: Rollout, rows: Tensor):
        """Yield ``(micro_rows, micro)``: each micro-batch's row indices and its rows of ``rollout``,
        cut to their own longest prompt and completion (``micro.completion_mask.shape[1]`` columns)."""
        for micro_rows in self.micro_batches(rows, rollout):
            yield micro_rows, trim_rollout(rollout.select(micro_rows))

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
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + rollout.iteration * 101 + epoch)
            order = torch.randperm(len(rollout), generator=generator).to(mask.device)  # [N]
            for rows in order.tensor_split(self.minibatches):
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
                            "keep model.max_grad_norm set, or use fp32/bf16 rather than fp16; resume from the "
                            "last checkpoint with --ckpt_path=last."
                        )
                    module.manual_backward(loss)
                    # this micro-batch's share of the step: with W ranks each holds ~1/W of the rows and its
                    # aggregated values carry the factor W, so the shares sum to ~W and the weighted mean is exact
                    share = len(micro_rows) * totals.world_size / max(totals.num_sequences, 1)
                    for name, value in terms.items():
                        metrics.update(name, value.detach() / share, share)
                optimizer_step()
