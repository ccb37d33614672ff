"""One owner per study, one writer per run: a second ``rlkit ablate`` on a running study, ``rlkit compare``
on it, and ``kill -9`` of the study followed at once by ``rlkit ablate --resume``.

The study is one tiny run held in its second rollout by a gated reward (``gated_reward.Gated``), so
every step happens while the run is known to be mid-training.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from spine.helpers import EXPERIMENTS

from rlkit.cli import main
from rlkit.studies.locks import RUN_LOCK, read_note

HERE = Path(__file__).parent
STUDY = [
    "ablate",
    f"--config={EXPERIMENTS / 'drgrpo.yaml'}",
    f"--config={HERE / 'every_step.yaml'}",
    "--data.prompts_per_step=4",
    "--data.samples_per_prompt=4",
    "--trainer.max_steps=3",
    "--trainer.val_check_interval=null",
    "--trainer.limit_val_batches=0",
    "--trainer.enable_progress_bar=false",
    # one rollout (16 calls) passes, the second waits at the gate
    "--data.rewards=[{class_path: gated_reward.Gated, init_args: {open_calls: 16}}]",
    "--data.reward_timeout_s=600",
]


def _in_process(args: list[str]) -> tuple[int, str]:
    """``rlkit ARGS`` in this process: its exit code and stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            main(args)
            code = 0
        except SystemExit as stop:
            code = stop.code
    return code, err.getvalue()


def _wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie nobody reaped counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """Start a study; while its run waits at the gate: a second ablate, a compare, then kill -9 of the study
    and a resume started at once; the gate opens once the resume waits for the run's writer."""
    workdir = tmp_path_factory.mktemp("ownership")
    study, gate = workdir / "study", workdir / "gate"
    run = study / "runs" / "base" / "seed=0"
    gate.touch()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", RLKIT_TEST_GATE=str(gate))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)
    rlkit = [sys.executable, "-m", "rlkit.cli"]
    out = {"study": study, "run": run}
    first_err, resume_err = workdir / "first.err", workdir / "resume.err"
    with first_err.open("w") as err:
        first = subprocess.Popen([*rlkit, *STUDY, f"--study={study}"], cwd=workdir, env=env, stderr=err)
    try:
        _wait_for(lambda: Path(f"{gate}.waiting").exists() or first.poll() is not None, 300, "the run's 2nd rollout")
        assert first.poll() is None, first_err.read_text()[-3000:]
        out["first_pid"], out["child"] = first.pid, read_note(run / RUN_LOCK)["pid"]
        files = [run / "run.json", study / "study.yaml", run / "checkpoints" / "last.ckpt"]
        before = [path.read_bytes() for path in files]
        out["second"] = _in_process([*STUDY, f"--study={study}"])
        out["compare"] = _in_process(["compare", str(study)])
        out["untouched"] = [path.read_bytes() for path in files] == before and first.poll() is None

        first.kill()  # kill -9 of `rlkit ablate`: it cannot stop its run itself
        first.wait()
        with resume_err.open("w") as err:
            resume = subprocess.Popen([*rlkit, "ablate", "--resume", str(study)], cwd=workdir, env=env, stderr=err)
        _wait_for(
            lambda: "waiting for it to end" in resume_err.read_text() or resume.poll() is not None,
            120,
            "the resume to wait for the killed study's run",
        )
        out["child_alive_while_resume_waits"] = _alive(out["child"])
        gate.unlink()  # the orphaned run finishes its step and stops (SIGTERM from the dead study)
        out["resume_code"] = resume.wait(timeout=600)
        out["resume"] = resume_err.read_text()
    finally:
        gate.unlink(missing_ok=True)
        if first.poll() is None:
            first.kill()
    return out


def test_a_second_ablate_on_a_running_study_stops_at_once_naming_the_owner(killed):
    code, err = killed["second"]
    assert code == 2
    assert err.strip().splitlines() == [err.strip()]  # one line
    study = killed["study"]
    assert err.startswith(f"rlkit: error: study {study} is in use by rlkit ablate (pid {killed['first_pid']} on host ")
    assert f"lock {study / 'study.lock'}" in err and f"rlkit ablate --resume {study}" in err
    assert killed["untouched"]  # the running study's files as they were, and it still runs


def test_compare_reads_a_running_study_and_says_it_is_running(killed):
    code, err = killed["compare"]
    assert f"the study is still running (rlkit ablate, pid {killed['first_pid']} on host " in err
    # nothing has finished yet: said in one line, exit 2 as for any study without a finished run
    last = err.strip().splitlines()[-1]
    assert code == 2 and last.startswith(f"rlkit: error: no finished run in {killed['study']} yet")


def test_kill_9_of_ablate_stops_its_run_and_a_resume_trains_it_once(killed):
    run = killed["run"]
    assert killed["resume_code"] == 0, killed["resume"][-3000:]
    # the resume found the orphaned run still writing and waited for it instead of training beside it
    assert killed["child_alive_while_resume_waits"]
    assert f"still written by pid {killed['child']} on host " in killed["resume"]
    assert not _alive(killed["child"])
    log = (run / "rlkit.log").read_text()
    # the orphan stopped on the SIGTERM its dead study sent, before the resumed run started
    assert log.index("rlkit: stopped by SIGTERM") < log.index("Restoring states from the checkpoint")
    assert killed["resume"].count("resuming from") == 1 and "finished in" in killed["resume"]
    state = json.loads((run / "run.json").read_text())
    assert state["status"] == "finished" and len(state["attempts"]) == 1
    assert state["attempts"][0]["resumed_from"] == str(run.resolve() / "checkpoints" / "last.ckpt")
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 3
    assert not list(run.glob("version_*"))  # one run folder, no second run beside it
