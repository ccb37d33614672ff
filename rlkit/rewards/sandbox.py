"""Running untrusted Python (a completion and its unit tests) in a locked-down child process.

Each run gets its own process and session, a throw-away working directory, an environment holding
nothing of the caller's, and resource limits (CPU time, address space, processes, file size, open
files, no core dumps); its output is read up to a cap, and after ``timeout_s`` of wall-clock time
the whole process group is killed. Where the kernel allows it (root, or unprivileged user
namespaces), the run also gets its own network namespace (no interfaces but a downed loopback: no
network), PID namespace (every process it starts dies with it), mount namespace (a fresh /proc
showing only its own processes; every file system read-only, without devices or set-uid, except its
working directory) and no capabilities. A Python audit hook refuses sockets, subprocesses, forks,
``ctypes``, writes outside the working directory, signals to other processes, and frame
introspection; it is a tripwire, not a boundary (PEP 578), and is the only layer where namespaces
are not available (e.g. an unprivileged Docker container): ``sandbox_layers()`` says which layers
are active on this machine.

Known limits: as real root (uid 0) the kernel does not enforce ``RLIMIT_NPROC``, so processes are
then bounded by the guard and the PID namespace's lifetime, not by a count; without namespaces a
process that escapes the guard (a C extension already imported) could reach the network and the
caller's files. Passing means "the solution and then the tests ran to their end": a solution that
exits early with any status fails, and the tests see builtins the solution did not modify; but a
solution can still monkey-patch other modules the tests use, or walk the interpreter's frames to
find the token that reports a pass.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

_RUNNER = (Path(__file__).with_name("_sandbox_runner.py")).read_text(encoding="utf-8")


@dataclass
class SandboxResult:
    """How a run ended.

    Attributes:
        passed: the solution and then the tests ran to their end.
        status: ``"passed"``, ``"failed"`` (an exception, a failed assertion, an exit),
            ``"timeout"`` (wall clock), ``"output_limit"`` or ``"killed"`` (by a signal: CPU time, file
            size, memory).
        exit_code: the runner's exit code (negative: the signal that killed it).
        output: the first ``max_output_bytes`` of its stdout and stderr.
        layers: the isolation layers that were active.
    """

    passed: bool
    status: str
    exit_code: int | None
    output: str
    layers: list[str] = field(default_factory=list)


def run_python(
    solution: str,
    tests: str,
    timeout_s: float = 5.0,
    memory_mb: int = 1024,
    max_processes: int = 16,
    max_file_bytes: int = 1 << 20,
    max_output_bytes: int = 1 << 16,
    namespaces: bool = True,
    guard: bool = True,
) -> SandboxResult:
    """Run ``solution`` then ``tests`` (each compiled on its own, one namespace) in a sandbox.

    Args:
        solution: the code under test.
        tests: code that raises (e.g. a failed ``assert``) when the solution is wrong.
        timeout_s: wall-clock limit; CPU time is limited to the same number of seconds (rounded up).
        memory_mb: address-space limit in MiB.
        max_processes: ``RLIMIT_NPROC`` (not enforced by the kernel for real root).
        max_file_bytes: the largest file the run may write.
        max_output_bytes: stdout and stderr together beyond this kill the run.
        namespaces: use Linux namespaces where the kernel allows.
        guard: install the Python audit-hook guard (turned off only to test the other layers).
    """
    workdir = tempfile.mkdtemp(prefix="rlkit-sandbox-")
    read_end, write_end = os.pipe()
    nonce = secrets.token_hex(16)
    config = {
        "workdir": os.path.realpath(workdir),
        "result_fd": write_end,
        "parent": os.getpid(),
        "namespaces": namespaces,
        "guard": guard,
        "cpu_s": max(1, int(-(-timeout_s // 1))),
        "memory_bytes": int(memory_mb) << 20,
        "max_processes": int(max_processes),
        "max_file_bytes": int(max_file_bytes),
        "env": {"PATH": "/usr/bin:/bin", "HOME": os.path.realpath(workdir), "LANG": "C.UTF-8"},
    }
    process = None
    try:
        process = subprocess.Popen(
            [sys.executable, "-I", "-B", "-c", _RUNNER, json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd=workdir,
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
            start_new_session=True,
            pass_fds=(write_end,),
        )
        os.close(write_end)
        write_end = -1
        return _supervise(process, read_end, nonce, solution, tests, timeout_s, max_output_bytes)
    finally:
        if process is not None:
            _kill_group(process)
        for fd in (read_end, write_end):
            if fd >= 0:
                os.close(fd)
        shutil.rmtree(workdir, onerror=_force_remove)


def _supervise(process, read_end, nonce, solution, tests, timeout_s, max_output_bytes) -> SandboxResult:
    deadline = time.monotonic() + timeout_s
    try:
        process.stdin.write(json.dumps({"nonce": nonce, "solution": solution, "tests": tests}).encode())
        process.stdin.close()
    except BrokenPipeError:
        pass
    output, result = bytearray(), bytearray()
    status = None
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ, output)
        selector.register(read_end, selectors.EVENT_READ, result)
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                status = "timeout"
                break
            for key, _ in selector.select(remaining):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                key.data.extend(chunk)
                if len(output) > max_output_bytes or len(result) > 4096:
                    status = "output_limit"
                    break
            if status:
                break
    if status is None:
        try:
            code = process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            status, code = "timeout", None
    else:
        code = None
    lines = bytes(result).decode(errors="replace").splitlines()
    try:
        layers = json.loads(lines[0]) if lines else []
    except ValueError:
        layers = []
    passed = status is None and code == 0 and nonce in lines[1:]
    if status is None:
        status = "passed" if passed else ("killed" if code is not None and (code < 0 or code > 128) else "failed")
    text = bytes(output[:max_output_bytes]).decode(errors="replace")
    return SandboxResult(passed=passed, status=status, exit_code=code, output=text, layers=layers)


def _kill_group(process: subprocess.Popen) -> None:
    """Kill the run and everything it started, and return once they are gone.

    With namespaces the runner's one child is PID 1 of the run's PID namespace: killing it makes
    the kernel kill every process in the namespace, and the runner's wait for it returns only after
    all of them are reaped. Then the process group goes (every process, without namespaces).
    """
    if process.poll() is None:
        for child in _children(process.pid):
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            process.wait(5.0)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)  # the leader is not reaped yet, so its id is not reused
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()
    for stream in (process.stdin, process.stdout):
        if stream is not None:
            stream.close()


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
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                children.append(int(entry))
    return children


def _force_remove(function, path, exc_info) -> None:
    """shutil.rmtree's error handler: a run may leave directories without write permission."""
    try:
        os.chmod(os.path.dirname(path), 0o700)
        os.chmod(path, 0o700)
        function(path)
    except OSError:
        pass


@functools.cache
def sandbox_layers() -> tuple[str, ...]:
    """The isolation layers a run gets on this machine (probed once, with a trivial run)."""
    result = run_python("", "", timeout_s=30.0)
    guard = ("python-guard",) if result.passed else ()
    return tuple(result.layers) + guard + ("wall-clock-kill", "clean-environment", "private-workdir")
