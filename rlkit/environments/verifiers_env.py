"""Environments written for the ``verifiers`` package (Prime Intellect), played unchanged inside rlkit's episodes.

A verifiers environment (its classic API, ``vf.MultiTurnEnv`` and everything built on it: ``SingleTurnEnv``,
``ToolEnv``, ``StatefulToolEnv``, the Environments Hub packages) runs its own rollout loop: ``setup_state``,
then for each model turn ``get_prompt_messages`` (which calls ``env_response``), the stop conditions
(``is_completed``: ``max_turns``, ``final_env_response``, its own ``@vf.stop`` methods), and at the end its
rubric. That loop asks a ``vf.Client`` for each model turn. :class:`VerifiersEnvironment` hands it a client whose
answer is the turn rlkit's engine sampled, so verifiers' code runs as written and rlkit keeps what it must own:
the token row (the model's tokens as sampled, the environment's messages rendered by the chat template, no
re-tokenization drift), the loss mask, the sampling log-probs and the KV cache between turns.

Each episode's rollout coroutine runs on one event loop in a daemon thread of this environment; ``step`` hands it
the model's text and waits for its next request (the environment's new messages) or its end (the rubric's
reward, given as the last turn's environment reward). verifiers' newer ``verifiers.v1`` stack (0.4 on) runs each
agent as a separate program talking HTTP to an interception server, so it has no in-process turn to hand over:
the classic API is what this adapter drives (``pip install 'rlkit[verifiers]'`` installs a version that has it).
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import json
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from rlkit.data.prompts import Prompt, PromptSource
from rlkit.environments.base import Environment, Observation, check_limits
from rlkit.environments.tools import parse_tool_calls
from rlkit.errors import ConfigError

_INSTALL = "pip install 'rlkit[verifiers]' (verifiers>=0.3.1,<0.4: its classic vf.MultiTurnEnv API)"


def _verifiers():
    """The ``verifiers`` module with the classic API, or a ConfigError saying how to install it."""
    try:
        import verifiers as vf
    except ImportError as e:
        raise ConfigError(f"data.environment (VerifiersEnvironment) needs the verifiers package: {_INSTALL}") from e
    try:
        vf.MultiTurnEnv  # noqa: B018 - 0.3 resolves the classic surface lazily; 0.4 has none
    except AttributeError as e:
        raise ConfigError(
            f"data.environment (VerifiersEnvironment): verifiers {getattr(vf, '__version__', '?')} has no classic "
            f"vf.MultiTurnEnv (its v1 stack runs agents as separate programs over HTTP): {_INSTALL}"
        ) from e
    return vf


@functools.cache
def _load(env: str, arguments: str) -> Any:
    """The verifiers environment ``env`` built with the JSON ``arguments`` (cached: a prompt source and the
    environment of one run share one object). ``env`` is ``module:attribute`` / ``module.attribute`` (a class
    or factory) or an installed environment's id for ``vf.load_environment``."""
    vf, kwargs = _verifiers(), json.loads(arguments)
    where = f"data.environment (VerifiersEnvironment): env={env!r}"
    if ":" in env or "." in env:
        module, _, name = env.rpartition(":") if ":" in env else env.rpartition(".")
        try:
            factory = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"{where} is not importable ({e}); give module:attribute or an installed id") from e
        built = factory(**kwargs)
    else:
        try:
            built = vf.load_environment(env, **kwargs)
        except (ImportError, ValueError, AttributeError) as e:
            raise ConfigError(
                f"{where} does not load ({e}); install it (`vf-install {env}`) or give module:attr"
            ) from e
    if not isinstance(built, vf.MultiTurnEnv):
        raise ConfigError(f"{where} gave a {type(built).__name__}, not a vf.MultiTurnEnv (or a subclass)")
    return built


def load(env: str, env_args: dict[str, Any] | None = None) -> Any:
    """The verifiers environment of ``env`` and ``env_args`` (one object per distinct pair)."""
    return _load(env, json.dumps(env_args or {}, sort_keys=True))


def _plain(message: Any) -> dict[str, Any]:
    """A verifiers message (a pydantic model or a dict) as the chat dict a tokenizer's template renders."""
    data = message.model_dump(exclude_none=True) if hasattr(message, "model_dump") else dict(message)
    return {k: v for k, v in data.items() if k in ("role", "content", "name", "tool_call_id") and v is not None}


