"""Reward functions with hand-worked examples, and RewardScorer's arithmetic and error paths."""

import math
import threading
import time

import pytest
import torch
from jsonargparse import ArgumentParser

import rlkit.rewards.math as math_rewards
from rlkit.data.prompts import Prompt
from rlkit.rewards import (
    ExactAnswer,
    FormatReward,
    LengthAwareReward,
    MathAnswer,
    OverlongPenalty,
    RewardError,
    RewardFunction,
    RewardScorer,
    extract_answer,
    normalize_answer,
)


def q(ground_truth=None):
    return Prompt(prompt="what is it?", ground_truth=ground_truth)


# --- ExactAnswer -----------------------------------------------------------------------------------


def test_exact_answer():
    reward = ExactAnswer()
    assert reward.name == "accuracy"
    assert reward(" 42\n", q("42 ")) == 1.0  # whitespace around either side is stripped
    assert reward("42.", q("42")) == 0.0  # nothing else is normalised
    assert reward("The answer is 42", q("42")) == 0.0  # and nothing is extracted
    with pytest.raises(ValueError, match="ExactAnswer needs a ground truth.*answer_key"):
        reward("42", q(None))


# --- MathAnswer ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("so \\boxed{\\frac{1}{\\sqrt{2}}} is it", "\\frac{1}{\\sqrt{2}}"),  # nested braces
        ("first \\boxed{1}, then \\boxed{2}", "2"),  # the last box
        ("\\boxed{3} and then \\boxed{\\frac{1}{2", "3"),  # the last *complete* box (truncated text)
        ("\\fbox{7}", "7"),
        ("Natalia sold 48/2 = 24 clips.\n#### 72\nDone", "72"),  # GSM8K: the line after ####
        ("#### $1,000.", "$1,000."),  # extraction keeps the text; normalisation cleans it
        ("she has 3 apples and 1,250.5 pears.", "1,250.5"),  # the last number, thousands separator kept
        ("x is -3/4", "-3/4"),
        ("no digits at all", None),
    ],
)
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


@pytest.mark.parametrize(
    ("raw", "normal"),
    [
        ("  $1,000.$ ", "1000"),
        ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})"),
        ("\\dfrac{1}{2}", "\\frac{1}{2}"),
        ("\\tfrac12", "\\frac{1}{2}"),
        ("\\sqrt2", "\\sqrt{2}"),
        ("90^\\circ", "90"),
        ("10\\%", "10"),
        ("x = 5", "5"),
        ("y=x+1=3", "y=x+1=3"),  # two '=' are kept
        ("\\text{(A)}", "(A)"),
        ("1,2,3", "1,2,3"),  # a list, not a thousands separator
        ("\\rightarrow", "\\rightarrow"),  # \right only as its own command
    ],
)
def test_normalize_answer(raw, normal):
    assert normalize_answer(raw) == normal


@pytest.mark.parametrize("use_sympy", [False, True])
@pytest.mark.parametrize(
    ("completion", "truth", "plain", "symbolic"),
    [
        ("#### 72", "72", 1.0, 1.0),
        ("The total is $1,000.", "1000", 1.0, 1.0),  # last number, commas and trailing '.' removed
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0, 1.0),  # exact numbers: 1/2 = 0.5
        ("\\boxed{\\frac{2}{4}}", "1/2", 1.0, 1.0),
        ("\\boxed{-\\frac{3}{4}}", "-0.75", 1.0, 1.0),
        ("\\boxed{3}", "4", 0.0, 0.0),
        ("\\boxed{0.333}", "\\frac{1}{3}", 0.0, 0.0),  # 0.333 != 1/3: the tolerance is 1e-9 relative
        ("\\boxed{\\dfrac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", 0.0, 1.0),  # sqrt(2)/2 = 1/sqrt(2)
        ("\\boxed{x^2+2x+1}", "(x+1)^2", 0.0, 1.0),
        ("\\boxed{2\\pi}", "\\pi \\cdot 2", 0.0, 1.0),
        ("\\boxed{x^2+2x+2}", "(x+1)^2", 0.0, 0.0),
        ("\\boxed{\\left(3, \\frac{\\pi}{2}\\right)}", "(3,\\frac{\\pi}{2})", 1.0, 1.0),  # as strings
        ("no answer here", "4", 0.0, 0.0),
        ("The answer is \\boxed{5}.", "Natalia ... #### 5", 1.0, 1.0),  # ground truth's #### extracted
    ],
)
def test_math_answer(completion, truth, plain, symbolic, use_sympy):
    reward = MathAnswer(use_sympy=use_sympy)
    assert reward.name == "math"
    assert reward(completion, q(truth)) == (symbolic if use_sympy else plain)


