"""The data checked against the run's settings before the engine starts, every problem in one message.

A first run on a small file of one's own used to fail four times, each ~20 s into start-up and each time on
one problem: fewer prompts than ``prompts_per_step``, a ``val_check_interval`` longer than an epoch (a
33-line Lightning traceback), a chat template the tokenizer lacks, prompts longer than the
``max_prompt_length`` inherited from the embedded task. :func:`check_data` finds them all at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlkit.data.prompts import PromptSource, encode_prompt
from rlkit.errors import ConfigError


@dataclass(frozen=True)
class DataLimits:
    """The settings the training prompts must fit: ``data.prompts_per_step``, ``data.max_prompt_length``
    and ``data.long_prompts``."""

    prompts_per_step: int
    max_prompt_length: int
    long_prompts: str


def prompt_lengths(
    prompts: PromptSource, tokenizer, chat_template: bool | None, tools: list[dict] | None = None
) -> tuple[list[int], str | None]:
    """Each prompt's token count as training encodes it (with the environment's ``tools`` in the template),
    and the first encoding error's message (the counts then stop there). Plain text without the chat
    template is tokenised in one batch."""
    rows = [prompts[i] for i in range(len(prompts))]
    texts = [row.prompt for row in rows]
    own_tools = any(getattr(row, "tools", None) is not None for row in rows)
    if not chat_template and not tools and not own_tools and all(isinstance(t, str) for t in texts):
        distinct = list(dict.fromkeys(texts))  # the embedded task's 16384 prompts are ~5k questions
        if getattr(tokenizer, "is_fast", False):  # the Rust tokenizer itself: ~0.3 s for those 5k here
            counts = [len(e.ids) for e in tokenizer.backend_tokenizer.encode_batch(distinct, add_special_tokens=True)]
        else:
            counts = [len(ids) for ids in tokenizer(distinct, add_special_tokens=True)["input_ids"]]
        length = dict(zip(distinct, counts, strict=True))
        return [length[t] for t in texts], None
    lengths = []
    for i, row in enumerate(rows):
        try:
            lengths.append(len(encode_prompt(row, tokenizer, chat_template, tools=tools)))
        except ConfigError as error:
            return lengths, f"{prompts.location(i)}: {error}"
    return lengths, None


def prompt_problems(prompts: PromptSource, lengths: list[int], limits: DataLimits) -> list[str]:
    """What is wrong with the training prompts' count and lengths (``lengths`` as :func:`prompt_lengths`)."""
    problems = []
    total, step = len(prompts), limits.prompts_per_step
    if total < step:
        problems.append(count_problem(total, step))
    limit = limits.max_prompt_length
    long = [i for i, n in enumerate(lengths) if n > limit]
    if not long:
        return problems
    longest = max(lengths[i] for i in long)
    inherited = "" if prompts.builtin else " (configs/tasks/embedded.yaml sets 16 for its own short additions)"
    if limits.long_prompts == "error":
        problems.append(
            f"{len(long)} of {total} prompts are longer than data.max_prompt_length={limit}{inherited}, the "
            f"longest {longest} tokens, the first at {prompts.location(long[0])}: set "
            f"--data.max_prompt_length={longest}, or --data.long_prompts=skip to drop them"
        )
    elif total - len(long) < step and total >= step:
        problems.append(
            f"only {total - len(long)} of {total} prompts fit data.max_prompt_length={limit}{inherited}, fewer "
            f"than data.prompts_per_step={step}: set --data.max_prompt_length={longest}"
        )
    return problems


def count_problem(total: int, step: int) -> str:
    """Fewer training prompts than one rollout takes."""
    return (
        f"data.prompts holds {total} prompts, fewer than data.prompts_per_step={step}: set "
        f"--data.prompts_per_step={max(total // 2, 1)} (or lower), or add prompts"
    )


def encoding_problem(message: str, key: str) -> str:
    """An encoding error of the prompts at config key ``key``, with the fixes a user's file needs."""
    return (
        f"{key}: {message} A prompt file of chat messages can be rewritten as plain text with `rlkit data ... "
        "--prompt-format text`; plain-text prompts need --data.chat_template=null (or false)"
    )


def val_interval_problem(trainer, batches: int) -> str | None:
    """Lightning's refusal of a ``val_check_interval`` longer than an epoch of ``batches`` rollouts, as one
    line naming both fixes (Lightning's own is a traceback at the start of the first epoch)."""
    interval = trainer.val_check_interval
    limit = trainer.limit_train_batches
    batches = min(batches, limit) if isinstance(limit, int) else int(batches * limit)
    if (
        not isinstance(interval, int)
        or interval <= batches
        or trainer.check_val_every_n_epoch is None
        or not trainer.limit_val_batches
    ):
        return None
    return (
        f"trainer.val_check_interval={interval} is longer than an epoch of the prompts ({batches} rollouts): set "
        f"--trainer.check_val_every_n_epoch=null (count the interval across epochs), or "
        f"--trainer.val_check_interval={max(batches, 1)} (or less)"
    )


def raise_problems(problems: list[str]) -> None:
    """One ``ConfigError`` listing every problem with its fix; nothing if there is none."""
    if not problems:
        return
    if len(problems) == 1:
        raise ConfigError(problems[0])
    listed = "\n".join(f"  - {p}" for p in problems)
    raise ConfigError(f"the data does not fit this run's settings ({len(problems)} problems):\n{listed}")
