"""The embedded task: worked solutions, disjoint deterministic splits, unique held-out questions."""

from collections import Counter

import pytest

from rlkit.data.splits import in_test_split
from rlkit.embedded.chain import AdditionChain, worked_solution


def test_worked_solution_writes_one_running_sum_per_plus():
    assert worked_solution([3, 5]) == ("3+5=8", "8")
    assert worked_solution([3, 5, 7]) == ("3+5=8,8+7=15", "15")
    assert worked_solution([9, 9, 9, 9]) == ("9+9=18,18+9=27,27+9=36", "36")


def test_rows_carry_prompt_answer_and_solution():
    source = AdditionChain(num_prompts=300, seed=1)
    for i in range(len(source)):
        row = source[i]
        terms = [int(t) for t in row.prompt.rstrip("=").split("+")]
        assert row.prompt.endswith("=") and 2 <= len(terms) <= 4 and max(terms) <= 9
        assert row.ground_truth == str(sum(terms))
        assert row.meta["solution"] == worked_solution(terms)[0]
        assert row.meta["solution"].endswith("=" + row.ground_truth)


def test_solutions_vary_in_length():
    """Completions (solution + EOS) from 6 to 23 tokens with the defaults; every length of term count occurs."""
    source = AdditionChain(num_prompts=2000)
    lengths = [len(source[i].meta["solution"]) + 1 for i in range(len(source))]
    assert min(lengths) == 6 and max(lengths) == 23
    terms = Counter(source[i].prompt.count("+") + 1 for i in range(len(source)))
    assert set(terms) == {2, 3, 4} and min(terms.values()) > 500  # the number of terms is drawn uniformly


def test_splits_are_disjoint_whatever_the_seeds():
    train = AdditionChain(num_prompts=10000, seed=0, split="train")
    test = AdditionChain(num_prompts=1000, seed=7, split="test", unique=True)
    train_questions = {train[i].prompt for i in range(len(train))}
    test_questions = [test[i].prompt for i in range(len(test))]
    assert not train_questions & set(test_questions)
    assert len(set(test_questions)) == 1000  # unique: a thousand distinct held-out questions
    assert all(in_test_split(q, 0.1) for q in test_questions)


def test_deterministic_by_seed():
    a, b, c = (AdditionChain(num_prompts=100, seed=s) for s in (3, 3, 4))
    assert [a[i] for i in range(100)] == [b[i] for i in range(100)]
    assert [a[i].prompt for i in range(100)] != [c[i].prompt for i in range(100)]


def test_the_experiments_held_out_set_is_512_distinct_questions():
    held_out = AdditionChain(num_prompts=512, split="test", unique=True)
    assert len({held_out[i].prompt for i in range(512)}) == 512


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"num_prompts": 0}, "num_prompts"),
        ({"min_terms": 1}, "min_terms"),
        ({"min_terms": 4, "max_terms": 3}, "min_terms"),
        ({"max_operand": 0}, "max_operand"),
        ({"split": "valid"}, "split"),
        ({"test_fraction": 0.0}, "test_fraction"),
        ({"num_prompts": 1200, "split": "test", "unique": True}, "could not supply 1200 unique"),
    ],
)
def test_invalid_settings_raise(kwargs, words):
    with pytest.raises(ValueError, match=words):
        AdditionChain(**kwargs)
