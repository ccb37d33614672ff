"""Prompt sources: where the questions a policy answers come from."""

from __future__ import annotations

import json
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlkit.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class Prompt:
    """One prompt.

    Attributes:
        prompt: plain text, or chat messages (``[{"role": ..., "content": ...}]``) to which the
            tokenizer's chat template is applied.
        ground_truth: the reference answer rewards compare against (verl's
            ``reward_model.ground_truth``), if any.
        meta: any other columns of the row (e.g. ``data_source``), passed to reward functions.
        tools: JSON schemas of the tools offered with this prompt alone (rendered by the chat template, as
            ``data.environment``'s are), in place of the environment's; None: the environment's. verifiers rows
            with ``info["tool_defs"]`` bring their own (:class:`~rlkit.environments.verifiers_env.VerifiersPrompts`).
    """

    prompt: str | list[dict[str, str]]
    ground_truth: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    tools: list[dict[str, Any]] | None = None


class PromptSource(ABC):
    """A finite, indexable collection of prompts (a map-style dataset)."""

    #: True for the embedded demo's tasks: their held-out set measures that task only, never a user's prompts.
    builtin = False

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __getitem__(self, index: int) -> Prompt: ...

    def location(self, index: int) -> str:
        """Where prompt ``index`` comes from, for messages (a file source names its file and line)."""
        return f"prompt #{index}"


class PromptSubset(PromptSource):
    """The prompts of ``source`` at ``indices``, in that order (one side of a held-out split).

    Args:
        source: the whole prompt source.
        indices: the positions in ``source`` this subset holds.
    """

    def __init__(self, source: PromptSource, indices: list[int]) -> None:
        self.source = source
        self.indices = list(indices)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> Prompt:
        return self.source[self.indices[index]]

    def location(self, index: int) -> str:
        return self.source.location(self.indices[index])


class PromptFile(PromptSource):
    """Prompts read from a JSONL, JSON or parquet file in TRL's or verl's layout.

    TRL's layout has a ``prompt`` column (plain text or chat messages) and no ground truth; verl's
    has ``prompt`` as chat messages plus ``reward_model: {"ground_truth": ...}``, ``data_source`` and
    ``extra_info``. Both read with the defaults: ``ground_truth`` is None when ``answer_key`` is
    absent from every row (an error when only some rows lack it). ``layout`` says which was found
    (``"verl"`` when every row has a ``reward_model`` column, else ``"trl"``). Every top-level column
    except the prompt's is kept in ``Prompt.meta`` (the answer column too: TRL reward functions
    receive it by its name, e.g. ``solution``).

    Args:
        path: a ``.jsonl`` file (one JSON object per line), a ``.json`` file (a list of objects) or
            a ``.parquet`` file.
        prompt_key: the column holding the prompt; dots reach into nested objects (``"a.b"`` reads
            ``row["a"]["b"]``; a column literally named ``"a.b"`` is read first).
        answer_key: the column holding the ground-truth answer, dotted like ``prompt_key``.
        limit: read only the first ``limit`` rows; None reads all.
    """

    def __init__(
        self,
        path: str,
        prompt_key: str = "prompt",
        answer_key: str = "reward_model.ground_truth",
        limit: int | None = None,
    ) -> None:
        if limit is not None and limit < 1:
            raise ValueError(f"PromptFile: limit must be a positive integer or None, got {limit}.")
        if not prompt_key or not answer_key:
            raise ValueError("PromptFile: prompt_key and answer_key must be non-empty column names.")
        self.path = Path(path)
        self.prompt_key = prompt_key
        self.answer_key = answer_key
        rows = _read_rows(self.path, limit)
        if not rows:
            raise ValueError(f"{self.path}: the file holds no prompts. Point `path` at a file with at least one row.")
        self.prompts = [self._parse(where, row) for where, row in rows]
        self.places = [where for where, _ in rows]
        missing = [where for (where, _), p in zip(rows, self.prompts, strict=True) if p.ground_truth is None]
        if 0 < len(missing) < len(rows):
            raise ValueError(
                f"{self.path}: answer_key {answer_key!r} is present in {len(rows) - len(missing)} rows "
                f"but missing (or null) in {len(missing)}, first at {missing[0]}. Give every row a "
                f"ground truth, or remove the column to train without one."
            )
        self.layout = "verl" if all("reward_model" in row for _, row in rows) else "trl"
        if missing:
            hints = sorted({k for _, row in rows for k in row} & {"answer", "solution", "ground_truth"})
            if hints:
                warnings.warn(
                    f"{self.path}: no row has answer_key {answer_key!r}, so prompts carry no ground "
                    f"truth; the file has column(s) {hints}: set answer_key to the one holding answers.",
                    stacklevel=2,
                )

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, index: int) -> Prompt:
        return self.prompts[index]

    def location(self, index: int) -> str:
        return f"{self.path}, {self.places[index]}"

    def _parse(self, where: str, row: dict[str, Any]) -> Prompt:
        found, prompt = _lookup(row, self.prompt_key)
        if not found:
            raise ValueError(
                f"{self.path}, {where}: no prompt key {self.prompt_key!r}; the row has keys "
                f"{sorted(row)}. Set prompt_key to the column holding the prompt (dots reach into "
                f"nested objects, e.g. 'question.text')."
            )
        prompt = _check_prompt(prompt, f"{self.path}, {where}")
        _, answer = _lookup(row, self.answer_key)
        if answer is not None:
            if isinstance(answer, bool) or not isinstance(answer, str | int | float):
                raise ValueError(
                    f"{self.path}, {where}: the ground truth at {self.answer_key!r} must be a string or "
                    f"a number, got {type(answer).__name__} {answer!r}. Store one answer per row."
                )
            answer = str(answer)
        drop = self.prompt_key if self.prompt_key in row else self.prompt_key.split(".")[0]
        meta = {k: v for k, v in row.items() if k != drop}
        return Prompt(prompt=prompt, ground_truth=answer, meta=meta)


