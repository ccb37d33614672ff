"""One sandboxed Python process, seen from the caller: start it, end it with all it started, remove its files."""

from __future__ import annotations

import json
import os
import signal
import site
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The sandbox starts Python without ``site`` (-S: its .pth files cost ~50 ms a process here, and run code
# of their own); the caller's site-packages directories are put on its path instead.
_SITE_PACKAGES = [p for p in site.getsitepackages() if os.path.isdir(p)]


class SandboxedProcess:
    """``python -I -S -B -u -c program config`` in a fresh working directory, its payload on stdin.

    The process the caller starts is the runner's keeper (``_sandbox_runner.py``); the sandbox is its
    child. ``output`` collects stdout and stderr, ``report`` what the runner writes on its report pipe.

    Args:
        program: the runner's text.
        config: the runner's settings; the working directory, pipes and parent are added here.
        payload: the code or tests, sent on stdin (never on the command line, never on disk).
        read_fd, write_fd: this process's ends of its channel to the other process.
    """

    def __init__(self, program: str, config: dict, payload: dict, read_fd: int, write_fd: int) -> None:
        folder = os.path.realpath(tempfile.gettempdir())
        if config["namespaces"] and (folder + "/").startswith("/dev/"):
            folder = "/tmp"  # the sandbox gets a /dev of its own, which hides this folder
        self.workdir = os.path.realpath(tempfile.mkdtemp(prefix="rlkit-sandbox-", dir=folder))
        self.output, self.report = bytearray(), bytearray()
        report_r, report_w = os.pipe()
        config = dict(config, workdir=self.workdir, report_fd=report_w, read_fd=read_fd, write_fd=write_fd)
        config["parent"], config["path"] = os.getpid(), _SITE_PACKAGES
        config["env"] = {"PATH": "/usr/bin:/bin", "HOME": self.workdir, "TMPDIR": self.workdir, "LANG": "C.UTF-8"}
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-I", "-S", "-B", "-u", "-c", program, json.dumps(config)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                start_new_session=True,
                pass_fds=(report_w, read_fd, write_fd),
            )
        except BaseException:
            os.close(report_r)
            remove_tree(self.workdir, time.monotonic() + 5.0)
            raise
        finally:
            os.close(report_w)
        self.report_fd = report_r
        self._payload = json.dumps(payload).encode()

    def send_payload(self) -> None:
        try:
            self.process.stdin.write(self._payload)
            self.process.stdin.close()
        except BrokenPipeError:
            pass

    def kill(self) -> None:
        """Kill the sandbox and everything it started; return once the keeper is reaped.

        The keeper's children are the sandbox (with namespaces, PID 1 of its PID namespace: when it dies
        the kernel kills every process in the namespace) and, without namespaces, the sandbox's orphans;
        the keeper reaps them and exits. Then its process group goes, and it is reaped here."""
        if self.process.poll() is None:
            for child in _children(self.process.pid):
                try:
                    os.kill(child, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                self.process.wait(5.0)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # not reaped yet, so the id is not reused
        except (ProcessLookupError, PermissionError):
            pass
        self.process.wait()

    def close(self, deadline: float) -> None:
        """Close the pipes and remove the working directory (after ``kill``)."""
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                stream.close()
        os.close(self.report_fd)
        remove_tree(self.workdir, deadline)


def _children(pid: int) -> list[int]:
    """The ids of ``pid``'s child processes (``/proc``; empty where it cannot tell)."""
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        pass
    children = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                children.append(int(entry))
    return children


_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def remove_tree(path: str, deadline: float) -> bool:
    """Delete ``path`` and everything below it, however deep, without following a link; True when gone.

    A loop, not a recursion, holding one directory descriptor at a time: it goes down by name
    (``openat`` with ``O_NOFOLLOW``) and back up by ``..``, checking that ``..`` is the directory it
    came from (device and inode), so a tree moved while it works is left alone rather than followed.
    Directories without permissions get them (``fchmod``); what cannot be removed, or is left when
    ``deadline`` (``time.monotonic()``) passes, stays, and nothing raises.
    """
    try:
        os.rmdir(path)  # with namespaces the sandbox's files were on its own tmpfs: this is empty
        return True
    except FileNotFoundError:
        return True
    except OSError:
        pass
    try:
        fd = os.open(path, _DIRECTORY)
    except OSError:
        return False
    above: list[tuple[str, int, int]] = []  # (name, st_dev, st_ino) of each directory above fd's, top first
    stuck: set[tuple[int, int]] = set()  # directories that could not be emptied or removed
    try:
        while time.monotonic() < deadline:
            here = os.fstat(fd)
            if stat.S_IMODE(here.st_mode) & 0o700 != 0o700:
                _ignore(os.fchmod, fd, 0o700)
            below = None
            with os.scandir(fd) as entries:
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        if (here.st_dev, entry.inode()) not in stuck:
                            below = entry.name
                            break
                    else:
                        _ignore(os.unlink, entry.name, dir_fd=fd)
            if below is not None:
                try:
                    child = os.open(below, _DIRECTORY, dir_fd=fd)
                except OSError:
                    _ignore(os.chmod, below, 0o700, dir_fd=fd)
                    try:
                        child = os.open(below, _DIRECTORY, dir_fd=fd)
                    except OSError:
                        stuck.add((here.st_dev, os.stat(below, dir_fd=fd, follow_symlinks=False).st_ino))
                        continue
                above.append((below, here.st_dev, here.st_ino))
                os.close(fd)
                fd = child
                continue
            if not above:
                break
            name, dev, ino = above.pop()
            parent = os.open("..", _DIRECTORY, dir_fd=fd)
            if (os.fstat(parent).st_dev, os.fstat(parent).st_ino) != (dev, ino):
                os.close(parent)
                return False  # moved under us: leave it
            os.close(fd)
            fd = parent
            try:
                os.rmdir(name, dir_fd=fd)
            except OSError:
                stuck.add((here.st_dev, here.st_ino))
    except OSError:
        return False
    finally:
        os.close(fd)
    try:
        os.rmdir(path)
        return True
    except OSError:
        return False


def _ignore(function, *args, **kwargs) -> None:
    try:
        function(*args, **kwargs)
    except OSError:
        pass
