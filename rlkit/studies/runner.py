"""A study's runs: each an ``rlkit fit`` process, one after another (or ``parallel`` at a time).

Each run writes into ``runs/<variant>/seed=<s>/`` (TensorBoard events, ``config.yaml``, checkpoints, the
process's output in ``rlkit.log``) and the runner keeps ``run.json`` there: ``finished`` runs are skipped
on the next call; a run that stopped (interrupted, killed, failed) resumes from its ``checkpoints/last.ckpt``
(``--ckpt_path``), or starts again from scratch when it wrote no checkpoint.

One writer per run: each ``rlkit fit`` runs under :mod:`rlkit.studies.child` (it dies with the study) and
holds the run folder's ``run.lock`` with the study (:mod:`rlkit.studies.locks`); a run whose lock is held
by a process still writing it is waited for, up to ``BUSY_WAIT_S``, never started beside it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from rlkit.studies import child
from rlkit.studies.locks import RUN_LOCK, FileLock, describe, holder, read_note
from rlkit.studies.plan import Study, Variant, write_atomic

STATE_FILE = "run.json"
LOG_FILE = "rlkit.log"
#: Seconds to wait for a process still writing a run (a stopped study's `rlkit fit` finishing its step).
BUSY_WAIT_S = child.GRACE_S + 30.0
#: Exit codes of an `rlkit fit` stopped by Ctrl-C or SIGTERM (its own, or the signal's when it died of it).
STOPPED = (130, 143, -signal.SIGINT, -signal.SIGTERM, -signal.SIGKILL)


class StudyInterrupted(KeyboardInterrupt):
    """Ctrl-C during a study: the runs were stopped and can be resumed."""


class RunBusy(Exception):
    """A run's folder is locked by a process that is still writing it."""


@dataclass
class Run:
    """One variant with one seed."""

    variant: Variant
    seed: int
    directory: Path
    process: subprocess.Popen | None = None
    started: float = 0.0
    resumed_from: str | None = None
    log: object = field(default=None, repr=False)
    lock: FileLock | None = field(default=None, repr=False)

    @property
    def label(self) -> str:
        return f"{self.variant.name} seed={self.seed}"


def read_state(directory: Path) -> dict:
    path = directory / STATE_FILE
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def is_finished(directory: Path) -> bool:
    return read_state(directory).get("status") == "finished"


def run_status(directory: Path) -> str:
    """``run.json``'s status, except that a "running" run nobody holds the lock of was stopped: "interrupted"."""
    status = read_state(directory).get("status", "not started")
    if status == "running" and holder(directory / RUN_LOCK) is None:
        return "interrupted"
    return status


def runs_of(study: Study) -> list[Run]:
    """Seed by seed, every variant: a half-done study already holds one complete comparison."""
    return [Run(v, s, study.run_dir(v, s)) for s in study.seeds for v in study.variants]