def tool_schema(tool: Any) -> dict[str, Any]:
    """A verifiers tool definition (``vf.Tool``, or its dict form in a row's ``info["tool_defs"]``) as the JSON
    schema chat templates render (``{"type": "function", "function": {name, description, parameters}}``); one
    already in that form is kept."""
    if isinstance(tool, dict) and tool.get("type") == "function" and "function" in tool:
        return tool
    get = tool.get if isinstance(tool, dict) else lambda key, default=None: getattr(tool, key, default)
    if not get("name"):
        raise ConfigError(f"data.prompts (VerifiersPrompts): a tool definition without a name: {tool!r}")
    function = {"name": get("name"), "description": get("description") or "", "parameters": get("parameters") or {}}
    return {"type": "function", "function": function}


class VerifiersPrompts(PromptSource):
    """The rows of a verifiers environment's own dataset as rlkit prompts (``data.prompts``).

    Each row's ``prompt`` (chat messages, the environment's system prompt and few-shot turns already in) is
    the prompt; ``answer`` the ground truth; ``info``, ``task`` and ``example_id`` travel in ``Prompt.meta``
    back to the environment. A row whose ``info["tool_defs"]`` names its own tools (verifiers then offers those
    instead of the environment's) is offered them through the chat template (``Prompt.tools``). Use it with
    ``data.chat_template: true``.

    Args:
        env: as :class:`VerifiersEnvironment`'s (the same ``env``/``env_args`` give the same object).
        env_args: the environment's keyword arguments.
        split: ``train`` (its ``dataset``) or ``eval`` (its ``eval_dataset``).
        limit: only the first ``limit`` rows (None: all).
    """

    def __init__(
        self, env: str, env_args: dict[str, Any] | None = None, split: str = "train", limit: int | None = None
    ) -> None:
        if split not in ("train", "eval"):
            raise ConfigError(f"data.prompts (VerifiersPrompts): split must be 'train' or 'eval', got {split!r}")
        environment = load(env, env_args)
        rows = environment.get_dataset() if split == "train" else environment.get_eval_dataset()
        self.rows = [rows[i] for i in range(len(rows) if limit is None else min(limit, len(rows)))]
        self.name = f"{env} ({split})"
        if not self.rows:
            raise ConfigError(f"data.prompts (VerifiersPrompts): {self.name} has no rows")

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Prompt:
        row = self.rows[index]
        prompt = row["prompt"]
        messages = prompt if isinstance(prompt, str) else [_plain(m) for m in prompt]
        meta = {k: row[k] for k in ("info", "task", "example_id") if row.get(k) is not None}
        info = meta.get("info")
        if isinstance(info, str):  # verifiers stores info as JSON text in some datasets and parses it itself
            try:
                info = json.loads(info)
            except ValueError:
                info = None
        own = info.get("tool_defs") if isinstance(info, dict) else None  # the row's tools, as verifiers reads them
        tools = None if own is None else [tool_schema(t) for t in own] or None
        return Prompt(messages, ground_truth=row.get("answer"), meta=meta, tools=tools)

    def location(self, index: int) -> str:
        return f"row {index} of {self.name}"


@dataclass
class _Channel:
    """Between an episode's rollout and ``step``: the rollout's requests and end go in ``events``, the model's
    turn comes back through ``reply``. The rollout holds the channel, never the :class:`_Play`, so an episode
    rlkit drops is collected and its rollout cancelled."""

    events: asyncio.Queue
    reply: asyncio.Future | None = None


@dataclass
class _Play:
    """One episode: its rollout task, its channel, the messages of its last request (as chat dicts)."""

    task: asyncio.Task | None = None
    channel: _Channel | None = None
    asked: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False
    final: Any = None  # the ended rollout's verifiers state (a group rubric scores it with its group's)


