"""The arithmetic task: prompt/answer text, disjoint deterministic splits."""

import pytest

from rlkit.embedded.arithmetic import Arithmetic, question


def test_question_text_and_answer():
    assert question(3, "+", 5) == ("3+5=", "8")
    assert question(2, "-", 7) == ("2-7=", "-5")
    assert question(4, "*", 9) == ("4*9=", "36")


def _questions(source):
    return {source[i].prompt for i in range(len(source))}


def test_splits_are_disjoint_and_cover_every_question():
    # 10 x 10 single-digit additions: train and test share none and together hold all 100.
    train = Arithmetic(num_prompts=1000, seed=0, split="train")
    test = Arithmetic(num_prompts=1000, seed=7, split="test")
    assert not _questions(train) & _questions(test)
    assert len(_questions(train) | _questions(test)) == 100
    assert 0 < len(_questions(test)) < 40  # about test_fraction = 0.2 of the questions


def test_ground_truth_is_the_result():
    source = Arithmetic(num_prompts=50, operations="+-*", max_operand=12)
    for i in range(len(source)):
        row = source[i]
        assert str(eval(row.prompt.rstrip("="))) == row.ground_truth


def test_deterministic_order_and_balanced_repeats():
    a, b = Arithmetic(num_prompts=200, seed=3), Arithmetic(num_prompts=200, seed=3)
    assert [a[i] for i in range(200)] == [b[i] for i in range(200)]
    c = Arithmetic(num_prompts=200, seed=4)
    assert [a[i].prompt for i in range(200)] != [c[i].prompt for i in range(200)]
    # Each pass visits every train question once: counts differ by at most one.
    counts = {}
    for i in range(len(a)):
        counts[a[i].prompt] = counts.get(a[i].prompt, 0) + 1
    assert max(counts.values()) - min(counts.values()) <= 1


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"num_prompts": 0}, "num_prompts"),
        ({"max_operand": -1}, "max_operand"),
        ({"operations": "/"}, "operations"),
        ({"operations": "++"}, "operations"),
        ({"split": "valid"}, "split"),
        ({"test_fraction": 1.0}, "test_fraction"),
    ],
)
def test_invalid_settings_raise(kwargs, words):
    with pytest.raises(ValueError, match=words):
        Arithmetic(**kwargs)
