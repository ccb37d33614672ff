"""Single-digit arithmetic: a one-step task (the first embedded default; now ``rlkit.embedded.chain``).

A prompt reads ``"3+5="`` and its ground truth is ``"8"``. Every distinct question ``(a, op, b)`` falls in
exactly one split, so ``split="train"`` and ``split="test"`` never share a question whatever their seeds.
"""

from __future__ import annotations

import torch

from rlkit.data.prompts import Prompt, PromptSource
from rlkit.data.splits import check_split, in_test_split

OPERATIONS = "+-*"


def question(a: int, op: str, b: int) -> tuple[str, str]:
    """The prompt text and the answer of one question: the one place both are written.

    >>> question(3, "+", 5)
    ('3+5=', '8')
    """
    answer = {"+": a + b, "-": a - b, "*": a * b}[op]
    return f"{a}{op}{b}=", str(answer)


class Arithmetic(PromptSource):
    """Questions ``a op b =`` with ``0 <= a, b <= max_operand``, answered by the exact integer result.

    The split's distinct questions are listed in a seeded random order and repeated (each pass in a new
    order) until ``num_prompts`` rows: every question appears ``num_prompts / #questions`` times, ±1.

    Args:
        num_prompts: number of rows (questions repeat when it exceeds the split's distinct questions).
        max_operand: largest operand; operands are ``0..max_operand``.
        operations: the operators to draw from, any of ``"+-*"`` (e.g. ``"+-"``).
        seed: seed of the row order.
        split: ``"train"`` or ``"test"``; the two are disjoint.
        test_fraction: share of the distinct questions held out for ``split="test"``.
    """

    builtin = True  # its held-out split measures this task only

    def __init__(
        self,
        num_prompts: int = 1024,
        max_operand: int = 9,
        operations: str = "+",
        seed: int = 0,
        split: str = "train",
        test_fraction: float = 0.2,
    ) -> None:
        if num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
        if max_operand < 0:
            raise ValueError(f"max_operand must be >= 0, got {max_operand}")
        if not operations or set(operations) - set(OPERATIONS) or len(set(operations)) != len(operations):
            raise ValueError(f"operations must be distinct characters among {OPERATIONS!r}, got {operations!r}")
        check_split(split, test_fraction)
        self.num_prompts = num_prompts
        self.split = split
        questions = [
            (a, op, b)
            for op in operations
            for a in range(max_operand + 1)
            for b in range(max_operand + 1)
            if in_test_split(f"{a}{op}{b}", test_fraction) == (split == "test")
        ]
        if not questions:
            raise ValueError(
                f"split {split!r} holds no question with max_operand={max_operand}, "
                f"operations={operations!r}, test_fraction={test_fraction}; raise max_operand or "
                "move test_fraction away from 0/1"
            )
        generator = torch.Generator().manual_seed(seed)
        passes = -(-num_prompts // len(questions))
        order = torch.cat([torch.randperm(len(questions), generator=generator) for _ in range(passes)])
        self._rows = [questions[i] for i in order[:num_prompts].tolist()]

    def __len__(self) -> int:
        return self.num_prompts

    def __getitem__(self, index: int) -> Prompt:
        a, op, b = self._rows[index]
        text, answer = question(a, op, b)
        return Prompt(prompt=text, ground_truth=answer, meta={"data_source": "arithmetic"})