def test_math_answer_tolerance():
    # |0.3333333333 - 1/3| / (1/3) = 1e-10 <= 1e-9; with rel_tol=0 only exact values are equal
    assert MathAnswer(use_sympy=False)("\\boxed{0.3333333333}", q("\\frac{1}{3}")) == 1.0
    assert MathAnswer(use_sympy=False, rel_tol=0.0)("\\boxed{0.3333333333}", q("\\frac{1}{3}")) == 0.0
    # integers below 1e9 stay exact: |1000001 - 1000000| / 1000001 = 1e-6 > 1e-9
    assert MathAnswer(use_sympy=False)("1000001", q("1000000")) == 0.0


def test_math_answer_rejects_unsafe_or_unreadable_input_without_evaluating_it():
    reward = MathAnswer(use_sympy=True)
    start = time.monotonic()
    assert reward("\\boxed{9^{9^{9}}}", q("1")) == 0.0  # the exponent 9^9 > 1000 is never computed
    assert reward("\\boxed{__import__('os').getcwd()}", q("1")) == 0.0  # never reaches the parser
    assert reward("\\boxed{().__class__}", q("1")) == 0.0
    assert reward("\\boxed{\\{1, 2\\}}", q("\\{1,2\\}")) == 1.0  # sets: string comparison only
    assert time.monotonic() - start < 5.0


def test_math_answer_arguments(monkeypatch):
    with pytest.raises(ValueError, match=r"rel_tol must be in \[0, 1\), got -1"):
        MathAnswer(rel_tol=-1.0)
    with pytest.raises(ValueError, match="MathAnswer needs a ground truth"):
        MathAnswer()("\\boxed{1}", q(None))
    assert MathAnswer(use_sympy=None).use_sympy is True  # sympy is installed here
    monkeypatch.setattr(math_rewards.importlib.util, "find_spec", lambda name: None)
    assert MathAnswer(use_sympy=None).use_sympy is False  # without it, None falls back
    with pytest.raises(ValueError, match=r"use_sympy=True\) needs sympy: `pip install rlkit\[math\]`"):
        MathAnswer(use_sympy=True)


# --- FormatReward ----------------------------------------------------------------------------------


def test_format_reward():
    reward = FormatReward(r"<think>.*</think>\s*<answer>.*</answer>")
    assert reward.name == "format"
    assert reward("<think>a\nb</think>\n<answer>4</answer>", q()) == 1.0  # DOTALL: '.' spans lines
    assert reward("<think>a</think><answer>4</answer> extra", q()) == 0.0  # the whole text must match
    assert reward("<answer>4</answer>", q()) == 0.0


def test_format_reward_invalid_regex():
    with pytest.raises(ValueError, match=r"pattern '<think>\(' is not a valid regular expression: missing \)"):
        FormatReward("<think>(")


# --- OverlongPenalty -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("length", "penalty"),
    # L_max = 20, L_cache = 4: free up to 16 tokens, then (16 - |y|) / 4, and -1 beyond 20
    [(1, 0.0), (16, 0.0), (17, -0.25), (18, -0.5), (19, -0.75), (20, -1.0), (21, -1.0), (100, -1.0)],
)
def test_overlong_penalty(length, penalty):
    reward = OverlongPenalty(max_length=20, buffer=4)
    assert isinstance(reward, LengthAwareReward) and reward.name == "overlong"
    assert reward("any text", q(), length=length) == penalty


