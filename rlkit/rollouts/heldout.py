"""HeldOutSet: held-out prompts in batches, each rank its share, scored with greedy completions."""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlkit.data.prompts import Prompt, PromptSource
from rlkit.rollouts.producer import GroupProducer
from rlkit.rollouts.source import HeldOutBatch


class HeldOutSet:
    """The held-out prompts, validated greedily (temperature 0, one completion each).

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
        generations = producer.engine.generate(ids, n=1, seed=0, greedy=True)
        scored = producer.score(prompts, generations)
        terms = {}
        if len(scored.terms) > 1:  # with one reward function its value is the score
            terms = {name: torch.tensor(v, dtype=torch.float32) for name, v in scored.terms.items()}
        return HeldOutBatch(
            scores=torch.tensor(scored.scores, dtype=torch.float32),
            terms=terms,
            lengths=torch.tensor([float(len(g[0].token_ids)) for g in generations]),
            texts=scored.texts,
            prompts=producer.tokenizer.batch_decode(ids, skip_special_tokens=True),
        )
