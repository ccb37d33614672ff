"""Batch layouts that spend no compute on padding: token-budget micro-batches, trimming, packing.

A rollout is padded to its longest prompt (on the left) and its longest completion (on the right); with
completions of 1 to 32 tokens, most of a ``[N, P + T]`` forward is padding. Three remedies, each exact:

- :func:`token_budget_micro_batches` groups rows of similar length (verl's ``use_dynamic_bsz`` with
  ``ppo_max_token_len_per_gpu``): rows sorted by length, each micro-batch as many rows as fit a token
  budget once it is cut to its own longest row.
- :func:`trim_padding` cuts a micro-batch to its own longest prompt and completion.
- :func:`pack_sequences` lays the real tokens of several rows end to end in one row, position ids
  restarting at 0 for each sequence; :func:`pack_completions` lays a whole micro-batch in one row and says
  which packed positions predict its completion tokens (what the update's forward runs on).
  ``transformers`` (>= 4.56: ``masking_utils.find_packed_sequence_indices``) reads such position ids,
  when no attention mask is passed, as packed sequences and masks attention block-diagonally, with sdpa
  and eager attention on CPU as well as flash attention on GPU: the log-probs equal the padded ones
  (tests/data/test_packing.py, tests/spine/test_packed_policy.py).

The aggregation receives the optimizer step's totals, so none of these changes the loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


def token_budget_micro_batches(lengths: Sequence[int] | Tensor, max_tokens: int) -> list[list[int]]:
    """Split rows into micro-batches whose padded size ``rows x longest row`` stays within ``max_tokens``.

    Rows are taken longest first (ties by index, so the plan is deterministic) and added to the current
    micro-batch while ``(rows + 1) * its first (longest) row's length <= max_tokens``; a row longer than the
    budget on its own gets a micro-batch of its own.

    Args:
        lengths: each row's length in tokens (``[N]``), e.g. ``attention_mask.sum(-1)``.
        max_tokens: the budget of one micro-batch in tokens, padding included.

    Returns:
        Micro-batches of row indices, longest rows first; together they hold every row exactly once.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    lengths = [int(n) for n in (lengths.tolist() if isinstance(lengths, Tensor) else lengths)]
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * max(lengths[batches[-1][0]], 1) <= max_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def packed_micro_batches(lengths: Sequence[int] | Tensor, max_tokens: int) -> list[list[int]]:
    """Split rows into micro-batches of at most ``max_tokens`` real tokens each (packed: no padding).

    Rows are taken longest first (ties by index: deterministic) and added to the current micro-batch while
    its total stays within ``max_tokens`` (next-fit decreasing); a row longer than the budget goes alone.
    This is verl's ``use_dynamic_bsz`` with ``use_remove_padding``: the budget counts real tokens only.

    Args:
        lengths: each row's length in tokens (``[N]``), e.g. ``attention_mask.sum(-1)``.
        max_tokens: the most real tokens of one micro-batch.

    Returns:
        Micro-batches of row indices, longest rows first; together they hold every row exactly once.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    lengths = [int(n) for n in (lengths.tolist() if isinstance(lengths, Tensor) else lengths)]
    batches: list[list[int]] = []
    used = 0
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if batches and used + lengths[i] <= max_tokens:
            batches[-1].append(i)
            used += lengths[i]
        else:
            batches.append([i])
            used = lengths[i]
    return batches


def unit_micro_batches(
    units: Sequence[Sequence[int]], lengths: Sequence[int] | Tensor, max_tokens: int, packed: bool = False
) -> list[list[int]]:
    """Split whole units (groups of rows that must stay together, e.g. a prompt's completions or a pair)
    into micro-batches within ``max_tokens``: :func:`token_budget_micro_batches` (``packed``:
    :func:`packed_micro_batches`) with a unit in place of a row.

    Units are taken by their longest row, longest first (ties by first row: deterministic), and added to the
    current micro-batch while its cost stays within the budget: ``rows x longest row`` padded, real tokens
    packed. A unit over the budget on its own gets a micro-batch of its own.

    Returns:
        Micro-batches of row indices, each the rows of whole units.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    lengths = [int(n) for n in (lengths.tolist() if isinstance(lengths, Tensor) else lengths)]
    units = [list(unit) for unit in units if len(unit)]
    order = sorted(range(len(units)), key=lambda u: (-max(lengths[i] for i in units[u]), units[u][0]))
    batches: list[list[int]] = []
    longest, used = 0, 0
    for u in order:
        rows = units[u]
        if packed:
            cost = used + sum(lengths[i] for i in rows)
        else:
            cost = (len(batches[-1]) + len(rows)) * max(longest, 1) if batches else 0
        if batches and cost <= max_tokens:
            batches[-1].extend(rows)
            used = cost
        else:
            batches.append(list(rows))
            longest = max(lengths[i] for i in rows)
            used = sum(lengths[i] for i in rows)
    return batches


def split_to_count(plan: list[list[int]], count: int) -> list[list[int]]:
    """Split micro-batches (largest first, in halves) until there are ``count`` of them.

    Data-parallel ranks must run the same number of forward/backward passes (each backward and each
    finiteness check is a collective); a rank whose token-budget plan came out shorter splits its own.

    Args:
        plan: micro-batches of row indices, e.g. from :func:`token_budget_micro_batches`.
        count: the number wanted; at most the number of rows.
    """
    rows = sum(len(batch) for batch in plan)
    if not len(plan) <= count <= rows:
        raise ValueError(f"cannot split {len(plan)} micro-batches of {rows} rows into {count}")
    plan = [list(batch) for batch in plan]
    while len(plan) < count:
        k = max(range(len(plan)), key=lambda i: (len(plan[i]), -i))  # the most rows, the first on ties
        half = (len(plan[k]) + 1) // 2
        plan[k : k + 1] = [plan[k][:half], plan[k][half:]]
    return plan


def trim_padding(attention_mask: Tensor, completion_width: int) -> tuple[slice, int]:
    """The columns of a ``[n, P + T]`` prompt-then-completion batch that hold a real token in some row.

    Prompts are left-padded and completions right-padded, so the real tokens of a micro-batch lie in the
    columns ``P - p .. P + t`` where ``p`` is its longest prompt and ``t`` its longest completion.

    Args:
        attention_mask: ``[n, P + T]`` 1 on real tokens.
        completion_width: ``T``, the number of completion columns.

    Returns:
        ``(columns, t)``: the slice of columns to keep and the kept completion width ``t`` (at least 1,
        so a batch of empty completions keeps its shape ``[n, t]``).
    """
    P = attention_mask.shape[1] - completion_width
    real = attention_mask.bool()  # [n, P + T]
    prompt_real = real[:, :P].any(dim=0)  # [P]
    first = int(prompt_real.float().argmax()) if bool(prompt_real.any()) else P
    completion_real = real[:, P:].any(dim=0)  # [T]
    t = int(completion_real.nonzero().max()) + 1 if bool(completion_real.any()) else 1
    return slice(first, P + t), t


@dataclass
class Packing:
    """Sequences laid end to end in ``R`` rows of ``L`` tokens (see :func:`pack_sequences`).

    Attributes:
        input_ids: ``[R, L]`` the real tokens of the packed rows, pad id after the last sequence.
        position_ids: ``[R, L]`` each sequence's positions, from 0; the tail after the last sequence
            counts from 0 too (a sequence of its own, seen by no real token).
        source: ``[M]`` flat index into ``[R, L - 1]`` of the next-token prediction of every real token
            that has a predecessor in its sequence.
        target: ``[M]`` flat index of that token in the padded ``[N, S]`` layout.
        shape: ``(N, S)``, the padded layout's shape.
    """

    input_ids: Tensor
    position_ids: Tensor
    source: Tensor
    target: Tensor
    shape: tuple[int, int]

    def to_padded(self, next_token_values: Tensor) -> Tensor:
        """Scatter per-prediction values back to the padded layout (differentiable).

        Args:
            next_token_values: ``[R, L - 1]`` a value for the prediction of token ``c + 1`` from the
                packed position ``c``, e.g. ``token_log_probs(logits[:, :-1], input_ids[:, 1:])``.

        Returns:
            ``[N, S]`` the value of each real token of the padded layout (0 on padding and on each
            sequence's first token, which nothing predicts).
        """
        N, S = self.shape
        flat = next_token_values.reshape(-1)[self.source]  # [M]
        return flat.new_zeros(N * S).index_copy(0, self.target, flat).reshape(N, S)  # [N, S]


def pack_sequences(input_ids: Tensor, attention_mask: Tensor, row_tokens: int, pad_id: int = 0) -> Packing:
    """Pack the real tokens of each row of a padded batch into as few rows of ``<= row_tokens`` as it takes.

    First-fit decreasing: sequences longest first (ties by index), each into the first packed row with
    room. A sequence longer than ``row_tokens`` widens the rows to its length. Cost: attention is dense
    within a packed row when it is not flash attention, so on CPU keep rows short (a few hundred tokens);
    with flash attention one row per micro-batch is best.

    Args:
        input_ids: ``[N, S]`` token ids, padding anywhere (left, right or both).
        attention_mask: ``[N, S]`` 1 on real tokens; each row's real tokens form one sequence, in order.
        row_tokens: the most tokens of a packed row.
        pad_id: the id written after the last sequence of a row.
    """
    if row_tokens < 1:
        raise ValueError(f"row_tokens must be >= 1, got {row_tokens}")
    N, S = input_ids.shape
    real = attention_mask.bool()  # [N, S]
    lengths = real.sum(-1).tolist()  # [N]
    capacity = max([row_tokens, *lengths])
    rows: list[list[int]] = []  # sequences of each packed row
    fill: list[int] = []
    for i in sorted(range(N), key=lambda i: (-lengths[i], i)):
        slot = next((r for r, used in enumerate(fill) if used + lengths[i] <= capacity), None)
        if slot is None:
            rows.append([])
            fill.append(0)
            slot = len(rows) - 1
        rows[slot].append(i)
        fill[slot] += lengths[i]
    L = max(max(fill, default=1), 2)  # at least 2 columns, so [R, L - 1] predictions exist
    packed_ids = torch.full((len(rows), L), pad_id, dtype=input_ids.dtype)  # [R, L]
    positions = torch.zeros((len(rows), L), dtype=torch.long)  # [R, L]
    source, target = [], []
    for r, sequences in enumerate(rows):
        offset = 0
        for i in sequences:
            columns = real[i].nonzero().squeeze(1).cpu()  # [n_i] the row's real columns, in order
            n = len(columns)
            packed_ids[r, offset : offset + n] = input_ids[i, columns].cpu()
            positions[r, offset : offset + n] = torch.arange(n)
            # token k (k >= 1) of the sequence is predicted from packed column offset + k - 1
            source.append(r * (L - 1) + offset + torch.arange(n - 1))
            target.append(i * S + columns[1:])
            offset += n
        positions[r, offset:] = torch.arange(L - offset)
    device = input_ids.device
    empty = torch.zeros(0, dtype=torch.long)
    return Packing(
        input_ids=packed_ids.to(device),
        position_ids=positions.to(device),
        source=torch.cat(source or [empty]).to(device),
        target=torch.cat(target or [empty]).to(device),
        shape=(N, S),
    )


@dataclass
class PackedRow:
    """A prompt-then-completion micro-batch's real tokens end to end in one row (see :func:`pack_completions`).

    Attributes:
        input_ids: ``[1, L]`` every real token of the micro-batch, row after row.
        position_ids: ``[1, L]`` each sequence's positions, from 0 (what tells attention where one ends).
        predictors: ``[M]`` the packed column whose next-token prediction is each real completion token
            (pass as ``logits_to_keep``: the LM head then runs on these columns only).
        targets: ``[M]`` that completion token's flat index in the ``[n, T]`` completion layout.
        shape: ``(n, T)``, the completion layout's shape.
    """

    input_ids: Tensor
    position_ids: Tensor
    predictors: Tensor
    targets: Tensor
    shape: tuple[int, int]

    def to_completions(self, values: Tensor) -> Tensor:
        """``[M, ...]`` values, one per predicted completion token, placed in the ``[n, T, ...]`` layout
        (zeros on padding); differentiable with respect to ``values``."""
        n, T = self.shape
        out = values.new_zeros((n * T, *values.shape[1:]))  # [n * T, ...]
        return out.index_copy(0, self.targets, values).reshape(n, T, *values.shape[1:])  # [n, T, ...]


def pack_completions(input_ids: Tensor, attention_mask: Tensor, completion_width: int) -> PackedRow:
    """Pack a ``[n, P + T]`` micro-batch (left-padded prompts, right-padded completions) into one row.

    Each row's real tokens keep their order; position ids restart at 0 for each row, which transformers
    (>= 4.56, attention mask None, no KV cache) reads as packed sequences and masks block-diagonally, with
    flash attention on GPU (varlen: no cost across sequences) and sdpa or eager on CPU (a dense
    ``[L, L]`` mask: keep ``L`` to a few thousand tokens). Completion token ``c`` of a row is predicted
    from the packed column just before it; a completion token with nothing before it (no prompt) is left
    out and scores 0.

    Args:
        input_ids: ``[n, P + T]`` token ids.
        attention_mask: ``[n, P + T]`` 1 on real tokens.
        completion_width: ``T``, the number of completion columns at the end.
    """
    n, S = input_ids.shape
    P = S - completion_width
    real = attention_mask.bool()  # [n, S]
    rank = real.long().cumsum(-1) - 1  # [n, S] each real token's position in its own sequence
    lengths = real.sum(-1)  # [n]
    offsets = lengths.cumsum(0) - lengths  # [n] where each row starts in the packed row
    completion = real.clone()
    completion[:, :P] = False
    completion &= rank >= 1  # [n, S] real completion tokens that something predicts
    rows, columns = completion.nonzero(as_tuple=True)  # [M], [M] row-major: ordered as packed
    return PackedRow(
        input_ids=input_ids[real].unsqueeze(0),  # [1, L]
        position_ids=rank[real].unsqueeze(0),  # [1, L]
        predictors=offsets[rows] + rank[rows, columns] - 1,  # [M]
        targets=rows * completion_width + (columns - P),  # [M]
        shape=(n, completion_width),
    )
