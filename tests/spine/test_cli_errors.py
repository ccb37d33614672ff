"""Bad input ends with a short message naming the fix and the right exit code, never a traceback."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from rlkit.cli import main
from spine.helpers import short_args

EVERY_STEP = Path(__file__).with_name("checkpoint_every_step.yaml")

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
    code, err = _run(short_args(tmp_path, "drgrpo", f"--model.policy.checkpoint={tmp_path / 'nope'}"), capsys)
    assert code == USAGE
    assert str(tmp_path / "nope") in err and "checkpoint" in err
    _assert_short(err)


def test_checkpoint_that_is_a_file(tmp_path, capsys):
    not_a_directory = tmp_path / "model.bin"
    not_a_directory.write_bytes(b"\x00\x01 not weights")  # (an empty or YAML file would be read as a config)
    code, err = _run(short_args(tmp_path, "drgrpo", f"--model.policy.checkpoint={not_a_directory}"), capsys)
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


# ---- the hostile new user's catalogue (issue 6) ----


def test_unknown_component_lists_the_known_names(tmp_path, capsys):
    code, err = _run(short_args(tmp_path, "drgrpo", "--model.advantage=GroupMaen"), capsys)
    assert code == USAGE
    assert "unknown advantage 'GroupMaen'" in err and "did you mean GroupMean?" in err
    assert "known: " in err and "GroupNorm" in err and "LeaveOneOut" in err
    assert len(err.strip().splitlines()) <= 3, err


@pytest.mark.parametrize(
    "flag,expected",
    [
        ("--model.advantag=GroupNorm", "PolicyGradient has no parameter 'advantag' (did you mean advantage?)"),
        ("--model.clip.init_args.eps_hi=0.3", "PPOClip has no parameter 'eps_hi' (did you mean eps_high?)"),
        ("--model.clip.init_args.eps_high=wide", "--model.clip.init_args.eps_high: expected float or null, got 'wide'"),
    ],
)
def test_a_component_option_typo_is_one_line(flag, expected, tmp_path, capsys):
    code, err = _run(short_args(tmp_path, "drgrpo", flag), capsys)
    assert code == USAGE
    assert err.strip().splitlines()[-1].startswith("error: ") and expected in err, err
    assert len(err.strip().splitlines()) <= 3, err


def test_a_fit_stopped_by_sigterm_does_not_exit_0(monkeypatch, capsys):
    """Lightning ends a fit on SIGTERM with SystemExit() (exit 0): a study would count it as finished."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    import rlkit.cli

    def stopped(args):
        raise SIGTERMException

    monkeypatch.setattr(rlkit.cli, "build_cli", stopped)
    code, err = _run(["fit", "--config=x.yaml"], capsys)
    assert code == 143 and "SIGTERM" in err and "--ckpt_path=last" in err


def test_engine_short_names_are_registered(tmp_path, monkeypatch):
    """The README's real-model command uses --data.engine=VLLMEngine: the short name must resolve."""
    from rlkit.cli import build_cli
    from rlkit.engines.vllm import VLLMEngine

    cli = build_cli(short_args(tmp_path, "drgrpo", "--data.engine=VLLMEngine")[1:], run=False)
    assert isinstance(cli.datamodule.engine, VLLMEngine)


