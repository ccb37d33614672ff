"""One owner per study, one writer per run: advisory file locks (``flock``) held while a process works.

- ``study.lock`` in a study folder is held by the ``rlkit ablate`` that runs the study, from before it
  reads ``study.yaml`` until it exits: a second ``rlkit ablate`` on the folder stops at once, naming it.
- ``run.lock`` in a run folder is taken by the study before it starts the run's ``rlkit fit``, and the
  child inherits the open file: the lock stays held until both have exited, so a resume never trains a
  run that a process (a study's orphaned ``rlkit fit``, say) is still writing.

The kernel drops a ``flock`` when the last descriptor of the open file closes, also when its process is
killed (``kill -9``): a lock is never stale. The file's text (who holds it, on which host, since when)
is only a note for messages; it is rewritten by each holder and may be empty.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from rlkit.errors import RLKitError

STUDY_LOCK = "study.lock"
RUN_LOCK = "run.lock"


class StudyBusy(RLKitError):
    """Another process owns the study folder. Exit code 2: nothing was started or changed."""

    exit_code = 2


class FileLock:
    """An exclusive ``flock`` on ``path`` (created if missing), held from :meth:`acquire` to :meth:`release`.

    Args:
        path: the lock file.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.fd: int | None = None

    def acquire(self, wait_s: float = 0.0) -> bool:
        """Take the lock, trying for up to ``wait_s`` seconds; False (and nothing held) if another holds it."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    return False
                time.sleep(0.1)
        self.fd = fd
        return True

    def note(self, **info) -> None:
        """Record who holds the lock (pid, host and start time are added) in the lock file."""
        text = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": _now(), **info})
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, (text + "\n").encode(), 0)

    def release(self) -> None:
        """Close this process's descriptor (the lock is free once every process sharing it has closed it)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def holder(path: str | Path) -> dict | None:
    """The note of whoever holds the lock at ``path``; None when nobody does (or there is no such file).

    Probing takes a shared lock for an instant; :meth:`FileLock.acquire` with a short wait rides over it.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return read_note(path)
    finally:
        os.close(fd)  # closing also drops the shared lock, when it was taken
    return None


def read_note(path: str | Path) -> dict:
    """The holder's note in a lock file (empty when it has none, or it is being rewritten)."""
    try:
        note = json.loads(Path(path).read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return note if isinstance(note, dict) else {}


def describe(note: dict) -> str:
    """``pid 1234 on host gpu-3, since 2025-01-31 12:00:05`` (whatever the note holds)."""
    parts = [f"pid {note['pid']}" if "pid" in note else "a process"]
    if note.get("host"):
        parts.append(f"on host {note['host']}")
    text = " ".join(parts)
    return f"{text}, since {note['since']}" if note.get("since") else text


def own_study(directory: Path) -> FileLock:
    """Take the study folder's lock (creating the folder); a ``StudyBusy`` naming the holder if another has it."""
    directory.mkdir(parents=True, exist_ok=True)
    lock = FileLock(directory / STUDY_LOCK)
    # one second: a `rlkit compare` probing the lock holds it for an instant
    if not lock.acquire(wait_s=1.0):
        note = read_note(lock.path)
        command = note.get("command", "rlkit ablate")
        raise StudyBusy(
            f"study {directory} is in use by {command} ({describe(note)}; lock {lock.path}): one process runs a "
            f"study at a time. Wait for it to finish (rlkit compare {directory} reports on it meanwhile), or stop "
            f"it (kill {note.get('pid', '<pid>')}) and continue with rlkit ablate --resume {directory}"
        )
    lock.note(command="rlkit ablate")
    return lock


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")
