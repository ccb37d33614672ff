"""Grading untrusted Python: the solution runs in one sandboxed process, its tests in another.

The solution's process runs its code and then answers calls (``_sandbox_solution.py``); the grader's
process runs the tests (``_sandbox_grader.py``), where each function of the solution is a proxy that
sends the call's arguments across the process boundary and gets back its result as plain data
(numbers, strings, lists, tuples, sets, dicts, None: ``_plain_data.py``), decoded to built-in values;
stdin/stdout cases run the program on each input and compare its output text in the grader. The
tests, the grader's code, its frames and the pipe its verdict leaves by exist only in the grader's
process; nothing the solution does to its own interpreter (builtins, modules, ``sys``, signal handlers,
its exit status, what it prints) changes the verdict, and a value that is not plain data (e.g. one
whose ``__eq__`` always answers True) fails the test that asked for it. The verdict is a random nonce
that only the caller and the grader know.

Each process (``_sandbox_runner.py``) gets a new session, a throw-away working directory, an
environment holding nothing of the caller's, resource limits (CPU time, address space, processes,
file size, open files, no core dumps), no capabilities, no new privileges, and is not dumpable; its
output is read up to a cap, and after ``timeout_s`` of wall-clock time both are killed with all they
started. Where the kernel gives namespaces (root, or unprivileged user namespaces) each also gets its
own network namespace (no network), PID namespace (its processes die with it; the process the caller
started is outside it, so no zombie is left with the caller), mount namespace with a tmpfs as its
working directory (``max_disk_bytes`` and ``max_files`` in all, freed with the namespace), a private
/proc showing only its processes, and a read-only file system elsewhere. A Python audit hook
(``_sandbox_guard.py``) refuses processes, sockets, ``ctypes``, signals to other processes, symbolic
links and file changes outside the working directory; it is a tripwire, not a boundary (PEP 578).

A machine without these namespaces (e.g. an unprivileged Docker container) leaves the hook, the limits
and the separate grader as the only layers: ``run_python`` then raises ``SandboxUnavailable`` unless
called with ``weak=True``. Weak runs bound the files a run creates by counting them in the hook
(``max_files`` files of ``max_file_bytes`` each), and a solution that gets past the hook (C code, or
calls Python does not audit: ``os.mkfifo``, ``os.mknod``, ``signal.pidfd_send_signal``) runs as the
caller's user, able to reach its files and processes. ``sandbox_layers()`` lists what a machine
gives; ``RLKIT_SANDBOX_NAMESPACES=0`` makes runs skip the namespaces, as on such a machine.

Known limits: as real root (uid 0) the kernel does not enforce ``RLIMIT_NPROC``, so processes are
then bounded by the hook and the PID namespace's lifetime, not by a count. The solution sees the
arguments it is called with (as any function does), and names the tests take from the solution (e.g.
a helper that a HumanEval prompt defines and the tests use) are the solution's, as in HumanEval.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import selectors
import time
from dataclasses import dataclass, field
from pathlib import Path

from rlkit.rewards._sandbox_process import SandboxedProcess

_HERE = Path(__file__).parent
_PROGRAMS = {  # the text each sandboxed process runs (see _sandbox_runner.py)
    role: "\n".join(
        (_HERE / f"{part}.py").read_text(encoding="utf-8")
        for part in ("_plain_data", "_sandbox_guard", f"_sandbox_{role}", "_sandbox_runner")
    )
    for role in ("solution", "grader")
}

NAMESPACE_LAYERS = ("network-namespace", "pid-namespace", "workdir-tmpfs", "private-proc", "read-only-filesystem")
"""The layers a run needs unless ``weak=True`` (``CodeExecution(weak_sandbox=True)``)."""

_REPORT_LIMIT = 4096


class SandboxUnavailable(RuntimeError):
    """This machine does not give the sandbox the namespaces it needs (see ``NAMESPACE_LAYERS``)."""


@dataclass
class SandboxResult:
    """How a grade ended.

    Attributes:
        passed: the solution's code ran to its end and then the tests did, in the grader.
        status: ``"passed"``, ``"failed"`` (a failed test, an exception, a solution that exited or did
            not answer), ``"timeout"`` (wall clock), ``"output_limit"`` or ``"killed"`` (the solution's
            process ended by a signal before the grade: CPU time, memory).
        exit_code: the exit code of the solution's process if it had ended when the grade did (128 +
            the signal that killed it), else None.
        output: the first ``max_output_bytes`` of the solution's stdout and stderr (unbuffered: kept
            whatever happened next).
        tests_output: the first ``max_output_bytes`` of the grader's (e.g. the failed assertion).
        layers: the isolation layers the solution's process had.
    """

    passed: bool
    status: str
    exit_code: int | None
    output: str
    tests_output: str = ""
    layers: list[str] = field(default_factory=list)


def run_python(
    solution: str,
    tests: str | list[tuple[str, str]],
    timeout_s: float = 5.0,
    memory_mb: int = 1024,
    max_processes: int = 16,
    max_file_bytes: int = 1 << 20,
    max_disk_bytes: int = 1 << 24,
    max_files: int = 256,
    max_output_bytes: int = 1 << 16,
    weak: bool = False,
    namespaces: bool | None = None,
    guard: bool = True,
) -> SandboxResult:
    """Grade ``solution`` with ``tests``, each in its own sandboxed process.

    Args:
        solution: the code under test (a module: functions, or a program reading stdin).
        tests: Python that raises (e.g. a failed ``assert``) when the solution is wrong, calling the
            solution's functions by name; or ``(stdin, expected stdout)`` pairs.
        timeout_s: wall-clock limit of the whole grade; CPU time of each process is limited to the same
            number of seconds (rounded up).
        memory_mb: address-space limit of each process, in MiB.
        max_processes: ``RLIMIT_NPROC`` (not enforced by the kernel for real root).
        max_file_bytes: the largest file a process may write.
        max_disk_bytes: all the bytes the solution's files may hold together (its tmpfs's size).
        max_files: the most files and directories the solution may create.
        max_output_bytes: the solution's stdout and stderr beyond this end the grade as a failure (the
            grader's too).
        weak: accept a machine without the namespaces (the weaker layers only) instead of raising
            ``SandboxUnavailable``.
        namespaces: use Linux namespaces where the kernel allows; None reads ``RLKIT_SANDBOX_NAMESPACES``
            (``0``: skip them, as on a machine without them; default on).
        guard: install the Python audit hook in the solution's process (off only to test the other layers).
    """
    if namespaces is None:
        namespaces = os.environ.get("RLKIT_SANDBOX_NAMESPACES", "1") != "0"
    stdio = not isinstance(tests, str)
    config = {
        "namespaces": bool(namespaces),
        "required": [] if weak else list(NAMESPACE_LAYERS),
        "cpu_s": max(1, int(-(-timeout_s // 1))),
        "memory_bytes": int(memory_mb) << 20,
        "max_processes": int(max_processes),
        "max_file_bytes": int(max_file_bytes),
        "max_disk_bytes": int(max_disk_bytes),
        "max_files": int(max_files),
    }
    nonce = secrets.token_hex(16)
    to_solution_r, to_solution_w = os.pipe()
    to_grader_r, to_grader_w = os.pipe()
    processes: list[SandboxedProcess] = []
    deadline = time.monotonic() + timeout_s
    code = {"solution": solution, "mode": "stdio" if stdio else "call"}
    checks = {"cases": [list(case) for case in tests]} if stdio else {"tests": tests}
    try:
        for role, settings, payload, read_fd, write_fd in (
            ("solution", dict(config, guard=guard), code, to_solution_r, to_grader_w),
            ("grader", dict(config, guard=True), dict(checks, nonce=nonce), to_grader_r, to_solution_w),
        ):
            processes.append(SandboxedProcess(_PROGRAMS[role], settings, payload, read_fd, write_fd))
    except BaseException:
        _end(processes, deadline)
        raise
    finally:
        for fd in (to_solution_r, to_solution_w, to_grader_r, to_grader_w):
            os.close(fd)
    solution_process, grader_process = processes
    try:
        for process in processes:
            process.send_payload()
        status = _supervise(solution_process, grader_process, deadline, max_output_bytes)
        exit_code = solution_process.process.poll()
    finally:
        _end(processes, deadline)
    layers = _checked_layers(solution_process, grader_process, status, weak)
    passed = status is None and nonce in bytes(grader_process.report).decode(errors="replace").splitlines()[1:]
    if status is None:
        killed = exit_code is not None and (exit_code < 0 or exit_code > 128)
        status = "passed" if passed else ("killed" if killed else "failed")
    return SandboxResult(
        passed=passed,
        status=status,
        exit_code=exit_code,
        output=bytes(solution_process.output[:max_output_bytes]).decode(errors="replace"),
        tests_output=bytes(grader_process.output[:max_output_bytes]).decode(errors="replace"),
        layers=layers,
    )


def _checked_layers(solution, grader, status: str | None, weak: bool) -> list[str]:
    """The solution's layers; SandboxUnavailable when a process failed its own set-up (before any untrusted
    code ran) or, unless ``weak``, a process lacked a layer of ``NAMESPACE_LAYERS``."""
    reported = {"solution": _layers(solution), "grader": _layers(grader)}
    for role, process in (("solution", solution), ("grader", grader)):
        if reported[role] is None and status is None:
            output = bytes(process.output[-2000:]).decode(errors="replace").strip()
            raise SandboxUnavailable(
                f"the sandbox's {role} process ended while it was being set up: {output or 'no output'}"
            )
    found = [layers for layers in reported.values() if layers is not None]  # None: it ended early, or timed out
    missing = [name for name in NAMESPACE_LAYERS if any(name not in layers for layers in found)]
    layers = reported["solution"] or []
    if missing and not weak:
        raise SandboxUnavailable(
            f"the code sandbox gets no {', '.join(missing)} on this machine (the kernel or container refuses "
            f"the Linux namespaces it is built on; it has only: {', '.join(layers) or 'nothing'}). Run where "
            f"user namespaces are allowed, or accept the weaker sandbox with weak=True "
            f"(CodeExecution(weak_sandbox=True))."
        )
    return layers


def _supervise(solution, grader, deadline: float, max_output_bytes: int) -> str | None:
    """Read both processes until the grader's report pipe closes (it is done); a status if it ended otherwise."""
    with selectors.DefaultSelector() as selector:
        for process in (solution, grader):
            selector.register(process.process.stdout, selectors.EVENT_READ, process.output)
            selector.register(process.report_fd, selectors.EVENT_READ, process.report)
        while grader.report_fd in {key.fd for key in selector.get_map().values()}:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return "timeout"
            for key, _ in selector.select(remaining):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                key.data.extend(chunk)
                if len(solution.output) > max_output_bytes or len(grader.output) > max_output_bytes:
                    return "output_limit"
                if len(solution.report) > _REPORT_LIMIT or len(grader.report) > _REPORT_LIMIT:
                    return "failed"
    return None


