"""RewardScorer: the weighted total, "does not apply", per-call time limits in this process and in worker
processes, and the two error policies."""

import math
import threading

import pytest
import torch
from jsonargparse import ArgumentParser
from reward_fixtures import Scripted, q

from rlkit.rewards import (
    ExactAnswer,
    FormatReward,
    MathAnswer,
    OverlongPenalty,
    RewardError,
    RewardFunction,
    RewardScorer,
)


def score(scorer, completions, lengths=None):
    return scorer.score(completions, [q("4")] * len(completions), lengths or [1] * len(completions))


def three_rewards():
    return [ExactAnswer(), FormatReward("<a>.*</a>"), OverlongPenalty(max_length=20, buffer=4)]


@pytest.mark.parametrize("workers", [0, 2])
def test_weighted_total(scorers, workers):
    scorer = scorers(three_rewards(), weights=[1.0, 0.5, 2.0], workers=workers)
    total, parts = score(scorer, ["<a>4</a>", "4", "<a>5</a>"], lengths=[10, 18, 25])
    # accuracy [0, 1, 0]; format [1, 0, 1]; overlong (free up to 16) [0, (16-18)/4, -1] = [0, -0.5, -1]
    # total = 1*accuracy + 0.5*format + 2*overlong = [0.5, 1 - 1, 0.5 - 2] = [0.5, 0, -1.5]
    assert list(parts) == ["accuracy", "format", "overlong"]
    assert parts["accuracy"].tolist() == [0.0, 1.0, 0.0]
    assert parts["format"].tolist() == [1.0, 0.0, 1.0]
    assert parts["overlong"].tolist() == [0.0, -0.5, -1.0]
    assert total.tolist() == [0.5, 0.0, -1.5]
    assert total.dtype == torch.float32 and total.shape == (3,)
    assert all(p.dtype == torch.float32 and p.shape == (3,) for p in parts.values())
    # many more calls than workers x chunks: every result lands on its own row
    total, _ = score(scorer, ["4", "5"] * 40, lengths=[17] * 80)
    assert total.tolist() == [1.0 - 0.5, -0.5] * 40


@pytest.mark.parametrize("workers", [0, 1])
def test_default_weights_and_empty_batch(scorers, workers):
    total, _ = score(scorers(three_rewards(), workers=workers), ["<a>4</a>"], lengths=[17])
    assert total.tolist() == [0.0 + 1.0 - 0.25]
    total, parts = scorers(three_rewards(), workers=workers).score([], [], [])
    assert total.shape == (0,) and all(p.shape == (0,) for p in parts.values())


@pytest.mark.parametrize("workers", [0, 1])
def test_none_means_does_not_apply(scorers, workers):
    scorer = scorers([Scripted("a"), Scripted("b")], weights=[1.0, 2.0], workers=workers)
    total, parts = score(scorer, ["none", "ok"])
    assert math.isnan(parts["a"][0]) and parts["a"][1] == 1.0  # NaN, so its mean skips the row
    assert total.tolist() == [0.0, 3.0]  # and it adds 0 to the total
    assert scorer.errors == 0


class Recorder(RewardFunction):
    """Returns the given values in turn."""

    def __init__(self, values, name="recorder"):
        self.values, self.name = list(values), name

    def __call__(self, completion, prompt):
        return self.values.pop(0)


def test_accepts_bools_ints_and_one_element_tensors(scorers):
    first, second = Recorder([True, 2, torch.tensor(0.25)], "a"), Recorder([0, 1.5, torch.tensor([3.0])], "b")
    total, parts = score(scorers([first, second]), ["x", "y", "z"])
    assert parts["a"].tolist() == [1.0, 2.0, 0.25] and parts["b"].tolist() == [0.0, 1.5, 3.0]
    assert total.tolist() == [1.0, 3.5, 3.25]


