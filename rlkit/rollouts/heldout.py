"""HeldOutSet: held-out prompts in batches, each rank its share, scored with greedy completions."""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlkit.data.prompts import Prompt, PromptSource, PromptSubset
from rlkit.data.splits import split_indices
from rlkit.errors import ConfigError
from rlkit.rollouts.producer import GroupProducer
from rlkit.rollouts.source import HeldOutBatch


def choose_held_out(
    prompts: PromptSource, val_prompts: PromptSource | None, val_fraction: float | None
) -> tuple[PromptSource, PromptSource | None, str | None]:
    """``(training prompts, held-out prompts or None, a line to say or None)`` of a data module.

    No run validates on a task it does not train on without saying so: the embedded demo's held-out set
    (a ``builtin`` source, inherited from ``configs/tasks/embedded.yaml``) beside training prompts of
    another source is dropped, with one line naming ``data.val_fraction``. With ``val_fraction`` the
    training prompts are split by a fixed hash of each prompt's text (as the embedded task splits its
    questions, :func:`rlkit.data.splits.in_test_split`): the held-out share never trains, whatever the seed.
    """
    inherited = val_prompts is not None and val_prompts.builtin and not prompts.builtin
    if val_fraction is None:
        if inherited:
            return (
                prompts,
                None,
                (
                    f"no held-out set: data.val_prompts is the embedded demo's {type(val_prompts).__name__}, which "
                    f"does not measure data.prompts ({type(prompts).__name__}), so validation is off; set "
                    "--data.val_fraction=0.1 to hold out a share of your prompts, or --data.val_prompts to your own"
                ),
            )
        if val_prompts is None:
            return prompts, None, "no held-out set (data.val_prompts is null; --data.val_fraction=0.1 holds one out)"
        return prompts, val_prompts, None
    if not 0.0 < val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction must lie in (0, 1), got {val_fraction} (e.g. 0.1, or null for none)")
    if val_prompts is not None and not inherited:
        raise ConfigError(
            f"data.val_fraction={val_fraction} and data.val_prompts ({type(val_prompts).__name__}) both name a "
            "held-out set: set --data.val_prompts=null to hold out a share of data.prompts, or drop data.val_fraction"
        )
    train, test = split_indices(prompts, val_fraction)
    if not test or not train:
        side = "none of them" if not test else "all of them"
        raise ConfigError(
            f"data.val_fraction={val_fraction} of data.prompts' {len(prompts)} prompts holds out {side}: "
            f"{'raise' if not test else 'lower'} data.val_fraction, or give data.val_prompts"
        )
    note = (
        f"held-out set: {len(test)} of data.prompts' {len(prompts)} prompts (data.val_fraction={val_fraction}, "
        "by a fixed hash of each prompt's text); training uses the other "
        f"{len(train)}"
    )
    return PromptSubset(prompts, train), PromptSubset(prompts, test), note


class HeldOutSet:
    """The held-out prompts, validated greedily (temperature 0, one completion each).

    With a multi-turn environment each prompt plays one greedy episode in the training environment (every
    model turn greedy), scored as training scores an episode: ``data.rewards`` on the last model turn plus
    the environment's per-turn rewards; ``val/episode/turns``, ``tool_calls``, ``tool_errors`` and
    ``reward_by_turns/<n>`` (the mean reward of the episodes that took ``n`` model turns) are logged, and each
    reward function's own score (``val/<name>``, the outcome without the per-turn rewards), even with one function.

    Args:
        prompts: the held-out prompts.
        batch_size: prompts per validation batch.
    """

    def __init__(self, prompts: PromptSource, batch_size: int) -> None:
        self.prompts = prompts
        self.batch_size = batch_size

    def batches(self, rank: int, world_size: int) -> list[list[int]]:
        """Each batch's prompt indices of this rank: every rank gets as many batches (the metrics'
        reduction is collective), each its share of every batch."""
        size, total = self.batch_size, len(self.prompts)
        return [list(range(i, min(i + size, total)))[rank::world_size] for i in range(0, total, size)]

    def evaluate(
        self, indices: list[int], producer: GroupProducer, encode: Callable[[Prompt], list[int]]
    ) -> HeldOutBatch:
        """Greedy completions of the prompts at ``indices``, scored by the producer's reward functions."""
        prompts = [self.prompts[i] for i in indices]
        if not prompts:
            return HeldOutBatch(scores=torch.zeros(0))
        ids = [encode(p) for p in prompts]
        generations = producer.sample(prompts, ids, 1, seed=0, greedy=True)
        episode = {}
        if producer.episodes is not None:
            episode = {
                name: torch.tensor([float(getattr(row[0], name)) for row in generations])
                for name in ("turns", "tool_calls", "tool_errors")
            }
        scored = producer.score(prompts, generations)
        if episode:  # the reward of the episodes that took n turns (NaN elsewhere: left out of that mean)
            for n in sorted(set(episode["turns"].long().tolist())):
                taken = episode["turns"] == n  # [M]
                episode[f"reward_by_turns/{n}"] = torch.where(taken, torch.tensor(scored.scores), torch.nan)
        terms = {}
        if len(scored.terms) > 1 or episode:  # one function, single turn: its value is the score
            terms = {name: torch.tensor(v, dtype=torch.float32) for name, v in scored.terms.items()}
        return HeldOutBatch(
            scores=torch.tensor(scored.scores, dtype=torch.float32),
            terms=terms,
            lengths=torch.tensor([float(len(g[0].token_ids)) for g in generations]),
            texts=scored.texts,
            prompts=producer.tokenizer.batch_decode(ids, skip_special_tokens=True),
            episode=episode,
        )
