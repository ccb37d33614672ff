"""MathAnswer against what a policy can write: every answer is bounded (length, nesting, digits, powers,
expansions) before any parser or sympy reads it, so no completion reaches the scorer's time limit."""

import pickle

import pytest
from reward_fixtures import q

from rlkit.rewards import AnswerBounds, MathAnswer, Rejected, RewardScorer

# Each of these ran into the 10 s limit (or raised, or stalled in C) before the bounds, with one verifier or both.
# The built-in verifier reads only the last box, "####" or number: it never reads the three marked "text".
ADVERSARIAL = [
    "\\boxed{" + "{" * 20_000 + "1" + "}" * 20_000 + "}",  # nesting
    "\\boxed{" + "(" * 50 + "1" + ")" * 50 + "}",
    "\\boxed{" + "\\frac{1}{" * 20 + "2" + "}" * 20 + "}",
    "\\boxed{" * 20_000,  # 20,000 unclosed boxes (text)
    "\\boxed{9^{9^{9^{9}}}}",  # exponent towers, however spelled
    "\\boxed{9^{{9}^{9}}}",
    "\\boxed{9^{\\frac{9^9}{1}}}",
    "\\boxed{x^{9^{9}}}",
    "\\boxed{9^{9\\cdot 9\\cdot 9\\cdot 9\\cdot 9\\cdot 9\\cdot 9\\cdot 9\\cdot 9}}",
    "the answer is $9^9^9^9$",  # (text)
    "\\boxed{9!!!}",
    "\\boxed{" + "9" * 100_000 + "}",  # huge numbers
    "the answer is " + "7" * 100_000,
    "\\boxed{1e100000}",
    "\\boxed{(x+1)^{999}}",  # expansions
    "\\boxed{(x+y+z)^{50}}",
    "$" + "".join(f"(x+{i})" for i in range(20)) + "$",  # (text)
    "\\boxed{" + "\\cup".join(f"({a},{b})" for a, b in zip("abcdefgh", "ijklmnop", strict=True)) + "}",
    "\\boxed{" + "+".join(f"x_{{{i}}}" for i in range(60)) + "}",
]


@pytest.mark.parametrize(("verifier", "unread"), [("builtin", len(ADVERSARIAL) - 3), ("math-verify", len(ADVERSARIAL))])
def test_adversarial_completions_are_scored_zero_unread_under_the_default_settings(verifier, unread):
    # default settings: 10 s per call, on_error="raise" (a call that overran would stop the test with a
    # RewardError); one worker, so that a regression fails instead of hanging in C
    scorer = RewardScorer([MathAnswer(verifier=verifier)], workers=1)
    try:
        completions = [*ADVERSARIAL, "so \\boxed{42}"]
        scored = scorer.score_batch(completions, [q("42")] * len(completions), [1] * len(completions))
    finally:
        scorer.close()
    assert scored.total.tolist() == [0.0] * len(ADVERSARIAL) + [1.0]  # the right answer is still read
    assert scored.errors == 0 and scored.rejected == {"math": unread}
    assert scored.stats() == {"reward/errors": 0.0, "reward/rejected": float(unread)}


@pytest.mark.parametrize("verifier", ["builtin", "math-verify"])
@pytest.mark.parametrize(
    ("completion", "truth"),
    [
        ("so \\boxed{2^{10}}", "1024"),
        ("\\boxed{\\frac{3\\sqrt{2}+\\sqrt{6}}{4}}", "\\frac{3\\sqrt{2}+\\sqrt{6}}{4}"),
        ("\\boxed{\\left( -\\frac{1}{3}, \\frac{22}{3} \\right)}", "\\left(-\\frac{1}{3},\\frac{22}{3}\\right)"),
        ("\\boxed{" + "9" * 450 + "}", "9" * 450),  # 450 digits: within max_chars and max_digits
        ("Adding, 12 + 35 = 47 and 47 + 25 = 72. " * 40 + "#### 72", "72"),  # long text, GSM8K's answer
    ],
)
def test_answers_within_the_bounds_are_read_as_before(verifier, completion, truth):
    score = MathAnswer(verifier=verifier)(completion, q(truth))
    assert score == 1.0 and not isinstance(score, Rejected)