def _read_rows(path: Path, limit: int | None) -> list[tuple[str, dict[str, Any]]]:
    """Rows of the file, each with where it came from (``"line 3"`` or ``"row 2 (from 0)"``)."""
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {str(path)!r} not found (or not a file). Check `path`.")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        rows = []
        for number, line in text_lines(path):
            if limit is not None and len(rows) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"{path}, line {number}: malformed JSON ({e.msg} at column {e.colno}). Each line "
                    f"of a .jsonl file must be one complete JSON object."
                ) from e
            rows.append((f"line {number}", row))
    elif suffix == ".json":
        try:
            data = json.loads(decode_utf8(path.read_bytes(), path))
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{path}, line {e.lineno}: malformed JSON ({e.msg} at column {e.colno}). A .json prompt "
                f"file must be one JSON list of objects."
            ) from e
        if not isinstance(data, list):
            raise ValueError(
                f"{path}: a .json prompt file must hold a list of objects, got {type(data).__name__}. "
                f"Wrap the rows in [...], or write one object per line to a .jsonl file."
            )
        rows = [(f"row {i} (from 0)", row) for i, row in enumerate(data[:limit])]
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        if limit is not None:
            table = table.slice(0, limit)
        rows = [(f"row {i} (from 0)", row) for i, row in enumerate(table.to_pylist())]
    else:
        raise ValueError(
            f"{path}: unknown file type {path.suffix!r}. Use .jsonl (one JSON object per line), "
            f".json (a list of objects) or .parquet."
        )
    for where, row in rows:
        if not isinstance(row, dict):
            raise ValueError(f"{path}, {where}: expected a JSON object, got {type(row).__name__}.")
    return rows


def text_lines(path: Path) -> Iterator[tuple[int, str]]:
    """The lines of a UTF-8 text file, numbered from 1 (a leading byte-order mark is dropped); a
    ``ConfigError`` naming the file, the line and the byte offset of the first byte that is not UTF-8."""
    offset = 0
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                yield number, raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise _not_utf8(path, number, offset + e.start, e.start, raw[e.start]) from None
            offset += len(raw)