def run_study(study: Study, parallel: int = 1, on_finish=None) -> list[Run]:
    """Run every unfinished run; return the ones that failed. ``on_finish(run)``: a word on each finished run."""
    runs = runs_of(study)
    todo = []
    for i, run in enumerate(runs, 1):
        if is_finished(run.directory):
            _say(f"[{i}/{len(runs)}] {run.label}: finished earlier, skipped")
        else:
            todo.append((i, run))
    env = _child_env(parallel)
    running: list[tuple[int, Run]] = []
    failed: list[Run] = []
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)  # `kill` stops the runs as Ctrl-C does
    try:
        while todo or running:
            while todo and len(running) < parallel:
                i, run = todo.pop(0)
                where = f"[{i}/{len(runs)}] {run.label}"
                try:
                    _start(study, run, env, where)
                except RunBusy as busy:
                    failed.append(run)
                    _say(f"{where}: NOT STARTED: {busy}; stop that process, then resume the study")
                    continue
                how = f"resuming from {run.resumed_from}" if run.resumed_from else "started"
                _say(f"{where}: {how} (output: {run.directory / LOG_FILE})")
                running.append((i, run))
            time.sleep(0.2)
            for i, run in list(running):
                code = run.process.poll()
                if code is None:
                    continue
                running.remove((i, run))
                wall = _finish(run, code)
                if code == 0:
                    outcome = f": {on_finish(run)}" if on_finish is not None else ""
                    _say(f"[{i}/{len(runs)}] {run.label}: finished in {wall:.0f} s{outcome}")
                else:
                    failed.append(run)
                    _say(f"[{i}/{len(runs)}] {run.label}: FAILED (exit {code}) after {wall:.0f} s:\n{_tail(run)}")
    except KeyboardInterrupt:
        for _, run in running:
            _stop(run)
        raise StudyInterrupted from None
    finally:
        signal.signal(signal.SIGTERM, previous)
    return failed


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _start(study: Study, run: Run, env: dict, where: str) -> None:
    """Lock the run folder, then start its ``rlkit fit``, which shares the lock. A ``RunBusy`` when another
    process still holds the lock after ``BUSY_WAIT_S``."""
    run.directory.mkdir(parents=True, exist_ok=True)
    lock = FileLock(run.directory / RUN_LOCK)
    if not lock.acquire():
        note = read_note(lock.path)
        _say(f"{where}: still written by {describe(note)} (a stopped study's rlkit fit?); waiting for it to end")
        if not lock.acquire(wait_s=BUSY_WAIT_S):
            note = read_note(lock.path)
            raise RunBusy(
                f"still written by {describe(note)} (kill {note.get('pid', '<pid>')}) after {BUSY_WAIT_S:.0f} s"
            )
    run.lock = lock
    last = run.directory.resolve() / "checkpoints" / "last.ckpt"
    if last.is_file():
        run.resumed_from = str(last)
    else:  # stopped before its first checkpoint: nothing to resume
        _clear(run.directory, keep=RUN_LOCK)
    args = study.fit_args(run.variant, run.seed, run.resumed_from)
    state = read_state(run.directory)
    state.update(variant=run.variant.name, changes=run.variant.changes, seed=run.seed, status="running")
    state["command"] = "rlkit " + " ".join(args)
    write_atomic(run.directory / STATE_FILE, json.dumps(state, indent=1))
    run.log = open(run.directory / LOG_FILE, "a")  # noqa: SIM115  (closed in _finish)
    run.started = time.perf_counter()
    try:
        run.process = subprocess.Popen(
            [sys.executable, "-m", "rlkit.studies.child", str(os.getpid()), *args],
            stdout=run.log,
            stderr=subprocess.STDOUT,
            env=env,
            pass_fds=[lock.fd],  # the child holds the run's lock as long as it lives
        )
    except BaseException:
        run.log.close()
        lock.release()
        raise
    lock.note(pid=run.process.pid, study_pid=os.getpid(), command="rlkit fit (rlkit ablate's run)")


def _clear(directory: Path, keep: str) -> None:
    """Empty ``directory`` but for ``keep`` (the lock file in use: removing it would let a second holder in)."""
    for path in directory.iterdir():
        if path.name == keep:
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def _finish(run: Run, code: int, interrupted: bool = False) -> float:
    wall = time.perf_counter() - run.started
    run.log.close()
    state = read_state(run.directory)
    attempts = [*state.get("attempts", []), {"wall_s": round(wall, 2), "exit": code, "resumed_from": run.resumed_from}]
    if interrupted or code in STOPPED:
        status = "interrupted"
    else:
        status = "finished" if code == 0 else "failed"
    state.update(
        status=status,
        attempts=attempts,
        wall_s=round(sum(a["wall_s"] for a in attempts), 2),
    )
    write_atomic(run.directory / STATE_FILE, json.dumps(state, indent=1))
    run.lock.release()
    return wall


def _stop(run: Run) -> None:
    """Let the run stop itself, then make sure it did: SIGINT makes ``rlkit fit`` write a checkpoint at the end
    of the rollout it is training on (``rlkit.signals``); a second SIGINT stops it at once (no checkpoint), and
    SIGKILL ends a run that has not stopped by then. A rollout longer than the first grace loses only itself."""
    for stop, grace in ((signal.SIGINT, 120), (signal.SIGINT, 15), (signal.SIGKILL, None)):
        if run.process.poll() is not None:
            break
        run.process.send_signal(stop)
        try:
            run.process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            continue
    _finish(run, run.process.returncode, interrupted=True)


def _child_env(parallel: int) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for name in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS"):  # each run seeds itself (--seed_everything)
        env.pop(name, None)
    if parallel > 1 and "OMP_NUM_THREADS" not in env:  # runs side by side share the cores
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // parallel))
    return env


def _tail(run: Run, lines: int = 15) -> str:
    text = (run.directory / LOG_FILE).read_text(errors="replace").replace("\r", "\n").splitlines()
    kept = [line for line in text if line.strip()][-lines:]
    return "\n".join("    " + line for line in kept)


def _say(message: str) -> None:
    print(f"rlkit ablate: {message}", file=sys.stderr, flush=True)