def test_an_answer_that_evaluates_to_infinity_equals_nothing():
    # 1e400 is inf as a float: |inf - 42| <= rel_tol * inf held, so any huge number "equalled" any answer
    assert MathAnswer(verifier="builtin", use_sympy=True)("\\boxed{1e400}", q("42")) == 0.0


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("9^{9^{9}}", "a power of about 10^8 digits, more than 1000"),
        ("2**2**2**2**2**2", "a power of 19,728 digits, more than 1000"),
        ("100000!", "a factorial of 456,573 digits, more than 1000"),
        ("\\binom{100000}{50000}", "a binomial coefficient of 30,103 digits, more than 1000"),
        ("9" * 1001, "1001 characters, more than 500"),
        ("1e1001", "a number of 1,001 digits, more than 1000"),
        ("x^{101}", "a power of a symbol with an exponent up to 101, above 100"),
        ("\\sum_{i=1}^{1000000000} i", "a power of a symbol with an exponent up to about 10^9, above 100"),
        ("(x+y+z)^{9}", "an expansion into more than 50 terms"),
        ("(" * 7 + "1" + ")" * 7, "nesting deeper than 6"),
        ("\\sqrt" * 30 + "2", "nesting deeper than 6"),  # commands without braces nest too
        ("\\{" + ",".join("abcdefghijklmnopq") + "\\}", "more than 16 items in one list or sum"),
    ],
)
def test_bounds_name_what_is_out_of_them(text, reason):
    assert AnswerBounds().violation(text) == reason


def test_bounds_let_ordinary_answers_through_and_read_prose_fragment_by_fragment():
    bounds = AnswerBounds()
    for answer in ("2^{1000}", "e^{-x^2/2}", "(x+y+z)^{8}", "\\sum_{k=1}^{n} k^2", "1^{10^{100}}", "450", "10!"):
        assert bounds.violation(answer) is None, answer
    prose = "Adding 12 and 35 gives 47, then 47 + 3 = 50, so 50 * 2 = 100. " * 7
    assert bounds.violation(prose, prose=True) is None  # many numbers, but in separate sentences
    assert bounds.violation(prose) == "more than 16 items in one list or sum"  # read as one answer
    listed = "so the set is $" + ",".join("abcdefghijklmnopq") + "$."
    assert bounds.violation(listed, prose=True) == "more than 16 items in one list or sum"  # $...$ is one answer
    with pytest.raises(ValueError, match="AnswerBounds: max_depth must be >= 1, got 0"):
        AnswerBounds(max_depth=0)


def test_a_ground_truth_beyond_the_bounds_is_named():
    reward = MathAnswer(verifier="builtin")
    assert reward.check_ground_truth("\\frac{1}{2}") is None
    assert reward.check_ground_truth("The answer is \\boxed{72}.") is None  # reduced to its box first
    assert reward.check_ground_truth("9^{9^{9^{9}}}") == (
        "MathAnswer cannot read the ground truth '9^{9^{9^{9}}}': a power of about 10^8 digits, more than 1000 "
        "(MathAnswer's bounds; raise them with init_args: {bounds: {...}} if such answers are meant)"
    )
    wider = MathAnswer(verifier="builtin", bounds=AnswerBounds(max_digits=5000))
    assert wider.check_ground_truth("2^{10000}") is None and wider("\\boxed{2^{10000}}", q("2^{10000}")) == 1.0


def test_a_rejected_score_is_zero_with_its_reason_and_survives_pickling():
    score = MathAnswer(verifier="builtin")("\\boxed{9^{9^{9}}}", q("1"))
    assert isinstance(score, Rejected) and score == 0.0 and score.reason.startswith("a power of about 10^8")
    copy = pickle.loads(pickle.dumps(score))
    assert isinstance(copy, Rejected) and copy.reason == score.reason
