"""The grade happens where the solution cannot reach: its tests run in another process, which calls the
solution across the process boundary and sees only plain data. Each attack on the grade (a value equal
to everything, patching the checking code, walking the frames for a pass token, reading the tests) is
written to pass exactly when it works; each scores 0, in this process and through reward workers."""

import math
import textwrap

import pytest
from code_fixtures import (
    ALWAYS_EQUAL,
    ALWAYS_EQUAL_OBJECT,
    FRAME_WALK,
    GOOD,
    PATCH_THE_GRADER,
    READ_THE_TESTS,
    TESTS,
    WRONG,
    problem,
    reward,
    score,
    secret_problem,
)

from rlkit.data.prompts import Prompt
from rlkit.rewards._plain_data import decode, encode
from rlkit.rewards.sandbox import run_python

# --- plain data ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        None, True, 0, -7, 2**5000, 1.5, "text", "", [1, [2.0, "x"]], (1, (2, None)), {1: "a", (2, 3): [4]},
        {"a": {"b": ()}}, {1, 2}, frozenset({"x"}), [(), [], {}],
    ],
)  # fmt: skip
def test_plain_data_crosses_unchanged(value):
    back = decode(encode(value))
    assert back == value and type(back) is type(value)


def test_plain_data_keeps_nan_and_types_apart():
    assert math.isnan(decode(encode(float("nan"))))
    assert decode(encode([1, 1.0, True])) == [1, 1.0, True]
    assert [type(v) for v in decode(encode([1, 1.0, True]))] == [int, float, bool]


class Anything:
    def __eq__(self, other):
        return True


class Number(int):
    pass


@pytest.mark.parametrize("value", [Anything(), Number(3), [1, Number(3)], {"k": Anything()}, b"bytes", print])
def test_what_is_not_plain_data_does_not_cross(value):
    with pytest.raises(TypeError, match="is not plain data"):
        encode(value)


@pytest.mark.parametrize("data", [{"a": 1}, {"tuple": 1}, {"dict": [[1]]}, {"object": []}, {"tuple": [], "set": []}])
def test_decoding_builds_only_what_encoding_writes(data):
    with pytest.raises(ValueError, match="not plain data"):
        decode(data)


# --- the grade ----------------------------------------------------------------------------------------


def test_the_tests_call_the_solution_across_the_process_boundary():
    tests = textwrap.dedent(
        """
        marker = "set by the tests"
        assert add(2, 3) == 5 and add(a=1, b=2) == 3 and add((1,), (2,)) == (1, 2)
        assert add.__name__ == "add" and peek() is None  # the solution's globals are not the tests'
        assert isinstance(add(1, 2), int) and type(add([1], [2])) is list
        try:
            add(1, "x")
        except TypeError as error:
            assert "in the solution" in str(error)
        else:
            raise AssertionError("no TypeError")
        """
    )
    result = run_python(GOOD + "def peek():\n    return globals().get('marker')\n", tests)
    assert result.passed, result.tests_output


def test_a_result_that_is_not_plain_data_fails_the_test():
    result = run_python("def f():\n    return object()\n", "f()\n")
    assert not result.passed and "SolutionError" in result.tests_output and "not plain data" in result.tests_output


def test_solution_names_do_not_hide_the_tests_builtins():
    # a `len` of the solution's must not answer the tests' len()
    solution = "def f():\n    return [1]\ndef len(x):\n    return 3\n"
    assert reward()(solution, problem("assert len(f()) == 3\n")) == 0.0


@pytest.mark.parametrize(
    "attack",
    [ALWAYS_EQUAL, ALWAYS_EQUAL_OBJECT, PATCH_THE_GRADER, FRAME_WALK],
    ids=["always-equal-int", "always-equal-object", "patch-the-grader", "frame-walk"],
)
def test_attacks_on_the_grade_score_zero(attack):
    # each scored 1.0 when solution and tests shared a process
    assert reward()(attack, problem()) == 0.0


def test_the_tests_cannot_be_read_from_the_solutions_process():
    prompt, token = secret_problem()
    assert reward()(READ_THE_TESTS, prompt) == 0.0
    # the search does work: the same code passes when the answer is somewhere it looks
    planted = READ_THE_TESTS + f"\nplanted = {{'answer': {token!r}}}\nfound.append(planted['answer'])\n"
    assert reward()(planted, prompt) == 1.0


def test_attacks_on_the_grade_through_reward_workers():
    attacks = [ALWAYS_EQUAL, ALWAYS_EQUAL_OBJECT, PATCH_THE_GRADER, FRAME_WALK, READ_THE_TESTS]
    secret, _ = secret_problem()
    prompts = [problem()] * 4 + [secret, problem()]
    assert score(attacks + [GOOD], prompts, workers=2) == [0.0] * 5 + [1.0]


def test_solution_output_is_kept_when_its_tests_fail():
    result = run_python("print('from the solution')\n" + WRONG, TESTS)
    assert not result.passed and result.status == "failed"
    assert "from the solution" in result.output and "AssertionError" in result.tests_output


# --- stdin/stdout tasks --------------------------------------------------------------------------------

DOUBLE = "n = int(input())\nprint(n * 2)\n"


def test_stdin_stdout_cases_compare_the_output_text_in_the_grader():
    cases = [("3\n", "6\n"), ("5", "10")]
    assert run_python(DOUBLE, cases).passed
    assert run_python("import sys\nprint(int(sys.stdin.buffer.read()) * 2)\nsys.exit(0)\n", cases).passed
    assert not run_python("n = int(input())\nprint(n * 3)\n", cases).passed
    assert not run_python("n = int(input())\nprint(n * 2)\nraise SystemExit(1)\n", cases).passed
    # an output that is not text, or a program that patches its own print, fools nobody
    assert not run_python("import builtins\nbuiltins.print = lambda *a: None\n", cases).passed


@pytest.mark.parametrize(
    "tests",
    [
        {"inputs": ["3\n", "5\n"], "outputs": ["6\n", "10\n"]},
        '{"inputs": ["3\\n"], "outputs": ["6"]}',  # APPS's input_output column, as text
        [{"input": "4", "output": "8\n"}],
    ],
)
def test_code_execution_reads_stdin_stdout_cases(tests):
    prompt = Prompt("Double it.", meta={"io": tests})
    assert reward(tests_key="io")(DOUBLE, prompt) == 1.0
    assert reward(tests_key="io")(DOUBLE.replace("2", "3"), prompt) == 0.0


def test_stdin_stdout_cases_must_be_text():
    with pytest.raises(ValueError, match="stdin/stdout cases must be non-empty and text"):
        reward(tests_key="io").tests(Prompt("p", meta={"io": {"inputs": [[1, 2]], "outputs": [3]}}))
