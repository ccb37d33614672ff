"""SIGINT and SIGTERM during ``rlkit fit``: a checkpoint at the end of the current rollout, the resume command,
exit 130 / 143; resuming it ends bitwise where an uninterrupted run ends (issue 21)."""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlkit.cli import build_cli, main
from spine.helpers import ROOT, short_args

EVERY_STEP = Path(__file__).with_name("checkpoint_every_step.yaml")
STEPS = 3
COMMON = [f"--config={EVERY_STEP}", f"--trainer.max_steps={STEPS}"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> dict:
    """The uninterrupted run's exported weights."""
    root = tmp_path_factory.mktemp("straight")
    with contextlib.chdir(root):
        build_cli(short_args(root, "drgrpo", *COMMON))
    return load_file(root / "export" / "model.safetensors")


def test_sigint_saves_the_rollout_prints_the_resume_command_and_exits_130(straight, tmp_path, monkeypatch, capsys):
    """Ctrl-C in a running ``rlkit fit`` (a subprocess, as a terminal would): today Lightning's "Detected
    KeyboardInterrupt" and exit 1, with the steps since the last checkpoint lost."""
    run = tmp_path / "interrupted"
    run.mkdir()
    tests = str(ROOT / "tests")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH", "")) if p)
    args = short_args(run, "drgrpo", *COMMON)
    process = subprocess.Popen(
        [sys.executable, "-m", "rlkit.cli", *args], cwd=run, env=env, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline and not list((run / "ckpts").glob("*step=1*")) and process.poll() is None:
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)  # during rollout 2 (index 1): step 1's checkpoint is on disk
    _, err = process.communicate(timeout=400)
    assert process.returncode == 130, err[-3000:]
    assert "Detected KeyboardInterrupt" not in err and "Traceback" not in err, err[-3000:]
    assert not (run / "export").exists(), "the run finished before the signal"
    checkpoint = torch.load(run / "ckpts" / "last.ckpt", weights_only=True, mmap=True)
    step = checkpoint["global_step"]
    assert 2 <= step < STEPS and checkpoint["RolloutDataModule"]["iteration"] == step
    assert f"stopped by SIGINT at step {step}: checkpoint written to {run / 'ckpts' / 'last.ckpt'}" in err

    [command] = [line.split("resume with: ", 1)[1] for line in err.splitlines() if "resume with: " in line]
    resume = shlex.split(command)
    assert resume[0] == "rlkit" and resume[1:] == [*args, "--ckpt_path=last"]

    monkeypatch.chdir(run)
    monkeypatch.setattr(logging, "raiseExceptions", False)  # see test_cli_errors
    main(resume[1:])  # the printed command, in this process
    assert f"resuming from {Path('ckpts') / 'last.ckpt'}" in capsys.readouterr().err
    resumed = load_file(run / "export" / "model.safetensors")
    for name, tensor in straight.items():
        assert torch.equal(tensor, resumed[name]), f"{name} differs after SIGINT and resume"


def test_sigterm_saves_the_rollout_and_exits_143(tmp_path, monkeypatch, capsys):
    """SIGTERM at the end of step 1 (sent by the process itself, as ``kill`` would): today Lightning's
    ``SystemExit`` with the steps since the last checkpoint lost."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(logging, "raiseExceptions", False)
    sender = "{class_path: spine.faulty.SignalAfterStep, init_args: {step: 1, signum: 15}}"
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    with pytest.raises(SystemExit) as stop:
        main(short_args(tmp_path, "drgrpo", *COMMON, f"--trainer.callbacks+={sender}"))
    err = capsys.readouterr().err
    assert stop.value.code == 143, err[-3000:]
    assert "stopped by SIGTERM at step 1" in err and err.rstrip().endswith("--ckpt_path=last"), err[-3000:]
    assert torch.load(tmp_path / "ckpts" / "last.ckpt", weights_only=True)["global_step"] == 1
    assert not (tmp_path / "export").exists()
    assert {signum: signal.getsignal(signum) for signum in handlers} == handlers  # given back


def test_a_second_ctrl_c_stops_at_once_and_a_repeated_sigterm_changes_nothing(capsys):
    from rlkit.signals import Interrupted, StopOnSignal

    stopper = StopOnSignal()
    with pytest.raises(Interrupted) as stop:  # before training: nothing new to save, so at once
        stopper._handle(signal.SIGTERM, None)
    assert stop.value.exit_code == 143 and stop.value.checkpoint is None
    stopper._training = True
    stopper._handle(signal.SIGTERM, None)
    stopper._handle(signal.SIGTERM, None)  # a study's child gets two when the study dies
    assert stopper.received == signal.SIGTERM and capsys.readouterr().err.count("SIGTERM received") == 1
    with pytest.raises(Interrupted) as stop:
        stopper._handle(signal.SIGINT, None)
    assert stop.value.exit_code == 130 and "no checkpoint written since the last one" in str(stop.value)


def test_the_resume_command_replaces_the_checkpoint_given():
    from rlkit.signals import resume_command

    argv = ["fit", "--config", "my exp.yaml", "--ckpt_path", "old.ckpt", "--ckpt_path=other.ckpt", "--x=1"]
    assert resume_command(argv) == "rlkit fit --config 'my exp.yaml' --x=1 --ckpt_path=last"
    assert resume_command(["fit"], "/r/last.ckpt") == "rlkit fit --ckpt_path=/r/last.ckpt"
