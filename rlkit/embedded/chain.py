"""Chained addition with a worked answer: the embedded task that needs no download.

A prompt reads ``"3+5+7="``; its worked solution writes one running sum per ``+``, ``"3+5=8,8+7=15"``, and
its ground truth is the final sum ``"15"``. Solutions grow with the number of terms (5 to 22 characters
for 2 to 4 single-digit terms), and errors change their length as well as their result: a skipped term
makes a completion shorter, a repeated one longer. Every distinct question falls in exactly one split,
decided by a fixed hash of its text, so ``split="train"`` and ``split="test"`` never share a question
whatever their seeds.
"""

from __future__ import annotations

import random

from rlkit.data.prompts import Prompt, PromptSource
from rlkit.data.splits import check_split, in_test_split


def worked_solution(terms: list[int]) -> tuple[str, str]:
    """The worked solution and the final sum of ``terms[0] + terms[1] + ...``: the one place both are written.

    >>> worked_solution([3, 5, 7])
    ('3+5=8,8+7=15', '15')
    """
    total, steps = terms[0], []
    for term in terms[1:]:
        steps.append(f"{total}+{term}={total + term}")
        total += term
    return ",".join(steps), str(total)


class AdditionChain(PromptSource):
    """Questions ``t1+t2+...+tk=`` answered by the running sums ``t1+t2=s2,s2+t3=s3,...``.

    A row draws ``k`` uniformly from ``min_terms..max_terms``, then each term uniformly from
    ``0..max_operand``, and keeps it if the question belongs to ``split``. ``Prompt.ground_truth`` is the
    final sum; ``Prompt.meta["solution"]`` is the worked solution (the supervised warm-up's target).

    Args:
        num_prompts: number of rows.
        min_terms: fewest terms of a question (>= 2).
        max_terms: most terms of a question.
        max_operand: largest term; terms are ``0..max_operand``.
        seed: seed of the draws.
        split: ``"train"`` or ``"test"``; the two share no question.
        test_fraction: share of the distinct questions held out for ``split="test"``.
        unique: each question at most once (a held-out set scored over distinct questions); otherwise
            questions repeat as often as the draws repeat them.
    """

    builtin = True  # its held-out split measures this task only

    def __init__(
        self,
        num_prompts: int = 4096,
        min_terms: int = 2,
        max_terms: int = 4,
        max_operand: int = 9,
        seed: int = 0,
        split: str = "train",
        test_fraction: float = 0.1,
        unique: bool = False,
    ) -> None:
        if num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
        if not 2 <= min_terms <= max_terms:
            raise ValueError(f"need 2 <= min_terms <= max_terms, got min_terms={min_terms}, max_terms={max_terms}")
        if max_operand < 1:
            raise ValueError(f"max_operand must be >= 1, got {max_operand}")
        check_split(split, test_fraction)
        self.num_prompts = num_prompts
        self.split = split
        rng = random.Random(seed)
        rows: list[tuple[int, ...]] = []
        seen: set[tuple[int, ...]] = set()
        # Rejection is cheap while the split holds many more questions than requested; give up well
        # before an unsatisfiable request (e.g. more unique questions than the split has) loops forever.
        for _ in range(100 * num_prompts):
            if len(rows) == num_prompts:
                break
            terms = tuple(rng.randint(0, max_operand) for _ in range(rng.randint(min_terms, max_terms)))
            if unique and terms in seen:
                continue
            if in_test_split(_question(terms), test_fraction) != (split == "test"):
                continue
            seen.add(terms)
            rows.append(terms)
        else:
            raise ValueError(
                f"split {split!r} could not supply {num_prompts} {'unique ' if unique else ''}questions with "
                f"terms {min_terms}..{max_terms}, max_operand={max_operand}, test_fraction={test_fraction}: "
                "lower num_prompts, or widen the question space (max_terms, max_operand)"
            )
        self._rows = rows

    def __len__(self) -> int:
        return self.num_prompts

    def __getitem__(self, index: int) -> Prompt:
        terms = list(self._rows[index])
        solution, answer = worked_solution(terms)
        return Prompt(
            prompt=_question(terms), ground_truth=answer, meta={"data_source": "addition_chain", "solution": solution}
        )


def _question(terms) -> str:
    return "+".join(map(str, terms)) + "="