def test_overlong_penalty_arguments():
    with pytest.raises(ValueError, match=r"buffer must satisfy 1 <= buffer < max_length=20, got 20"):
        OverlongPenalty(max_length=20, buffer=20)
    with pytest.raises(ValueError, match=r"buffer must satisfy 1 <= buffer < max_length=20, got 0"):
        OverlongPenalty(max_length=20, buffer=0)
    with pytest.raises(ValueError, match="max_length must be at least 2"):
        OverlongPenalty(max_length=1, buffer=1)
    with pytest.raises(ValueError, match="needs the completion length in tokens"):
        OverlongPenalty(max_length=20, buffer=4)("text", q())


# --- RewardScorer ----------------------------------------------------------------------------------


def three_rewards():
    return [ExactAnswer(), FormatReward("<a>.*</a>"), OverlongPenalty(max_length=20, buffer=4)]


def test_scorer_weighted_total():
    scorer = RewardScorer(three_rewards(), weights=[1.0, 0.5, 2.0])
    completions = ["<a>4</a>", "4", "<a>5</a>"]
    prompts = [q("4")] * 3
    total, parts = scorer.score(completions, prompts, lengths=[10, 18, 25])
    # accuracy [0, 1, 0]; format [1, 0, 1]; overlong (free up to 16) [0, (16-18)/4, -1] = [0, -0.5, -1]
    # total = 1*accuracy + 0.5*format + 2*overlong = [0.5, 1 - 1, 0.5 - 2] = [0.5, 0, -1.5]
    assert list(parts) == ["accuracy", "format", "overlong"]
    assert parts["accuracy"].tolist() == [0.0, 1.0, 0.0]
    assert parts["format"].tolist() == [1.0, 0.0, 1.0]
    assert parts["overlong"].tolist() == [0.0, -0.5, -1.0]
    assert total.tolist() == [0.5, 0.0, -1.5]
    assert total.dtype == torch.float32 and total.shape == (3,)
    assert all(p.dtype == torch.float32 and p.shape == (3,) for p in parts.values())


def test_scorer_default_weights_and_empty_batch():
    total, parts = RewardScorer(three_rewards()).score(["<a>4</a>"], [q("4")], [17])
    assert total.tolist() == [0.0 + 1.0 - 0.25]
    total, parts = RewardScorer(three_rewards()).score([], [], [])
    assert total.shape == (0,) and all(p.shape == (0,) for p in parts.values())


class Recorder(RewardFunction):
    """Returns a value per call (a bool, an int, a one-element tensor) and records its thread."""

    def __init__(self, values, name="recorder"):
        self.values, self.name, self.threads = list(values), name, set()

    def __call__(self, completion, prompt):
        self.threads.add(threading.get_ident())
        return self.values.pop(0)


def test_scorer_runs_all_calls_on_one_worker_thread_and_accepts_numbers():
    first, second = Recorder([True, 2, torch.tensor(0.25)], "a"), Recorder([0, 1.5, torch.tensor([3.0])], "b")
    total, parts = RewardScorer([first, second]).score(["x", "y", "z"], [q()] * 3, [1, 1, 1])
    assert parts["a"].tolist() == [1.0, 2.0, 0.25] and parts["b"].tolist() == [0.0, 1.5, 3.0]
    assert total.tolist() == [1.0, 3.5, 3.25]
    assert len(first.threads | second.threads) == 1  # one thread per batch, not one per call
    assert threading.get_ident() not in first.threads


def test_scorer_construction_errors():
    with pytest.raises(ValueError, match=r"names must be distinct .* \['accuracy'\] occur more than once"):
        RewardScorer([ExactAnswer(), MathAnswer(name="accuracy")])
    with pytest.raises(ValueError, match=r"2 weights for 3 functions \['accuracy', 'format', 'overlong'\]"):
        RewardScorer(three_rewards(), weights=[1.0, 2.0])
    with pytest.raises(ValueError, match="weights must be finite"):
        RewardScorer([ExactAnswer()], weights=[math.nan])
    with pytest.raises(ValueError, match="at least one reward function"):
        RewardScorer([])
    with pytest.raises(ValueError, match="is not a RewardFunction; subclass rlkit.rewards.RewardFunction"):
        RewardScorer([lambda c, p: 1.0])
    with pytest.raises(ValueError, match="timeout_s must be positive, got 0"):
        RewardScorer([ExactAnswer()], timeout_s=0)
    with pytest.raises(ValueError, match="names must be non-empty strings"):
        RewardScorer([ExactAnswer(name="")])
    with pytest.raises(ValueError, match="2 completions, 1 prompts and 2 lengths"):
        RewardScorer([ExactAnswer()]).score(["a", "b"], [q("a")], [1, 1])