class VerifiersEnvironment(Environment):
    """A verifiers ``MultiTurnEnv`` (any subclass, e.g. a ``ToolEnv`` or an Environments Hub package) as rlkit's
    ``data.environment``; see the module docstring.

    Each model turn goes to the environment as the assistant message of its text (with ``tool_calls`` parsed from
    Hermes/Qwen ``<tool_call>`` blocks when the environment offers tools; the blocks leave the content, as an
    OpenAI server's tool parser does). The messages the environment adds before its next request are the
    observation, rendered by the chat template; a request that does not extend the conversation so far (an
    environment that rewrites its history) is an error, since rlkit trains on one token row per episode. When the
    environment's rollout ends its rubric scores it (``Rubric.score_rollout``; a rubric with group reward functions
    scores a prompt's rollouts together once all have ended, ``Rubric.score_group``) and that reward is the last turn's
    environment reward, added to ``data.rewards``' score (``data.rewards: [NoOutcome]`` for the rubric's reward
    alone). An episode rlkit cuts (``max_new_tokens``, ``max_episode_tokens``) gets no rubric
    reward: it is truncated, as with every rlkit environment. An error verifiers catches (``vf.Error``) ends the
    episode as verifiers does (its rubric still scores it) and counts in ``episode/tool_errors``; an environment
    turn slower than ``turn_timeout_s`` ends the episode with no reward, also counted there.

    Args:
        env: ``module:attribute`` of a class or ``load_environment``-style factory, or an installed environment's
            id (``vf.load_environment``).
        env_args: its keyword arguments.
        max_turns: the most model turns; None takes the environment's own ``max_turns`` (which must be set). A
            number also bounds the environment (its ``max_turns`` is lowered to it), so it stops and scores the
            episode at that turn itself.
        max_episode_tokens: the most completion tokens of an episode (None: no budget).
        turn_timeout_s: the longest the environment may take to answer one turn (its ``env_response`` and stop
            conditions; the rubric at the end included).
    """

    def __init__(
        self,
        env: str,
        env_args: dict[str, Any] | None = None,
        max_turns: int | None = None,
        max_episode_tokens: int | None = None,
        turn_timeout_s: float = 60.0,
    ) -> None:
        self.env, self.verifiers = env, load(env, env_args)
        own = self.verifiers.max_turns if self.verifiers.max_turns > 0 else None
        if max_turns is None and own is None:
            raise ConfigError(
                f"data.environment (VerifiersEnvironment): {env} sets no max_turns: give max_turns (rlkit bounds "
                "every episode)"
            )
        self.max_turns = max_turns if own is None else min(own, max_turns or own)
        check_limits(self.max_turns, max_episode_tokens, "VerifiersEnvironment")
        self.verifiers.max_turns = self.max_turns
        self.max_episode_tokens = max_episode_tokens
        if not turn_timeout_s > 0:
            raise ConfigError(
                f"data.environment (VerifiersEnvironment): turn_timeout_s must be > 0, got {turn_timeout_s}"
            )
        self.turn_timeout_s = turn_timeout_s
        self._schemas = [tool_schema(t) for t in self.verifiers.tool_defs or []]
        self.group_rubric = bool(self.verifiers.rubric.has_group_rewards)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    def tool_schemas(self) -> list[dict[str, Any]] | None:
        return self._schemas or None

    def __getstate__(self) -> dict[str, Any]:  # the loop thread does not travel; a copy starts its own
        return {**self.__dict__, "_loop": None, "_lock": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, name="rlkit-verifiers", daemon=True).start()
            return self._loop

    def _call(self, coroutine) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._running_loop()).result()

    def reset(self, prompt: Prompt) -> _Play:
        play, meta = _Play(), prompt.meta
        messages = [{"role": "user", "content": prompt.prompt}] if isinstance(prompt.prompt, str) else prompt.prompt
        row = {
            "prompt": messages,
            "answer": prompt.ground_truth or "",
            "info": meta.get("info", {}),
            "example_id": meta.get("example_id", 0),
            **({"task": meta["task"]} if "task" in meta else {}),
        }
        self._call(self._start(play, row))
        try:
            first = self._next(play)
        except TimeoutError:
            _cancel(self._loop, play.task)
            raise RuntimeError(
                f"data.environment (VerifiersEnvironment): {self.env} did not ask for the first model turn within "
                f"turn_timeout_s={self.turn_timeout_s:g} s (its setup_state hangs?)"
            ) from None
        if play.done:
            self._result(play)  # its exception, if it raised
            raise RuntimeError(
                f"data.environment (VerifiersEnvironment): {self.env} ended an episode before the model's first turn"
            )
        if first != [_plain(m) for m in messages]:
            _cancel(self._loop, play.task)
            raise ConfigError(
                f"data.environment (VerifiersEnvironment): {self.env} asked its first turn with other messages than "
                f"the prompt rlkit rendered ({first!r}); use data.prompts=VerifiersPrompts, or prompts as chat messages"
            )
        weakref.finalize(play, _cancel, self._loop, play.task)  # an episode rlkit cut: its rollout is dropped
        return play

    async def _start(self, play: _Play, row: dict[str, Any]) -> None:
        channel = _Channel(asyncio.Queue())
        play.task = asyncio.get_running_loop().create_task(self._rollout(channel, row))
        play.task.add_done_callback(lambda task, events=channel.events: events.put_nowait(("done", task)))
        play.channel = channel

    async def _rollout(self, channel: _Channel, row: dict[str, Any]) -> Any:
        env = self.verifiers
        state = await env.rollout(row, _client_class()(channel), "rlkit", {})
        if not self.group_rubric:  # a group rubric scores the prompt's rollouts together: score_group
            await env.rubric.score_rollout(state)
        return state

    def _next(self, play: _Play) -> list[dict[str, Any]] | None:
        """Wait for the environment's next request (its messages) or the rollout's end (None)."""

        async def event():
            return await asyncio.wait_for(play.channel.events.get(), self.turn_timeout_s)

        kind, value = self._call(event())
        if kind == "done":
            play.done = True
            return None
        play.asked = [_plain(m) for m in value]
        return play.asked

    def _result(self, play: _Play) -> Any:
        """The finished rollout's state; an exception the environment's code raised, named."""
        try:
            return play.task.result()
        except Exception as e:
            raise RuntimeError(
                f"data.environment (VerifiersEnvironment): {self.env} raised {type(e).__name__}: {e}"
            ) from e

    def score_group(self, states: list[_Play]) -> list[float | None] | None:
        """With a group rubric (a reward function over ``states``/``completions``..., as verifiers'
        ``Rubric._is_group_func`` tells), ``Rubric.score_group`` over the prompt's episodes whose rollout ended
        (verifiers scores a group so, after its rollouts); an episode rlkit cut or that timed out has no state to
        score and gets no reward, so a group function sees the others only."""
        if not self.group_rubric:
            return None
        ended = [play.final for play in states if play.final is not None]
        if ended:
            scoring = asyncio.wait_for(self.verifiers.rubric.score_group(ended), self.turn_timeout_s)
            try:
                self._call(scoring)
            except TimeoutError:
                raise RuntimeError(
                    f"data.environment (VerifiersEnvironment): {self.env}'s group rubric did not score "
                    f"{len(ended)} rollouts within turn_timeout_s={self.turn_timeout_s:g} s"
                ) from None
        return [None if p.final is None or p.final.get("reward") is None else float(p.final["reward"]) for p in states]

    def step(self, state: _Play, text: str) -> Observation:
        if state.done:
            return Observation(done=True)
        calls = parse_tool_calls(text) if self._schemas else []
        before = state.asked
        self._running_loop().call_soon_threadsafe(state.channel.reply.set_result, (text, calls))
        try:
            asked = self._next(state)
        except TimeoutError:
            self._running_loop().call_soon_threadsafe(state.task.cancel)
            state.done = True
            return Observation(done=True, tool_calls=len(calls), tool_errors=1)
        errors = sum(c.error is not None for c in calls)
        if asked is None:
            final = state.final = self._result(state)
            errors += final.get("error") is not None
            reward = None if self.group_rubric else final.get("reward")
            return Observation(done=True, reward=None if reward is None else float(reward), tool_calls=len(calls),
                               tool_errors=errors)  # fmt: skip
        if len(asked) <= len(before) or asked[: len(before)] != before:
            raise RuntimeError(
                f"data.environment (VerifiersEnvironment): {self.env} asked for a turn with a conversation that does "
                "not extend the previous one (its get_prompt_messages rewrites the history); rlkit trains on one "
                "token row per episode, so such an environment cannot be played here"
            )
        added = asked[len(before) + 1 :]  # after the model's own turn
        return Observation(messages=added, tool_calls=len(calls), tool_errors=errors)