def test_construction_errors():
    with pytest.raises(ValueError, match=r"names must be distinct .* \['accuracy'\] occur more than once"):
        RewardScorer([ExactAnswer(), MathAnswer(name="accuracy")])
    with pytest.raises(ValueError, match=r"2 weights for 3 functions \['accuracy', 'format', 'overlong'\]"):
        RewardScorer(three_rewards(), weights=[1.0, 2.0])
    with pytest.raises(ValueError, match="weights must be finite"):
        RewardScorer([ExactAnswer()], weights=[math.nan])
    with pytest.raises(ValueError, match="at least one reward function"):
        RewardScorer([])
    with pytest.raises(ValueError, match="is not a RewardFunction; subclass .* or point TRLReward or VerlReward"):
        RewardScorer([lambda c, p: 1.0])
    with pytest.raises(ValueError, match="timeout_s must be positive, got 0"):
        RewardScorer([ExactAnswer()], timeout_s=0)
    with pytest.raises(ValueError, match="names must be non-empty strings"):
        RewardScorer([ExactAnswer(name="")])
    with pytest.raises(ValueError, match=r"workers must be >= 0 \(0 scores in this process\), got -1"):
        RewardScorer([ExactAnswer()], workers=-1)
    with pytest.raises(ValueError, match="on_error must be 'raise' or 'zero', got 'skip'"):
        RewardScorer([ExactAnswer()], on_error="skip")
    with pytest.raises(ValueError, match="2 completions, 1 prompts and 2 lengths"):
        RewardScorer([ExactAnswer()]).score(["a", "b"], [q("a")], [1, 1])


def test_functions_that_cannot_reach_workers_are_refused_at_construction():
    local = type("Local", (Recorder,), {})([1.0])  # a class made inside a function does not pickle
    with pytest.raises(ValueError, match=r"workers=2\): the reward functions cannot be sent to worker processes"):
        RewardScorer([local], workers=2)
    RewardScorer([local], workers=0)  # in this process it is fine


@pytest.mark.parametrize("workers", [0, 1])
def test_raise_policy_names_the_function_prompt_and_completion(scorers, workers):
    long_completion = "raise"
    with pytest.raises(RewardError) as caught:
        score(scorers([ExactAnswer(), Scripted("fragile")], workers=workers), ["ok", long_completion])
    message = str(caught.value)
    assert "reward function 'fragile' (Scripted) raised KeyError: 'boom' on row 1 of the batch" in message
    assert "prompt 'what is it?', completion 'raise'" in message
    assert "Fix the function, or wrap it" in message and "data.reward_on_error=zero" in message


def test_completions_in_messages_are_shortened(scorers):
    class Failing(RewardFunction):
        name = "fragile"

        def __call__(self, completion, prompt):
            raise ValueError("no")

    with pytest.raises(RewardError, match=r"completion 'bad xxx[x]*\.\.\.'\)") as caught:
        score(scorers([Failing()]), ["bad " + "x" * 200])
    assert "x" * 100 not in str(caught.value)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("yes", r"returned str 'yes', which is not a number on row 0"),
        (torch.tensor([1.0, 2.0]), r"returned Tensor tensor\(\[1\., 2\.\]\), which is not a number"),
        (math.nan, r"returned nan, which is not a finite number on row 0"),
        (-math.inf, r"returned -inf, which is not a finite number on row 0"),
    ],
)
def test_non_numbers_and_non_finite_values(scorers, value, message):
    with pytest.raises(RewardError, match=r"reward function 'recorder' \(Recorder\) " + message + r".*Return a finite"):
        score(scorers([Recorder([value])]), ["x"])


@pytest.mark.parametrize("completion", ["hang", "sleep", "swallow"])
def test_a_hung_call_in_this_process_is_interrupted(scorers, completion):
    # a pure-Python loop, a sleep, and a loop inside `except Exception` are all stopped by the time limit
    expected = rf"'slow' \(Scripted\) took longer than timeout_s=0.2 s on row 1 .*'{completion}'"
    with pytest.raises(RewardError, match=expected):
        score(scorers([Scripted("slow")], timeout_s=0.2), ["fine", completion, "never"])
    scorer = scorers([Scripted("slow")], timeout_s=0.2, on_error="zero")
    total, _ = score(scorer, ["fine", completion, "fine"])
    assert total.tolist() == [1.0, 0.0, 1.0] and scorer.errors == 1


