"""The rollout engine contract: the only place training and inference meet."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_sampling(max_new_tokens: int, temperature: float, top_p: float, top_k: int, dtype: str) -> None:
    """Validate the sampling settings every engine shares; the messages name the fix."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}; for greedy decoding call generate(greedy=True)")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must lie in (0, 1] (1 switches it off), got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 switches it off), got {top_k}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")


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
    def generate(self, prompts: list[list[int]], n: int, seed: int, greedy: bool = False) -> list[list[Generation]]:
        """Sample ``n`` completions for each tokenised prompt; ``result[i][j]`` answers prompt ``i``.

        ``seed`` makes the call reproducible (same weights, prompts and seed: same tokens).
        ``greedy=True`` decodes greedily (temperature 0) — e.g. ReMax's baseline, evaluation.
        """

    @abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Replace the engine's weights (Hugging Face names) without restarting it."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release processes and memory."""
