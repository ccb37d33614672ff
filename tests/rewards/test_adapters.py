"""TRLReward and VerlReward: a user's existing function, named by import path, called in its own shape."""

import json
import logging
import math
from pathlib import Path

import pytest
import reward_fixtures

from rlkit.cli import build_cli, main
from rlkit.data.prompts import Prompt, PromptFile
from rlkit.rewards import RewardError, RewardScorer, TRLReward, VerlReward

FIXTURES = Path(reward_fixtures.__file__)
EXPERIMENT = Path(__file__).resolve().parents[2] / "experiments" / "grpo.yaml"


# --- TRL's shape -----------------------------------------------------------------------------------


def test_trl_call_shape_plain_text():
    reward_fixtures.trl_echo.calls.clear()
    reward = TRLReward("reward_fixtures.trl_echo")
    assert reward.name == "trl_echo"  # TRL labels a function's curve by its __name__
    prompt = Prompt("2+2=", ground_truth="4", meta={"solution": "4", "level": 3})
    assert reward(" 4", prompt) == 1.0
    # one completion per call, every column as a one-element list, as TRL passes a batch of one
    expected = {"prompts": ["2+2="], "completions": [" 4"], "solution": ["4"], "level": [3]}
    assert reward_fixtures.trl_echo.calls == [expected]


def test_trl_call_shape_chat():
    reward_fixtures.trl_echo.calls.clear()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    TRLReward("reward_fixtures:trl_echo")("4", Prompt(messages, meta={}))
    # conversational data: completions are message lists, as TRL's GRPOTrainer builds them
    assert reward_fixtures.trl_echo.calls == [
        {"prompts": [messages], "completions": [[{"role": "assistant", "content": "4"}]]}
    ]


def test_trl_solution_column_from_a_prompt_file(tmp_path):
    path = tmp_path / "p.jsonl"
    rows = [{"prompt": "2+2=", "solution": "4"}, {"prompt": "3+3=", "solution": "6"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts = PromptFile(str(path), answer_key="solution")
    total, _ = RewardScorer([TRLReward("reward_fixtures.trl_accuracy")]).score(["4", "7"], list(prompts), [1, 1])
    assert total.tolist() == [1.0, 0.0]


def test_trl_none_means_not_applicable():
    prompts = [Prompt("p", meta={"language": lang}) for lang in ("python", "rust", "python")]
    total, parts = RewardScorer([TRLReward("reward_fixtures.trl_python_only")]).score(
        ["print(1)", "fn main() {}", "x"], prompts, [1, 1, 1]
    )
    values = parts["trl_python_only"].tolist()
    assert values[0] == 1.0 and math.isnan(values[1]) and values[2] == 0.0
    assert total.tolist() == [1.0, 0.0, 0.0]


def test_trl_function_without_kwargs_gets_only_its_columns():
    reward = TRLReward("reward_fixtures.trl_no_kwargs")
    assert reward("4", Prompt("p", meta={"solution": "4", "unrelated": 1})) == 1.0


def test_trl_errors_at_call_time():
    scorer = RewardScorer([TRLReward("reward_fixtures.trl_accuracy")])
    with pytest.raises(RewardError, match=r"needs \['solution'\], which the prompt's row does not provide"):
        scorer.score(["4"], [Prompt("p", meta={"answer": "4"})], [1])
    with pytest.raises(RewardError, match=r"returned float 1.0 for one completion; a TRL reward function returns"):
        RewardScorer([TRLReward("reward_fixtures.trl_scalar")]).score(["4"], [Prompt("p")], [1])


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_such_module.fn", r"cannot import 'no_such_module' \(from 'no_such_module.fn'\): No module named"),
        ("reward_fixtures.nope", r"module 'reward_fixtures' has no attribute 'nope' .* its functions are \["),
        ("reward_fixtures.NOT_CALLABLE", r"'reward_fixtures.NOT_CALLABLE' is a int, not a function"),
        ("reward_fixtures.Scripted", r"is a ABCMeta, not a function"),
        ("accuracy", r"'accuracy' is not an import path. Write 'package.module.function'"),
        ("missing/file.py:fn", r"file 'missing/file.py' not found"),
        ("reward_fixtures.not_a_reward", r"does not take these reward arguments: TRL calls .* no `completions`"),
        ("reward_fixtures.compute_score", r"does not take these reward arguments: .* use VerlReward"),
    ],
)
def test_trl_construction_errors(spec, message):
    with pytest.raises(ValueError, match=r"TRLReward: .*" + message):
        TRLReward(spec)