def _end(processes: list[SandboxedProcess], deadline: float) -> None:
    """Kill both processes, keep what they printed before, and remove their files (a few seconds at most
    past ``deadline``)."""
    for process in processes:
        process.kill()
    for process in processes:
        _drain(process)
        process.close(max(deadline, time.monotonic()) + 5.0)


def _drain(process: SandboxedProcess) -> None:
    """Read what a killed process left in its pipes (all its writers are gone, so EOF comes at once)."""
    for fd, buffer in ((process.process.stdout.fileno(), process.output), (process.report_fd, process.report)):
        os.set_blocking(fd, False)
        while len(buffer) <= 1 << 20:
            try:
                chunk = os.read(fd, 1 << 16)
            except (BlockingIOError, OSError):
                break
            if not chunk:
                break
            buffer.extend(chunk)


def _layers(process: SandboxedProcess) -> list[str] | None:
    """The layers a process reported; None if it ended before it got so far."""
    lines = bytes(process.report).decode(errors="replace").splitlines()
    try:
        return list(json.loads(lines[0])) if lines else None
    except ValueError:
        return None


def missing_layers(layers) -> list[str]:
    """The layers of ``NAMESPACE_LAYERS`` that ``layers`` lacks."""
    return [name for name in NAMESPACE_LAYERS if name not in layers]


def sandbox_layers(namespaces: bool | None = None) -> tuple[str, ...]:
    """The isolation layers a run gets on this machine (probed once per setting, with a trivial run);
    ``namespaces`` as in ``run_python``."""
    if namespaces is None:
        namespaces = os.environ.get("RLKIT_SANDBOX_NAMESPACES", "1") != "0"
    return _probe(bool(namespaces))


@functools.cache
def _probe(namespaces: bool) -> tuple[str, ...]:
    result = run_python("", "", timeout_s=30.0, weak=True, namespaces=namespaces)
    guard = ("python-guard",) if result.passed else ()
    return tuple(result.layers) + guard + ("separate-grader", "wall-clock-kill", "clean-environment", "private-workdir")
