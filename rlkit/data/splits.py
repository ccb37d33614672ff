"""Held-out splits decided by a fixed hash of each question, so no seed can move a question across."""

from __future__ import annotations

import hashlib

SPLITS = ("train", "test")


def check_split(split: str, test_fraction: float) -> None:
    """Raise a ValueError naming the fix for an unknown ``split`` or a ``test_fraction`` outside (0, 1)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must lie in (0, 1), got {test_fraction}")


def in_test_split(key: str, test_fraction: float) -> bool:
    """Whether the question identified by ``key`` is held out: sha256 of the key, read as a fraction of 2^64."""
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < test_fraction


def prompt_key(prompt) -> str:
    """The text a prompt is hashed by: its plain text, or its chat messages as canonical JSON."""
    import json

    text = prompt.prompt
    return text if isinstance(text, str) else json.dumps(text, sort_keys=True, ensure_ascii=False)


def split_indices(source, test_fraction: float) -> tuple[list[int], list[int]]:
    """``(train, test)`` indices of ``source``: a prompt is held out when :func:`in_test_split` says so of
    its :func:`prompt_key`, so copies of one prompt always land on the same side, whatever the seed or order."""
    test = [i for i in range(len(source)) if in_test_split(prompt_key(source[i]), test_fraction)]
    held = set(test)
    return [i for i in range(len(source)) if i not in held], test