# --- verl's shape ----------------------------------------------------------------------------------


def verl_prompt(split="train"):
    return Prompt(
        [{"role": "user", "content": "2+2?"}],
        ground_truth="4",
        meta={"data_source": "openai/gsm8k", "extra_info": {"split": split}, "reward_model": {"ground_truth": "4"}},
    )


def test_verl_float_and_columns():
    reward = VerlReward("reward_fixtures.compute_score")
    assert reward.name == "compute_score"
    assert reward(" 4", verl_prompt("train")) == 1.5  # data_source, ground_truth and extra_info all arrived
    assert reward("4", verl_prompt("test")) == 1.0
    assert reward("5", verl_prompt("test")) == 0.0


def test_verl_dict_and_missing_extra_info():
    assert VerlReward("reward_fixtures.compute_score_dict", name="acc")("5", verl_prompt()) == -1.0
    assert VerlReward("reward_fixtures.compute_score_without_extra_info")("4", verl_prompt()) == 1.0
    with pytest.raises(RewardError, match=r"returned a dict without 'score' \(keys \['acc'\]\)"):
        RewardScorer([VerlReward("reward_fixtures.compute_score_bad_dict")]).score(["4"], [verl_prompt()], [1])


def test_verl_construction_errors():
    with pytest.raises(ValueError, match=r"VerlReward: .* verl calls .* no `solution_str` parameter .* use TRLReward"):
        VerlReward("reward_fixtures.trl_no_kwargs")


def test_a_file_path_names_a_function():
    reward = VerlReward(f"{FIXTURES}:compute_score")
    assert reward("4", verl_prompt("test")) == 1.0


@pytest.mark.parametrize("spec", ["reward_fixtures.compute_score", f"{FIXTURES}:compute_score"])
def test_adapters_run_in_worker_processes(spec):
    # the worker imports the function from its path itself: the adapter pickles as the path
    scorer = RewardScorer([VerlReward(spec), TRLReward("reward_fixtures.trl_no_kwargs")], workers=1)
    prompt = verl_prompt("test")
    prompt.meta["solution"] = "4"
    try:
        total, parts = scorer.score(["4", "5"], [prompt] * 2, [1, 1])
    finally:
        scorer.close()
    assert parts["compute_score"].tolist() == [1.0, 0.0]
    assert parts["trl_no_kwargs"].tolist() == [1.0, 0.0]
    assert total.tolist() == [2.0, 0.0]


# --- from the command line -------------------------------------------------------------------------


def test_rewards_by_import_path_on_the_command_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    flag = "--data.rewards=[{class_path: TRLReward, init_args: {function: reward_fixtures.trl_accuracy}}]"
    cli = build_cli([f"--config={EXPERIMENT}", flag], run=False)
    (reward,) = cli.datamodule.scorer.functions
    assert isinstance(reward, TRLReward) and reward.function == "reward_fixtures.trl_accuracy"


def test_a_wrong_import_path_is_a_one_line_config_error(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(logging, "raiseExceptions", False)
    flag = "--data.rewards=[{class_path: VerlReward, init_args: {function: my_rewards.compute_score}}]"
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", f"--config={EXPERIMENT}", flag])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert "VerlReward: cannot import 'my_rewards'" in err and "PYTHONPATH" in err
    assert "Traceback" not in err
