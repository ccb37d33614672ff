"""Where a solution's ``\\boxed{...}`` answer is: shared by answer extraction in the rewards
(:mod:`rlkit.rewards.math`) and by data conversion (:mod:`rlkit.data.prepare`), so it lives below both."""

import re

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BRACE = re.compile(r"[{}]")


def last_boxed_span(text: str) -> tuple[int, int, int] | None:
    """Where the last complete ``\\boxed{...}`` (or ``\\fbox{...}``) is: ``(start, content start, end)``
    with ``text[start:end]`` the whole box; None if there is none. One pass over the braces (linear time,
    however many unclosed boxes a completion opens)."""
    boxes = list(_BOXED.finditer(text))
    if not boxes:
        return None
    closing, opened = {}, []  # the position of each "{" -> that of its "}"
    for brace in _BRACE.finditer(text, boxes[0].end() - 1):
        if brace.group() == "{":
            opened.append(brace.start())
        elif opened:
            closing[opened.pop()] = brace.start()
    for box in reversed(boxes):
        if (end := closing.get(box.end() - 1)) is not None:
            return box.start(), box.end(), end + 1
    return None