def _cancel(loop: asyncio.AbstractEventLoop | None, task: asyncio.Task | None) -> None:
    if loop is not None and task is not None and not loop.is_closed():
        loop.call_soon_threadsafe(task.cancel)


@functools.cache
def _client_class() -> type:
    """A ``vf.Client`` whose every response is the model turn rlkit hands over (made once verifiers imports)."""
    vf = _verifiers()

    class Handover(vf.Client):
        def __init__(self, channel: _Channel) -> None:
            super().__init__(channel)

        async def get_response(self, prompt, model, sampling_args, tools=None, **kwargs):
            channel = self.client
            channel.reply = asyncio.get_running_loop().create_future()
            channel.events.put_nowait(("ask", prompt))
            text, calls = await channel.reply
            tool_calls = [
                vf.ToolCall(id=f"call_{i}", name=c.name, arguments=json.dumps(c.arguments))
                for i, c in enumerate(calls)
                if c.error is None
            ]
            content = text
            if calls:
                content = "".join(part.split("</tool_call>")[-1] for part in text.split("<tool_call>")).strip()
            message = vf.ResponseMessage(
                content=content,
                tool_calls=tool_calls or None,
                finish_reason="tool_calls" if tool_calls else "stop",
                is_truncated=False,
            )
            return vf.Response(id=f"rlkit-{id(channel)}", created=int(time.time()), model=model, message=message)

        def setup_client(self, config):
            return None

        async def to_native_tool(self, tool):
            return tool

        async def to_native_prompt(self, messages):
            return messages, {}

        async def get_native_response(self, prompt, model, sampling_args, tools=None, **kwargs):
            raise NotImplementedError

        async def raise_from_native_response(self, response):
            return None

        async def from_native_response(self, response):
            return response

        async def close(self):
            return None

    return Handover