def decode_utf8(data: bytes, path: Path) -> str:
    """The text of a whole file; a ``ConfigError`` naming its line and byte offset where it is not UTF-8."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line_start = data.rfind(b"\n", 0, e.start) + 1
        raise _not_utf8(path, data.count(b"\n", 0, e.start) + 1, e.start, e.start - line_start, data[e.start]) from None


def _not_utf8(path: Path, line: int, offset: int, column: int, byte: int) -> ConfigError:
    return ConfigError(
        f"{path}, line {line}: not UTF-8 text (byte 0x{byte:02x} at byte offset {offset} of the file, byte "
        f"{column + 1} of the line). Save the file as UTF-8 (from Latin-1, say: iconv -f latin1 -t utf-8 FILE > NEW)"
    )


def _lookup(row: dict[str, Any], key: str) -> tuple[bool, Any]:
    """``(found, value)`` of a dotted key: a literal column ``key`` first, then nested objects."""
    if key in row:
        return True, row[key]
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return False, None
        value = value[part]
    return True, value


def _check_prompt(prompt: Any, where: str) -> str | list[dict[str, str]]:
    """The prompt as plain text or validated chat messages (null fields of parquet structs dropped)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        for i, message in enumerate(prompt):
            if not (
                isinstance(message, dict)
                and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)
            ):
                raise ValueError(
                    f"{where}: chat message {i} must be an object with string 'role' and 'content', "
                    f"got {_shorten(repr(message))}. Write the prompt as plain text or as "
                    f'[{{"role": "user", "content": "..."}}].'
                )
        return [{k: v for k, v in message.items() if v is not None} for message in prompt]
    raise ValueError(
        f"{where}: the prompt must be a string or a non-empty list of chat messages "
        f'[{{"role": ..., "content": ...}}], got {type(prompt).__name__} {_shorten(repr(prompt))}.'
    )


def _shorten(text: str, width: int = 80) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def prompt_tools(prompt: Prompt, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """The tools offered with ``prompt``: its own (``prompt.tools``) if it has them, else ``tools`` (the
    environment's)."""
    return tools if getattr(prompt, "tools", None) is None else prompt.tools


def encode_prompt(
    prompt: Prompt,
    tokenizer: PreTrainedTokenizerBase,
    chat_template: bool | None = None,
    add_special_tokens: bool = True,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Token ids of a prompt, ready for generation.

    Chat messages go through ``tokenizer.apply_chat_template(..., add_generation_prompt=True)`` (as in
    verl and TRL), so the ids end where the assistant's answer starts. Plain text is tokenised with
    ``tokenizer(text, add_special_tokens=add_special_tokens)``; the default True adds BOS like
    ``transformers`` and vLLM do (TRL's GRPO passes False: set it to match a TRL run).

    Args:
        prompt: the prompt to encode.
        tokenizer: a Hugging Face tokenizer.
        chat_template: True applies the chat template (plain text becomes one user message); False
            tokenises plain text as is; None applies it exactly when the prompt is chat messages.
        add_special_tokens: for plain text without the chat template, add the tokenizer's special
            tokens (BOS). The chat template writes its own.
        tools: JSON schemas of the tools offered (``apply_chat_template(..., tools=)``); they need the chat
            template, so a plain-text prompt with ``chat_template=False`` and tools is an error. A prompt's own
            (``prompt.tools``) replace them.
    """
    tools = prompt_tools(prompt, tools)
    is_chat = isinstance(prompt.prompt, list)
    use_template = is_chat if chat_template is None else chat_template
    if is_chat and not use_template:
        raise ConfigError(
            "encode_prompt: chat messages need the chat template; chat_template=False works only for "
            "plain-text prompts. Pass chat_template=None or True."
        )
    if not use_template and tools:
        raise ConfigError(
            "encode_prompt: the environment offers tools, which only the chat template can show the model; "
            "set data.chat_template=true (or null with chat-message prompts)"
        )
    if not use_template:
        return list(tokenizer(prompt.prompt, add_special_tokens=add_special_tokens)["input_ids"])
    if getattr(tokenizer, "chat_template", None) is None:
        raise ConfigError(
            f"encode_prompt: the tokenizer ({type(tokenizer).__name__}) has no chat template, so chat "
            f"messages cannot be encoded. Set `tokenizer.chat_template` to a Jinja template (or save "
            f"one as chat_template.jinja beside the tokenizer), or use plain-text prompts."
        )
    messages = prompt.prompt if is_chat else [{"role": "user", "content": prompt.prompt}]
    ids = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    # transformers 5.x defaults to a BatchEncoding (return_dict=True); accept any container.
    if isinstance(ids, Mapping):
        ids = ids["input_ids"]
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    return [int(i) for i in ids]
