"""Tools: a typed Python function becomes a JSON-schema tool; Hermes/Qwen ``<tool_call>`` blocks become calls.

The schema is the OpenAI / Hugging Face function format that ``tokenizer.apply_chat_template(...,
tools=[schema])`` renders (``{"type": "function", "function": {"name", "description", "parameters"}}``):
the name is the function's, the description its docstring's first paragraph, the parameters come from the
type hints and the Google ``Args:`` section. Calls are parsed in the Hermes format that Qwen2.5/Qwen3 and
the Hermes models emit: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

Policy for bad calls (as for rewards: stated, counted, never a crash): malformed JSON, an unclosed tag, an
unknown tool, wrong arguments, a tool that raises, a tool that runs past ``timeout_s`` — each is answered by
an error observation text the model reads next turn, and counts in ``episode/tool_errors``. A tool that
hangs is abandoned: it runs in a daemon thread that Python cannot stop, so after ``timeout_s`` the episode
moves on and the thread is left to finish; code that may never return belongs in a sandboxed tool whose
processes are killed (``rlkit.rewards.sandbox``).
"""

from __future__ import annotations

import inspect
import json
import re
import threading
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from rlkit.errors import ConfigError

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", dict: "object", list: "array"}
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def _type_schema(hint: Any, where: str) -> dict[str, Any]:
    """The JSON schema of one type hint (str, int, float, bool, list[X], dict, Literal[...], X | None)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return {"type": _JSON_TYPES[type(args[0])], "enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return _type_schema(rest[0], where)
        return {"anyOf": [_type_schema(a, where) for a in rest]}
    if origin in (list, tuple):
        return {"type": "array", **({"items": _type_schema(args[0], where)} if args else {})}
    if origin is dict:
        return {"type": "object"}
    if hint in _JSON_TYPES:
        return {"type": _JSON_TYPES[hint]}
    raise ConfigError(
        f"tool {where}: type {hint!r} has no JSON schema; use str, int, float, bool, list, dict or Literal"
    )


def _docstring_parts(doc: str) -> tuple[str, dict[str, str]]:
    """``(description, {argument: description})`` of a Google-style docstring."""
    doc = inspect.cleandoc(doc)
    description = doc.split("\n\n")[0].replace("\n", " ").strip()
    arguments: dict[str, str] = {}
    section = re.search(r"^Args:\s*\n((?:[ \t]+.*\n?|\s*\n)*)", doc, re.MULTILINE)
    current, indent = None, 0
    for line in section.group(1).splitlines() if section else []:
        match = re.match(r"^\s{2,}(\*{0,2}\w+)\s*(?:\([^)]*\))?:\s*(.*)$", line)
        if match and (current is None or len(line) - len(line.lstrip()) <= indent):
            current, indent = match.group(1), len(line) - len(line.lstrip())
            arguments[current] = match.group(2).strip()
        elif current is not None and line.strip():
            arguments[current] = f"{arguments[current]} {line.strip()}"
    return description, arguments


@dataclass
class Tool:
    """A function the model may call, with the JSON schema the chat template shows it.

    Attributes:
        function: the Python callable (keyword arguments named as in the schema).
        schema: ``{"type": "function", "function": {"name", "description", "parameters"}}``.
    """

    function: Callable[..., Any]
    schema: dict[str, Any]

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]

    @classmethod
    def from_function(cls, function: Callable[..., Any]) -> Tool:
        """The tool of ``function`` (or of a callable object's ``__call__``, named by its ``name``): every
        parameter needs a type hint and a line in the docstring's ``Args:``."""
        # a callable object (e.g. PythonTool) is described by its __call__ and named by its `name`
        plain = inspect.isfunction(function) or inspect.ismethod(function)
        described = function if plain else function.__call__
        name = function.__name__ if plain else getattr(function, "name", type(function).__name__)
        if not inspect.getdoc(described):
            raise ConfigError(f"tool {name}: the function has no docstring; write one (the model reads it)")
        description, documented = _docstring_parts(inspect.getdoc(described))
        hints = typing.get_type_hints(described)
        properties, required = {}, []
        for parameter in inspect.signature(described).parameters.values():
            where = f"{name}({parameter.name})"
            if parameter.name not in hints:
                raise ConfigError(f"tool {where}: the parameter has no type hint; annotate it (e.g. `: int`)")
            if parameter.name not in documented:
                raise ConfigError(f"tool {where}: the parameter is not in the docstring's Args: section; add it")
            properties[parameter.name] = {
                **_type_schema(hints[parameter.name], where),
                "description": documented[parameter.name],
            }
            if parameter.default is inspect.Parameter.empty:
                required.append(parameter.name)
        parameters = {"type": "object", "properties": properties, "required": required}
        return cls(
            function,
            {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}},
        )


