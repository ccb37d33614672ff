"""The rollout engine contract: the only place training and inference meet."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass

from torch import Tensor


@dataclass
class Generation:
    """One sampled completion.

    Attributes:
        token_ids: completion tokens (EOS included when the model stopped by itself).
        logprobs: the engine's log-probability of each sampled token under the *untempered*
            policy (same length as ``token_ids``), to measure the train/inference mismatch.
        finished: True when the completion ended with EOS, False when cut at ``max_new_tokens``.
    """

    token_ids: list[int]
    logprobs: list[float]
    finished: bool


class RolloutEngine(ABC):
    """Generates completions with the current policy weights.

    Lifecycle: ``start(checkpoint_dir)`` once; then per rollout ``generate(...)``; after each rollout's
    optimizer updates ``update_weights(named_tensors)`` (Hugging Face parameter names); ``close()``.
    """

    @abstractmethod
    def start(self, checkpoint_dir: str) -> None:
        """Load the model and tokenizer saved (``save_pretrained``) in ``checkpoint_dir``."""

    @abstractmethod
    def generate(
        self, prompts: list[list[int]], n: int, seed: int, greedy: bool = False
    ) -> list[list[Generation]]:
        """Sample ``n`` completions for each tokenised prompt; ``result[i][j]`` answers prompt ``i``.

        ``seed`` makes the call reproducible (same weights, prompts and seed: same tokens).
        ``greedy=True`` decodes greedily (temperature 0) — e.g. ReMax's baseline, evaluation.
        """

    @abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Replace the engine's weights (Hugging Face names) without restarting it."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release processes and memory."""
