"""The environment contract: what a multi-turn episode's non-model side says after each model turn.

An episode alternates model turns and environment turns: ``state = env.reset(prompt)``, then after each
model turn ``obs = env.step(state, text)`` until ``obs.done``, ``max_turns`` model turns or
``max_episode_tokens`` completion tokens. The shape follows Gymnasium's ``reset``/``step`` and verifiers'
``MultiTurnEnv`` (``env_response(messages, state) -> (messages, state)``, ``is_completed``), with the
episode's mutable state passed in rather than held: one environment object serves every episode of a step.

Bring your own: subclass :class:`Environment`, implement ``reset`` and ``step``, and name it in
``data.environment`` (``class_path`` / ``init_args``); the constructor's signature is its config schema.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from rlkit.data.prompts import Prompt
from rlkit.errors import ConfigError


@dataclass
class Observation:
    """What the environment answers to one model turn.

    Attributes:
        messages: chat messages appended to the conversation (``[{"role": "tool" | "user", "content": ...}]``),
            rendered by the tokenizer's chat template; or None.
        text: plain text appended as is (for tokenizers without a chat template); or None. Give one of
            ``messages`` and ``text`` unless the episode is done.
        reward: this turn's reward (None: none; the episode's reward comes from ``data.rewards``).
        done: the episode ends here (nothing more is appended).
        tool_calls: tool calls the turn made (counted in ``episode/tool_calls``).
        tool_errors: of those, calls answered by an error (``episode/tool_errors``).
    """

    messages: list[dict[str, Any]] | None = None
    text: str | None = None
    reward: float | None = None
    done: bool = False
    tool_calls: int = 0
    tool_errors: int = 0


class Environment(ABC):
    """Starts an episode from a data row and answers each model turn (see the module docstring).

    Attributes:
        max_turns: the most model turns of one episode.
        max_episode_tokens: the most completion tokens (model and environment) of one episode; a model turn
            is cut at the budget (the episode then counts as truncated), an observation that does not fit
            ends the episode unappended (counted in ``episode/budget_stops``). None: no budget.
        single_turn: every episode is one model turn and nothing else, so the producer samples a
            prompt's ``G`` completions in one engine call exactly as before (only :class:`SingleTurn`).
    """

    max_turns: int = 1
    max_episode_tokens: int | None = None
    single_turn: bool = False

    def response_budget(self, max_new_tokens: int) -> int:
        """The constant length ``L`` of ``SeqMeanTokenSumNorm`` (Dr.GRPO) for this environment's rows.

        One turn: ``max_new_tokens``, the completion limit (verl's ``response_length``). An episode's row holds
        up to ``max_turns`` model turns of ``max_new_tokens`` and the environment's turns between them, so the
        per-turn limit would be exceeded by a row's own model tokens. With a token budget it is
        ``max_episode_tokens`` (model and environment tokens together: verl's multi-turn ``response_length``,
        the padded response its agent loop fills with both); without one, ``max_turns * max_new_tokens``, the
        most model tokens an episode can hold (environment turns have no a-priori length). Either is a constant
        of the run, which is what Dr.GRPO asks of ``L`` (Liu et al. 2025).
        """
        if self.single_turn:
            return max_new_tokens
        if self.max_episode_tokens is not None:
            return self.max_episode_tokens
        return self.max_turns * max_new_tokens

    def score_group(self, states: list[Any]) -> list[float | None] | None:
        """Rewards that need a prompt's episodes together, called once all of them have ended (the states
        ``reset`` returned, in sample order); each is added to its episode's last turn reward, None leaves an
        episode as it is. The default: None (no group reward). verifiers' group rubrics (``Rubric.score_group``)
        are the case in point: ``VerifiersEnvironment`` overrides it."""
        return None

    def tool_schemas(self) -> list[dict[str, Any]] | None:
        """JSON schemas of the tools offered to the model through the chat template (``tools=``); None: none."""
        return None

    @abstractmethod
    def reset(self, prompt: Prompt) -> Any:
        """A new episode's state for ``prompt`` (any object; ``step`` receives it back)."""

    @abstractmethod
    def step(self, state: Any, text: str) -> Observation:
        """The environment's answer to the model turn ``text`` (decoded, special tokens dropped)."""


def check_limits(max_turns: int, max_episode_tokens: int | None, name: str) -> None:
    """The limits every environment shares, validated where they are set."""
    if max_turns < 1:
        raise ConfigError(f"data.environment ({name}): max_turns must be >= 1, got {max_turns}")
    if max_episode_tokens is not None and max_episode_tokens < 1:
        raise ConfigError(
            f"data.environment ({name}): max_episode_tokens must be >= 1 or null (no budget), got {max_episode_tokens}"
        )


class SingleTurn(Environment):
    """One model turn, then done: today's single-turn task, the default ``data.environment``.

    The producer recognises it (``single_turn``) and samples as it always has, so every preset's rollouts are
    bitwise what they were before environments existed.
    """

    single_turn = True

    def reset(self, prompt: Prompt) -> None:
        return None

    def step(self, state: None, text: str) -> Observation:
        return Observation(done=True)
