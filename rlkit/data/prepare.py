"""``rlkit data``: local GSM8K / MATH-style files into the prompt layout ``PromptFile`` reads.

The output follows verl's data-preparation scripts (``examples/data_preprocess/gsm8k.py`` and
``math_dataset.py``): a ``prompt`` (chat messages, so the tokenizer's chat template is applied at
training time, or plain text), ``reward_model.ground_truth`` (GSM8K: the number after ``####``,
commas removed; MATH: the last ``\\boxed{}`` of the solution), ``data_source``, ``ability`` and
``extra_info`` (split, index, raw question and answer). With a tokenizer, prompts longer than
``--max-prompt-length`` tokens (counted as training encodes them) are dropped and counted, or stop
the conversion naming the row, as verl's ``filter_overlong_prompts`` does.

Examples::

    rlkit data gsm8k train.parquet -o data/gsm8k_train.parquet
    rlkit data math test.jsonl -o data/math_test.jsonl --tokenizer ckpt/ --max-prompt-length 512
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlkit.data.boxed import last_boxed_span
from rlkit.data.prompts import text_lines
from rlkit.errors import ConfigError


@dataclass(frozen=True)
class Recipe:
    """How one kind of data set becomes prompts: its columns, answer format and verl's defaults."""

    question_key: str
    answer_key: str
    answer_format: str  # "gsm8k" (#### 42), "boxed" (last \boxed{}) or "plain"
    data_source: str
    instruction: str


RECIPES = {
    "gsm8k": Recipe(
        "question",
        "answer",
        "gsm8k",
        "openai/gsm8k",
        'Let\'s think step by step and output the final answer after "####".',
    ),
    "math": Recipe(
        "problem",
        "solution",
        "boxed",
        "DigitalLearningGmbH/MATH-lighteval",
        "Let's think step by step and output the final answer within \\boxed{}.",
    ),
}

_GSM8K_ANSWER = re.compile(r"####\s*(-?[0-9.,]+)")


def last_boxed(text: str) -> str | None:
    """The content of the last complete ``\\boxed{...}`` (or ``\\fbox{...}``), nested braces allowed."""
    box = last_boxed_span(text)
    return None if box is None else text[box[1] : box[2] - 1]


def ground_truth(answer: str, answer_format: str) -> str | None:
    """The reference answer in an answer field, or None when the field has none in that format."""
    if answer_format == "gsm8k":
        found = _GSM8K_ANSWER.findall(answer)
        return found[-1].replace(",", "").rstrip(".") if found else None
    if answer_format == "boxed":
        boxed = last_boxed(answer)
        return boxed.strip() if boxed is not None and boxed.strip() else None
    return answer.strip() or None