@dataclass
class ToolCall:
    """One parsed call: ``name`` and ``arguments``, or the ``error`` that made it unreadable."""

    name: str | None = None
    arguments: dict[str, Any] | None = None
    error: str | None = None


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every ``<tool_call>{json}</tool_call>`` block of ``text`` in order (Hermes / Qwen format); a block
    that is not ``{"name": str, "arguments": object}`` (or an unclosed ``<tool_call>``) is an error call."""
    calls = []
    for body in _CALL.findall(text):
        try:
            payload = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(ToolCall(error=f"the tool call is not valid JSON ({e.msg} at column {e.colno})"))
            continue
        arguments = payload.get("arguments", {}) if isinstance(payload, dict) else None
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = None
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str) or not isinstance(arguments, dict):
            calls.append(ToolCall(error='a tool call must be {"name": "<tool>", "arguments": {...}}'))
            continue
        calls.append(ToolCall(payload["name"], arguments))
    if text.count("<tool_call>") > text.count("</tool_call>"):
        calls.append(ToolCall(error="a <tool_call> is not closed by </tool_call>"))
    return calls


def _check_arguments(tool: Tool, arguments: dict[str, Any]) -> str | None:
    """Why ``arguments`` do not fit the tool's schema (unknown, missing, wrong JSON type), or None."""
    parameters = tool.schema["function"]["parameters"]
    unknown = sorted(set(arguments) - set(parameters["properties"]))
    missing = [p for p in parameters["required"] if p not in arguments]
    if unknown or missing:
        return f"tool {tool.name} got unknown arguments {unknown} and lacks required {missing}"
    for key, value in arguments.items():
        expected = parameters["properties"][key].get("type")
        python = {v: k for k, v in _JSON_TYPES.items()}.get(expected)
        ok = python is None or (isinstance(value, python) and not (isinstance(value, bool) and python is not bool))
        if expected == "number":
            ok = isinstance(value, int | float) and not isinstance(value, bool)
        if not ok:
            return f"tool {tool.name}: argument {key!r} must be {expected}, got {type(value).__name__} {value!r}"
    return None


def run_tool_call(tools: dict[str, Tool], call: ToolCall, timeout_s: float) -> tuple[str, bool]:
    """``(result text, is_error)`` of one call: the tool's result (JSON for non-strings), or an error text."""
    if call.error is not None:
        return f"Error: {call.error}", True
    tool = tools.get(call.name)
    if tool is None:
        return f"Error: unknown tool {call.name!r}; the tools are {sorted(tools)}", True
    problem = _check_arguments(tool, call.arguments)
    if problem is not None:
        return f"Error: {problem}", True
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = tool.function(**call.arguments)
        except Exception as e:  # noqa: BLE001 - the model reads what went wrong
            outcome["error"] = f"{type(e).__name__}: {e}"

    worker = threading.Thread(target=target, name=f"rlkit-tool-{tool.name}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():  # abandoned (see the module docstring)
        return f"Error: tool {tool.name} did not return within {timeout_s:g} s", True
    if "error" in outcome:
        return f"Error: tool {tool.name} raised {outcome['error']}", True
    value = outcome.get("value")
    return (value if isinstance(value, str) else json.dumps(value)), False
