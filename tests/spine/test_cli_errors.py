"""Bad input ends with a short message naming the fix and the right exit code, never a traceback."""

from __future__ import annotations

import json
import logging

import pytest

from rlkit.cli import main
from spine.helpers import short_args

USAGE = 2


def _run(args, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    err = capsys.readouterr().err
    return exit_info.value.code, err


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # In-process runs only: Lightning's log handlers keep the stream of an earlier test's capture,
    # closed by now; logging would print its own "--- Logging error ---" traceback for that.
    monkeypatch.setattr(logging, "raiseExceptions", False)


def _assert_short(err: str) -> None:
    assert "Traceback" not in err, err
    assert len(err.splitlines()) < 30, err


@pytest.mark.parametrize(
    "flag,expected",
    [
        ("--model.advantage=GroupNorn", "GroupNorn"),  # typo in a class name
        ("--trainer.max_step=5", "max_step"),  # typo in a key; no silent abbreviation to max_steps
        ("--data.prompts_per_step=many", "prompts_per_step"),  # wrong type
    ],
)
def test_config_typos_exit_2(flag, expected, tmp_path, capsys):
    code, err = _run(short_args(tmp_path, "drgrpo", flag), capsys)
    assert code == USAGE
    assert expected in err
    _assert_short(err)


def test_bad_hyperparameter_names_the_fix(tmp_path, capsys):
    code, err = _run(short_args(tmp_path, "drgrpo", "--model.clip.init_args.eps_low=1.5"), capsys)
    assert code == USAGE
    assert "eps_low" in err and "rlkit: error" in err
    _assert_short(err)


def test_missing_checkpoint_directory(tmp_path, capsys):
    code, err = _run(short_args(tmp_path, "drgrpo", f"--model.checkpoint={tmp_path / 'nope'}"), capsys)
    assert code == USAGE
    assert str(tmp_path / "nope") in err and "checkpoint" in err
    _assert_short(err)


def test_checkpoint_that_is_a_file(tmp_path, capsys):
    not_a_directory = tmp_path / "model.bin"
    not_a_directory.write_bytes(b"")
    code, err = _run(short_args(tmp_path, "drgrpo", f"--model.checkpoint={not_a_directory}"), capsys)
    assert code == USAGE
    assert "not a directory" in err
    _assert_short(err)


def test_missing_data_file(tmp_path, capsys):
    args = short_args(
        tmp_path,
        "drgrpo",
        "--data.prompts=rlkit.data.prompts.PromptFile",
        f"--data.prompts.path={tmp_path}/x.jsonl",
    )
    code, err = _run(args, capsys)
    assert code == USAGE
    assert "x.jsonl" in err
    _assert_short(err)


def test_malformed_data_row(tmp_path, capsys):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "reward_model": {"ground_truth": "2"}}) + "\n{not json\n")
    args = short_args(tmp_path, "drgrpo", "--data.prompts=rlkit.data.prompts.PromptFile", f"--data.prompts.path={path}")
    code, err = _run(args, capsys)
    assert code == USAGE
    assert "line 2" in err
    _assert_short(err)


def test_prompt_longer_than_the_limit(tmp_path, capsys):
    code, err = _run(short_args(tmp_path, "drgrpo", "--data.max_prompt_length=2"), capsys)
    assert code == USAGE
    assert "max_prompt_length" in err
    _assert_short(err)


def test_nan_loss_stops_with_a_message(tmp_path, capsys):
    code, err = _run(short_args(tmp_path, "drgrpo", "--model.ratio=spine.faulty.NaNRatio"), capsys)
    assert code == 1
    assert "non-finite" in err and "ckpt_path" in err
    _assert_short(err)


def test_failing_reward_function(tmp_path, capsys):
    code, err = _run(short_args(tmp_path, "drgrpo", "--data.rewards=[spine.faulty.RaisingReward]"), capsys)
    assert code == 1
    assert "buggy" in err
    _assert_short(err)