def read_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """The rows of a JSONL or parquet file, each with where it is, 1-based as editors show it."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file. Give a local .jsonl or .parquet file.")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        for number, line in text_lines(path):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}, line {number}: malformed JSON ({e.msg} at column {e.colno}).") from None
            if not isinstance(row, dict):
                raise ConfigError(f"{path}, line {number}: expected a JSON object, got {type(row).__name__}.")
            yield f"line {number}", row
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        for number, row in enumerate(pq.read_table(path).to_pylist(), start=1):
            yield f"row {number}", row
    else:
        raise ConfigError(f"{path}: unknown file type {path.suffix!r}; give a .jsonl or .parquet file, as published.")


def _field(path: Path, where: str, row: dict[str, Any], key: str) -> str:
    if key not in row:
        raise ConfigError(f"{path}, {where}, field {key!r}: missing; the row has fields {sorted(row)}.")
    value = row[key]
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(
            f"{path}, {where}, field {key!r}: expected non-empty text, got {type(value).__name__} {repr(value)[:60]}."
        )
    return value


def convert(
    path: Path,
    recipe: Recipe,
    split: str,
    instruction: str | None = None,
    prompt_format: str = "chat",
    system: str | None = None,
    tokenizer=None,
    max_prompt_length: int | None = None,
    long_prompts: str = "drop",
) -> tuple[list[dict[str, Any]], int]:
    """The prompt rows of ``path`` and how many were dropped as too long.

    Args:
        path: a GSM8K- or MATH-style ``.jsonl`` or ``.parquet`` file.
        recipe: its columns, answer format, data source and default instruction.
        split: the split name kept in ``extra_info``.
        instruction: appended to each question after a space; None uses the recipe's, "" none.
        prompt_format: ``"chat"`` (a user message; the chat template applies at training) or ``"text"``.
        system: a system message put first (chat only).
        tokenizer: counts prompt tokens as training encodes them; None skips the length check.
        max_prompt_length: the most prompt tokens (needs ``tokenizer``).
        long_prompts: ``"drop"`` (and count) or ``"error"`` (naming the row) for longer prompts.
    """
    from rlkit.data.prompts import Prompt, encode_prompt

    suffix = recipe.instruction if instruction is None else instruction
    rows, dropped, shortest = [], 0, None
    for index, (where, raw) in enumerate(read_rows(path)):
        question = _field(path, where, raw, recipe.question_key)
        answer = _field(path, where, raw, recipe.answer_key)
        truth = ground_truth(answer, recipe.answer_format)
        if truth is None:
            expected = {"gsm8k": "final '#### <number>'", "boxed": "\\boxed{...} answer"}.get(recipe.answer_format)
            raise ConfigError(
                f"{path}, {where}, field {recipe.answer_key!r}: no {expected} in {answer[-80:]!r}. Fix or remove "
                f"the row, or pass --answer-format matching the data."
            )
        content = f"{question.strip()} {suffix}".strip()
        if prompt_format == "chat":
            prompt: Any = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": content}
            ]
        else:
            prompt = content
        if tokenizer is not None and max_prompt_length is not None:
            length = len(encode_prompt(Prompt(prompt), tokenizer))
            if length > max_prompt_length:
                if long_prompts == "error":
                    raise ConfigError(
                        f"{path}, {where}: the prompt has {length} tokens, more than --max-prompt-length "
                        f"{max_prompt_length}. Raise the limit, or pass --long-prompts drop to leave such rows out."
                    )
                dropped += 1
                shortest = length if shortest is None else min(shortest, length)
                continue
        rows.append(
            {
                "data_source": recipe.data_source,
                "prompt": prompt,
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": truth},
                "extra_info": {"split": split, "index": index, "question": question, "answer": answer},
            }
        )
    if not rows and dropped:
        raise ConfigError(
            f"{path}: all {dropped} prompts are longer than --max-prompt-length {max_prompt_length} (the shortest "
            f"has {shortest} tokens as {type(tokenizer).__name__} counts them), so nothing would be written: raise "
            f"--max-prompt-length to {shortest} or more (and data.max_prompt_length of the run with it)"
        )
    return rows, dropped


def check_output(source: Path, target: Path, overwrite: bool) -> None:
    """Refuse an output that is the input itself (also through a link) or that exists (unless
    ``overwrite``), before anything is read: no file is replaced unasked."""
    if target.suffix.lower() not in (".jsonl", ".parquet"):
        raise ConfigError(f"-o {target}: give a .jsonl or .parquet file name (the format follows the suffix).")
    if target.is_dir():
        raise ConfigError(f"-o {target} is a directory; give a file name inside it, e.g. {target / 'train.parquet'}.")
    if not target.exists():
        return
    if source.exists() and os.path.samefile(source, target):
        raise ConfigError(
            f"-o {target} is the input file itself ({source}): the conversion would replace the data it reads. "
            f"Write to another file."
        )
    if not overwrite:
        raise ConfigError(f"-o {target} exists: pass --overwrite to replace it, or choose another file.")


def write_rows(rows: list[dict[str, Any]], path: Path) -> None:
    """Write ``rows`` to ``path`` (``.parquet``, else JSONL) through a temporary file beside it, renamed over
    it once complete: an interrupted write leaves the old file as it was."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        with partial.open("wb") as f:
            if path.suffix.lower() == ".parquet":
                import pyarrow as pa
                import pyarrow.parquet as pq

                pq.write_table(pa.Table.from_pylist(rows), f)
            else:
                for row in rows:
                    f.write((json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def _load_tokenizer(directory: str):
    from transformers import AutoTokenizer

    if not Path(directory).is_dir():
        raise FileNotFoundError(f"--tokenizer: {directory} is not a directory; give a local tokenizer directory.")
    try:
        return AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--tokenizer: cannot load a tokenizer from {directory}: {e}") from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rlkit data",
        description="Convert a local GSM8K- or MATH-style file (.jsonl or .parquet, as published) into "
        "rlkit's prompt layout (verl's: prompt + reward_model.ground_truth).",
    )
    p.add_argument("dataset", choices=sorted(RECIPES), help="the data set's kind: its fields and answer format")
    p.add_argument("input", type=Path, help="a local .jsonl or .parquet file")
    p.add_argument("-o", "--output", type=Path, required=True, help="where to write: .jsonl or .parquet")
    p.add_argument("--overwrite", action="store_true", help="replace the output file if it exists (never the input)")
    p.add_argument("--split", help="split name stored in extra_info (default: the input file's name)")
    p.add_argument("--instruction", help="text appended to each question (default: verl's for the data set; '' none)")
    p.add_argument("--prompt-format", choices=("chat", "text"), default="chat", help="chat messages or plain text")
    p.add_argument("--system", help="a system message put before the question (chat only)")
    p.add_argument("--question-key", help="the question's field (default: the data set's)")
    p.add_argument("--answer-key", help="the answer's field (default: the data set's)")
    p.add_argument("--answer-format", choices=("gsm8k", "boxed", "plain"), help="how the answer field holds the answer")
    p.add_argument("--data-source", help="the data_source column (default: verl's name for the data set)")
    p.add_argument("--tokenizer", help="a local tokenizer directory, to measure prompts in tokens")
    p.add_argument("--max-prompt-length", type=int, help="the most prompt tokens (needs --tokenizer)")
    p.add_argument("--long-prompts", choices=("drop", "error"), default="drop", help="what a longer prompt does")
    return p


def main(argv: list[str]) -> None:
    """``rlkit data ...``"""
    args = parser().parse_args(argv)
    base = RECIPES[args.dataset]
    recipe = Recipe(
        args.question_key or base.question_key,
        args.answer_key or base.answer_key,
        args.answer_format or base.answer_format,
        args.data_source or base.data_source,
        base.instruction,
    )
    if args.max_prompt_length is not None and args.tokenizer is None:
        raise ConfigError("--max-prompt-length needs --tokenizer (prompts are measured in its tokens).")
    if args.max_prompt_length is not None and args.max_prompt_length < 1:
        raise ConfigError(f"--max-prompt-length must be >= 1, got {args.max_prompt_length}.")
    if args.system and args.prompt_format != "chat":
        raise ConfigError("--system needs --prompt-format chat.")
    check_output(args.input, args.output, args.overwrite)
    tokenizer = _load_tokenizer(args.tokenizer) if args.tokenizer else None
    rows, dropped = convert(
        args.input,
        recipe,
        split=args.split or args.input.name.split(".")[0],
        instruction=args.instruction,
        prompt_format=args.prompt_format,
        system=args.system,
        tokenizer=tokenizer,
        max_prompt_length=args.max_prompt_length,
        long_prompts=args.long_prompts,
    )
    if not rows:
        raise ConfigError(f"{args.input}: no prompts left to write ({dropped} dropped as too long).")
    write_rows(rows, args.output)
    note = f", dropped {dropped} longer than {args.max_prompt_length} tokens" if args.max_prompt_length else ""
    print(f"rlkit data: wrote {len(rows)} prompts to {args.output}{note}")
