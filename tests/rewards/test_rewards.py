"""Reward functions with hand-worked examples, and RewardScorer's arithmetic and error paths."""

import threading
import time

import pytest
from reward_fixtures import q

import rlkit.rewards.math as math_rewards
from rlkit.rewards import (
    ExactAnswer,
    FormatReward,
    LengthAwareReward,
    MathAnswer,
    OverlongPenalty,
    extract_answer,
    normalize_answer,
)

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
def test_math_answer_builtin(completion, truth, plain, symbolic, use_sympy):
    reward = MathAnswer(verifier="builtin", use_sympy=use_sympy)
    assert reward.name == "math"
    assert reward(completion, q(truth)) == (symbolic if use_sympy else plain)


def test_math_answer_tolerance():
    # |0.3333333333 - 1/3| / (1/3) = 1e-10 <= 1e-9; with rel_tol=0 only exact values are equal
    builtin = {"verifier": "builtin", "use_sympy": False}
    assert MathAnswer(**builtin)("\\boxed{0.3333333333}", q("\\frac{1}{3}")) == 1.0
    assert MathAnswer(**builtin, rel_tol=0.0)("\\boxed{0.3333333333}", q("\\frac{1}{3}")) == 0.0
    # integers below 1e9 stay exact: |1000001 - 1000000| / 1000001 = 1e-6 > 1e-9
    assert MathAnswer(**builtin)("1000001", q("1000000")) == 0.0


def test_math_answer_rejects_unsafe_or_unreadable_input_without_evaluating_it():
    reward = MathAnswer(verifier="builtin", use_sympy=True)
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


@pytest.mark.parametrize(
    ("completion", "truth", "score"),
    [
        ("Natalia sold 48/2 = 24 clips.\n#### 72", "72", 1.0),  # GSM8K style
        ("The total is $1,000.", "1000", 1.0),
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\dfrac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", 1.0),
        ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
        ("\\boxed{\\{1, 2\\}}", "\\{1,2\\}", 1.0),  # sets, which the built-in verifier compares as text
        ("\\boxed{\\left(3, \\frac{\\pi}{2}\\right)}", "(3,\\frac{\\pi}{2})", 1.0),
        ("The answer is $\\frac{3}{4}$.", "\\boxed{0.75}", 1.0),  # the ground truth's box is read first
        ("\\boxed{0.333}", "\\frac{1}{3}", 0.0),
        ("\\boxed{x^2+2x+2}", "(x+1)^2", 0.0),
        ("no answer here", "4", 0.0),
    ],
)
def test_math_answer_math_verify(completion, truth, score):
    reward = MathAnswer(verifier="math-verify")
    assert reward.verifier == "math-verify"
    assert reward(completion, q(truth)) == score


def test_math_verify_runs_off_the_main_thread():
    # math-verify's own time limits call signal.alarm, which raises ValueError off the main thread;
    # MathAnswer turns them off (the scorer times each call instead)
    results = []
    worker = threading.Thread(target=lambda: results.append(MathAnswer(verifier="math-verify")("\\boxed{2}", q("2"))))
    worker.start()
    worker.join(60)
    assert results == [1.0]


def test_math_verify_never_expands_exponent_towers():
    reward = MathAnswer(verifier="math-verify")
    # sympy would try to compute 9^(9^9) (hours); such completions go to the built-in verifier, which refuses it
    assert reward("\\boxed{9^{9^{9}}}", q("1")) == 0.0
    assert reward("so \\boxed{2^{10}}", q("1024")) == 1.0  # a small power is still read


def test_math_answer_verifier_choice(monkeypatch):
    assert MathAnswer().verifier == "math-verify"  # installed (the dev extra has it)
    with pytest.raises(ValueError, match="verifier must be 'auto', 'math-verify' or 'builtin', got 'sympy'"):
        MathAnswer(verifier="sympy")
    monkeypatch.setattr(math_rewards.importlib.util, "find_spec", lambda name: None)
    assert MathAnswer().verifier == "builtin"  # the fallback
    with pytest.raises(ValueError, match=r"needs the math-verify package: `pip install rlkit\[math\]`"):
        MathAnswer(verifier="math-verify")


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