def test_a_hung_call_in_a_worker_kills_that_worker(scorers):
    scorer = scorers([Scripted("slow")], timeout_s=0.5, workers=1, on_error="zero")
    (before,), _ = score(scorer, ["pid"])
    total, _ = score(scorer, ["ok", "hang", "ok", "ok"])
    assert total.tolist() == [1.0, 0.0, 1.0, 1.0] and scorer.errors == 1
    (after,), _ = score(scorer, ["pid"])
    assert after != before  # the worker stuck in the loop was killed and replaced
    assert scorer.errors == 0  # the count is per score() call


def test_a_worker_that_dies_is_replaced(scorers):
    with pytest.raises(RewardError, match=r"'crash' \(Scripted\) ended its worker process \(exit code 3\) on row 0"):
        score(scorers([Scripted("crash")], workers=1), ["exit", "ok"])
    scorer = scorers([Scripted("crash")], workers=2, on_error="zero")
    total, _ = score(scorer, ["ok", "exit", "ok", "exit", "ok"])
    assert total.tolist() == [1.0, 0.0, 1.0, 0.0, 1.0] and scorer.errors == 2


def test_the_pool_restarts_after_an_error_stopped_it(scorers):
    scorer = scorers([Scripted()], timeout_s=0.5, workers=2)
    with pytest.raises(RewardError, match="took longer than timeout_s=0.5 s"):
        score(scorer, ["ok", "hang", "ok"])
    total, _ = score(scorer, ["ok", "ok", "ok"])
    assert total.tolist() == [1.0, 1.0, 1.0]


def test_timeout_is_per_call_not_per_batch(scorers):
    class Slowish(RewardFunction):
        name = "slowish"

        def __call__(self, completion, prompt):
            import time

            time.sleep(0.02)
            return 1.0

    # 20 calls of 0.02 s = 0.4 s in all, above timeout_s = 0.15 s, but each call stays below it
    total, _ = score(scorers([Slowish()], timeout_s=0.15), ["x"] * 20)
    assert total.tolist() == [1.0] * 20


def test_in_process_scoring_needs_the_main_thread_and_workers_do_not(scorers):
    outcome = {}

    def run(scorer, key):
        try:
            outcome[key] = score(scorer, ["ok"])[0].tolist()
        except RewardError as e:
            outcome[key] = str(e)

    for workers in (0, 1):
        thread = threading.Thread(target=run, args=(scorers([Scripted()], workers=workers), workers))
        thread.start()
        thread.join(60)
    assert "SIGALRM, which Python delivers only on the main thread" in outcome[0]
    assert "set workers >= 1 (data.reward_workers)" in outcome[0]
    assert outcome[1] == [1.0]


def test_signatures_are_the_config_schema():
    parser = ArgumentParser()
    parser.add_class_arguments(RewardScorer, "scorer")
    config = parser.parse_object(
        {
            "scorer": {
                "functions": [
                    {"class_path": "MathAnswer", "init_args": {"verifier": "builtin", "use_sympy": False}},
                    {"class_path": "rlkit.rewards.FormatReward", "init_args": {"pattern": "<a>.*</a>"}},
                    {"class_path": "OverlongPenalty", "init_args": {"max_length": 20, "buffer": 4}},
                    {"class_path": "TRLReward", "init_args": {"function": "reward_fixtures.trl_accuracy"}},
                ],
                "weights": [1.0, 0.5, 1.0, 1.0],
                "workers": 0,
                "on_error": "zero",
            }
        }
    )
    scorer = parser.instantiate(config).scorer
    assert scorer.names == ["math", "format", "overlong", "trl_accuracy"]
    assert scorer.functions[0].verifier == "builtin" and scorer.functions[2].buffer == 4
    assert scorer.on_error == "zero"