class Failing(RewardFunction):
    name = "fragile"

    def __call__(self, completion, prompt):
        if completion.startswith("bad"):
            raise KeyError("boom")
        return 1.0


def test_scorer_names_a_function_that_raises():
    long_completion = "bad " + "x" * 200
    with pytest.raises(RewardError) as caught:
        RewardScorer([ExactAnswer(), Failing()]).score(["ok", long_completion], [q("ok")] * 2, [1, 1])
    message = str(caught.value)
    assert "reward function 'fragile' (Failing) raised KeyError: 'boom' on row 1 of the batch" in message
    assert "prompt 'what is it?'" in message
    assert "completion 'bad xxx" in message and "x" * 100 not in message  # shortened
    assert "Fix the function, or wrap it" in message
    assert isinstance(caught.value.__cause__, KeyError)  # chained


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("yes", r"returned str 'yes', which is not a number, on row 0"),
        (None, r"returned NoneType None, which is not a number, on row 0"),
        (torch.tensor([1.0, 2.0]), r"returned Tensor tensor\(\[1\., 2\.\]\), which is not a number"),
        (math.nan, r"returned nan, which is not a finite number, on row 0"),
        (-math.inf, r"returned -inf, which is not a finite number, on row 0"),
    ],
)
def test_scorer_rejects_non_numbers_and_non_finite(value, message):
    with pytest.raises(RewardError, match=r"reward function 'recorder' " + message + r".*Return a finite float"):
        RewardScorer([Recorder([value])]).score(["x"], [q()], [1])


class Hanging(RewardFunction):
    name = "slow"

    def __init__(self):
        self.release = threading.Event()

    def __call__(self, completion, prompt):
        if completion == "hang":
            self.release.wait(30)
        return 0.0


def test_scorer_stops_a_hung_function_after_the_timeout():
    hanging = Hanging()
    scorer = RewardScorer([hanging], timeout_s=0.2)
    start = time.monotonic()
    try:
        with pytest.raises(
            RewardError,
            match=r"'slow' took longer than timeout_s=0.2 s on row 1 of the batch .*completion 'hang'.*"
            r"abandoned \(a Python thread cannot be stopped\)",
        ):
            scorer.score(["fine", "hang", "never"], [q()] * 3, [1, 1, 1])
        assert time.monotonic() - start < 10.0  # returned long before the function would have
    finally:
        hanging.release.set()  # let the abandoned daemon thread finish


def test_timeout_is_per_call_not_per_batch():
    class Slowish(RewardFunction):
        name = "slowish"

        def __call__(self, completion, prompt):
            time.sleep(0.02)
            return 1.0

    # 20 calls of 0.02 s = 0.4 s in all, above timeout_s = 0.15 s, but each call stays below it
    total, _ = RewardScorer([Slowish()], timeout_s=0.15).score(["x"] * 20, [q()] * 20, [1] * 20)
    assert total.tolist() == [1.0] * 20


def test_signatures_are_the_config_schema():
    parser = ArgumentParser()
    parser.add_class_arguments(RewardScorer, "scorer")
    config = parser.parse_object(
        {
            "scorer": {
                "functions": [
                    {"class_path": "MathAnswer", "init_args": {"use_sympy": False}},
                    {"class_path": "rlkit.rewards.FormatReward", "init_args": {"pattern": "<a>.*</a>"}},
                    {"class_path": "OverlongPenalty", "init_args": {"max_length": 20, "buffer": 4}},
                ],
                "weights": [1.0, 0.5, 1.0],
            }
        }
    )
    scorer = parser.instantiate(config).scorer
    assert scorer.names == ["math", "format", "overlong"]
    assert scorer.functions[0].use_sympy is False and scorer.functions[2].buffer == 4
