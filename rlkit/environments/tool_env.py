"""ToolEnvironment: the model calls tools and reads their results until it answers without a call."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlkit.data.prompts import Prompt
from rlkit.environments.base import Environment, Observation, check_limits
from rlkit.environments.tools import Tool, parse_tool_calls, run_tool_call
from rlkit.errors import ConfigError


class ToolEnvironment(Environment):
    """Tool use in the Hermes / Qwen format (verl's ``ToolAgentLoop``, TRL's tool calling).

    The tools' schemas go to the chat template (``tools=``), which lists them in the system turn. After each
    model turn every ``<tool_call>`` block it wrote is run, in order, and each result (or error text, see
    :mod:`rlkit.environments.tools`) comes back as one ``tool`` role message; the template renders them
    (Qwen: one user turn of ``<tool_response>`` blocks) followed by the assistant's generation prompt. The
    episode ends when a turn makes no tool call (that turn is the answer ``data.rewards`` score), or after
    ``max_turns`` model turns. No per-turn reward: the episode's reward is the answer's.

    Args:
        tools: the functions offered (import paths in YAML, e.g. ``my_tools.add``); each needs type hints
            and a Google ``Args:`` docstring (see :meth:`Tool.from_function`).
        max_turns: the most model turns of an episode (each tool round trip is one).
        max_episode_tokens: the most completion tokens of an episode, model and tool results together
            (None: only ``max_turns`` bounds it).
        tool_timeout_s: the longest one tool call may run; then its result is an error text and the call is
            abandoned (Python cannot stop a thread; run untrusted code in a sandboxed tool).
    """

    def __init__(
        self,
        tools: list[Callable],
        max_turns: int = 4,
        max_episode_tokens: int | None = None,
        tool_timeout_s: float = 5.0,
    ) -> None:
        check_limits(max_turns, max_episode_tokens, "ToolEnvironment")
        if not tools:
            raise ConfigError("data.environment (ToolEnvironment): tools is empty; name at least one function")
        if not tool_timeout_s > 0:
            raise ConfigError(f"data.environment (ToolEnvironment): tool_timeout_s must be > 0, got {tool_timeout_s}")
        self.tools = {}
        for function in tools:
            tool = function if isinstance(function, Tool) else Tool.from_function(function)
            if tool.name in self.tools:
                raise ConfigError(f"data.environment (ToolEnvironment): two tools are called {tool.name!r}; rename one")
            self.tools[tool.name] = tool
            own_limit = getattr(tool.function, "timeout_s", None)  # a sandboxed tool's own time limit
            if own_limit is not None and own_limit >= tool_timeout_s:
                raise ConfigError(
                    f"data.environment (ToolEnvironment): tool {tool.name!r} runs up to its timeout_s={own_limit:g} s, "
                    f"not less than tool_timeout_s={tool_timeout_s:g}: raise tool_timeout_s above it"
                )
        self.max_turns = max_turns
        self.max_episode_tokens = max_episode_tokens
        self.tool_timeout_s = tool_timeout_s

    def tool_schemas(self) -> list[dict[str, Any]]:
        return [tool.schema for tool in self.tools.values()]

    def reset(self, prompt: Prompt) -> None:
        return None

    def step(self, state: None, text: str) -> Observation:
        calls = parse_tool_calls(text)
        if not calls:
            return Observation(done=True)
        messages, errors = [], 0
        for call in calls:
            content, failed = run_tool_call(self.tools, call, self.tool_timeout_s)
            errors += failed
            messages.append({"role": "tool", "name": call.name or "invalid", "content": content})
        return Observation(messages=messages, tool_calls=len(calls), tool_errors=errors)