def test_missing_vllm_is_one_line_with_the_install_hint(tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    code, err = _run(short_args(tmp_path, "drgrpo", "--data.engine=VLLMEngine"), capsys)
    assert code == USAGE
    assert "VLLMEngine needs vLLM" in err and "pip install" in err
    _assert_short(err)


def test_negative_learning_rate(tmp_path, capsys):
    code, err = _run(short_args(tmp_path, "drgrpo", "--model.optim.optimizer.init_args.lr=-0.1"), capsys)
    assert code == USAGE
    assert "model.optim.optimizer" in err and "-0.1" in err
    _assert_short(err)


def test_log_prob_with_a_ratio_clip_is_refused(tmp_path, capsys):
    """gpg's LogProb passes log pi, not a ratio: PPOClip's band around 1 would clip nearly every token."""
    code, err = _run(short_args(tmp_path, "gpg", "--model.clip=PPOClip"), capsys)
    assert code == USAGE
    assert "LogProb" in err and "PPOClip" in err and "--model.clip=NoClip" in err
    _assert_short(err)


def test_corrupt_weights_name_the_file(tmp_path, capsys):
    from rlkit.embedded.model import build_tiny_checkpoint

    directory = build_tiny_checkpoint(tmp_path / "broken")
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated, as by an interrupted copy
    code, err = _run(short_args(tmp_path, "drgrpo", f"--model.policy.checkpoint={directory}"), capsys)
    assert code == USAGE
    assert str(directory) in err and "model.safetensors" in err and "corrupt" in err
    _assert_short(err)


def test_unwritable_checkpoint_directory_is_refused_before_any_work(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    callback = (
        "--trainer.callbacks=[{class_path: lightning.pytorch.callbacks.ModelCheckpoint, "
        f"init_args: {{dirpath: {blocker}/ckpts, every_n_train_steps: 1}}}}]"
    )
    code, err = _run(short_args(tmp_path, "drgrpo", callback), capsys)
    assert code == USAGE
    assert f"{blocker}/ckpts" in err and "not writable" in err
    _assert_short(err)


def test_a_failed_checkpoint_write_names_the_last_good_one(tmp_path, capsys, monkeypatch):
    """Disk full on the third checkpoint: one line naming the directory and the checkpoint that is kept."""
    import torch

    import rlkit.checkpointing

    calls = {"n": 0}
    real_save = torch.save

    def failing_save(obj, f, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] >= 3:
            raise OSError(28, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(rlkit.checkpointing.torch, "save", failing_save)
    every = "--config=" + str(EVERY_STEP)
    code, err = _run(short_args(tmp_path, "drgrpo", every), capsys)
    assert code == 1
    assert "No space left on device" in err and "nothing was lost" in err and "ckpt_path=last" in err
    _assert_short(err)
    checkpoints = tmp_path / "ckpts"
    assert not list(checkpoints.glob(".*.partial")), "a failed write must not leave a partial file"
    kept = torch.load(checkpoints / "last.ckpt", weights_only=True)  # the previous last.ckpt is intact
    assert kept["global_step"] >= 1


def test_stale_partial_checkpoints_are_removed_at_start(tmp_path, capsys):
    checkpoints = tmp_path / "ckpts"
    checkpoints.mkdir()
    stale = checkpoints / ".last.ckpt.abc123.partial"
    stale.write_bytes(b"x" * 100)
    from rlkit.cli import build_cli

    build_cli(short_args(tmp_path, "drgrpo", "--config=" + str(EVERY_STEP), "--trainer.max_steps=1"))
    assert not stale.exists()
    assert (checkpoints / "last.ckpt").exists()


def test_resume_without_a_checkpoint_says_so(tmp_path, capsys):
    from rlkit.cli import build_cli

    build_cli(short_args(tmp_path, "drgrpo", "--trainer.max_steps=1", "--ckpt_path=last"))
    err = capsys.readouterr().err
    assert "no checkpoint found" in err and "training starts fresh" in err
    assert "save_last" not in err  # Lightning's hint does not apply: rlkit always saves last


def test_skipped_prompts_are_counted(tmp_path, capsys):
    """long_prompts=skip drops the 8 long prompts of 16 before the first step: said once, logged once."""
    from rlkit.cli import build_cli
    from spine.test_fit import _scalars

    rows = [{"prompt": f"{a}+{a}=", "reward_model": {"ground_truth": str(2 * a)}} for a in range(1, 9)]
    rows += [{"prompt": f"{a}{a}+{a}{a}=", "reward_model": {"ground_truth": str(22 * a)}} for a in range(1, 9)]
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = short_args(
        tmp_path,
        "drgrpo",
        "--data.prompts=rlkit.data.prompts.PromptFile",
        f"--data.prompts.path={path}",
        "--data.max_prompt_length=6",  # BOS + "1+1=" is 5 tokens, BOS + "11+11=" is 7
        "--data.long_prompts=skip",
    )
    build_cli(args)
    assert _scalars(tmp_path / "runs")["data/skipped_prompts"] == [8.0]
    err = capsys.readouterr().err
    assert err.count("data.long_prompts=skip") == 1 and "8 of 16 prompts" in err  # said once, not per prompt


def test_help_says_what_rlkit_is(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    assert "Lightning Trainer command line tool" not in out
    assert "rlkit fit --config experiments/drgrpo.yaml" in out and "tensorboard --logdir runs" in out
