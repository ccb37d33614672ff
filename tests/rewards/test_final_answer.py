"""FinalAnswer: the integer after the completion's last '=', with nothing after it."""

import pytest

from rlkit.data.prompts import Prompt
from rlkit.rewards import FinalAnswer

PROMPT = Prompt(prompt="3+5+7=", ground_truth="15")


@pytest.mark.parametrize(
    "completion, reward",
    [
        ("3+5=8,8+7=15", 1.0),
        ("3+5=8,8+7=15 ", 1.0),  # trailing whitespace is allowed
        ("3+5=9,9+7=15", 1.0),  # intermediate steps are not checked
        ("=15", 1.0),
        ("3+5=8,8+7=015", 1.0),  # compared as integers
        ("3+5=8,8+7=16", 0.0),
        ("3+5=8,8+7=15,15+", 0.0),  # runs on after the result
        ("3+5=8,8+7", 0.0),  # cut off before the result
        ("15", 0.0),  # no '='
        ("3+5=8,8+7=15x", 0.0),
        ("3+5=8,8+7=1 5", 0.0),
        ("", 0.0),
    ],
)
def test_final_answer(completion, reward):
    assert FinalAnswer()(completion, PROMPT) == reward


def test_final_answer_needs_a_ground_truth_and_reads_negative_numbers():
    with pytest.raises(ValueError, match="ground truth"):
        FinalAnswer()("=3", Prompt(prompt="1+2="))
    assert FinalAnswer()("2-7=-5", Prompt(prompt="2-7=", ground_truth="-5")) == 1.0
    assert FinalAnswer()("=5", Prompt(prompt="?", ground_truth="five")) == 0.0
    assert FinalAnswer(name="result").name == "result"
