"""Every failure is a 0, never a stopped run, and leaves nothing behind: deep directory trees, permission
games, crashes, a full disk, a solution that signals its parent; and without namespaces (forced with
RLKIT_SANDBOX_NAMESPACES=0) CodeExecution refuses to start unless told to accept the weaker sandbox, in
which the escapes that used to reach the caller's files and processes fail. Scores go through a
RewardScorer with ``reward_on_error=raise`` (training's default), in this process and in workers."""

import ctypes
import glob
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from code_fixtures import (
    CRASH,
    DEEP_TREE,
    FILL_THE_DISK,
    GOOD,
    KILL_THE_PARENT,
    PERMISSION_GAMES,
    PROC_ENVIRON,
    READ_THE_TESTS,
    TESTS,
    VICTIM,
    WRONG,
    dir_fd_escape,
    dot_dot_escape,
    problem,
    reward,
    score,
    secret_problem,
    symlink_escape,
)

from rlkit.errors import ConfigError
from rlkit.rewards._sandbox_process import remove_tree
from rlkit.rewards.sandbox import SandboxUnavailable, missing_layers, run_python, sandbox_layers

needs_namespaces = pytest.mark.skipif(
    bool(missing_layers(sandbox_layers(namespaces=True))),
    reason=f"this kernel/container gives the sandbox no namespaces (layers: {sandbox_layers(namespaces=True)})",
)


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    """The temporary directory of this process and of reward workers started now; it must be empty at
    the end. Without namespaces (``weak`` first) it is on a tmpfs where there is one: there the sandbox's
    files are on it, and a deep tree is slow to remove from a disk."""
    weak = os.environ.get("RLKIT_SANDBOX_NAMESPACES") == "0" and os.path.isdir("/dev/shm")
    folder = tempfile.mkdtemp(dir="/dev/shm") if weak else str(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", folder)
    monkeypatch.setenv("TMPDIR", folder)
    yield folder
    left = sorted(os.listdir(folder))
    remove_tree(folder, time.monotonic() + 30)
    assert left == []


@pytest.fixture
def weak(monkeypatch):
    """Runs without namespaces, as in a container that refuses them."""
    monkeypatch.setenv("RLKIT_SANDBOX_NAMESPACES", "0")


# --- with the machine's namespaces ---------------------------------------------------------------------

FAILURES = [DEEP_TREE, PERMISSION_GAMES, CRASH]


@needs_namespaces
def test_failures_score_zero_and_leave_nothing(scratch):
    assert score(FAILURES + [GOOD], [problem()] * 4, max_files=4000) == [0.0, 0.0, 0.0, 1.0]
    assert score(FAILURES + [GOOD], [problem()] * 4, workers=1, max_files=4000) == [0.0, 0.0, 0.0, 1.0]


@needs_namespaces
def test_the_disk_quota_holds_and_the_output_survives_the_failure():
    result = run_python(FILL_THE_DISK, TESTS, max_disk_bytes=2 << 20, max_file_bytes=1 << 20)
    assert not result.passed
    written = int(result.output.split("stopped after ")[1].split()[0])
    assert written <= 2 << 20 and "No space left on device" in result.output
    result = run_python(FILL_THE_DISK, TESTS, max_files=3)
    assert not result.passed and int(result.output.split("stopped after ")[1].split()[0]) <= 3 << 19


def _children() -> set[int]:
    found = set()
    for path in glob.glob("/proc/self/task/*/children"):
        with open(path) as f:
            found |= {int(pid) for pid in f.read().split()}
    return found


@pytest.fixture
def subreaper():
    """Make this process a child subreaper (as a container's PID 1 is): orphans come here."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(36, 1, 0, 0, 0) != 0:  # PR_SET_CHILD_SUBREAPER
        pytest.skip("PR_SET_CHILD_SUBREAPER is not available")
    before = _children()
    yield before
    libc.prctl(36, 0, 0, 0, 0)
    for pid in _children() - before:  # reap what a failing test left, so that no zombie outlives it
        os.waitpid(pid, 0)


@needs_namespaces
@pytest.mark.parametrize("guard", [True, False], ids=["guard", "no-guard"])
def test_a_solution_that_signals_its_parent_leaves_no_zombie_with_the_caller(subreaper, guard):
    result = run_python(KILL_THE_PARENT, TESTS, guard=guard)
    assert not result.passed
    time.sleep(0.1)
    assert _children() - subreaper == set()


def test_removing_a_tree_deeper_than_the_recursion_limit(weak, scratch):
    outside = Path(scratch) / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    tree = Path(scratch) / "tree"
    os.mkdir(tree)
    fd = os.open(tree, os.O_RDONLY)
    for _ in range(sys.getrecursionlimit() + 500):
        os.mkdir("d", dir_fd=fd)
        child = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = child
    with open(os.open("f", os.O_WRONLY | os.O_CREAT, dir_fd=fd), "w") as f:
        f.write("x")
    os.symlink(outside, "link", dir_fd=fd)
    os.chmod(fd, 0o500)  # no write permission: its entries cannot be removed until it gets it back
    os.close(fd)
    os.chmod(tree / "d", 0)
    assert remove_tree(str(tree), time.monotonic() + 30)
    assert not tree.exists() and (outside / "keep.txt").read_text() == "keep"
    remove_tree(str(outside), time.monotonic() + 5)


# --- without namespaces ---------------------------------------------------------------------------------


def test_code_execution_refuses_a_machine_without_namespaces(weak):
    with pytest.raises(ConfigError) as caught:
        reward()
    message = str(caught.value)
    assert "\n" not in message and "network-namespace" in message and "weak_sandbox=true" in message
    with pytest.raises(SandboxUnavailable, match="weak=True"):
        run_python(GOOD, TESTS)
    assert reward(weak_sandbox=True)(GOOD, problem()) == 1.0
    assert reward(weak_sandbox=True)(WRONG, problem()) == 0.0


def test_without_namespaces_failures_score_zero_and_leave_nothing(weak, scratch):
    prompts = [problem()] * 4
    assert score(FAILURES + [GOOD], prompts, weak_sandbox=True, max_files=4000) == [0.0, 0.0, 0.0, 1.0]


def test_without_namespaces_the_file_count_bounds_the_disk(weak, scratch):
    result = run_python(FILL_THE_DISK, TESTS, max_files=3, weak=True)
    assert not result.passed and "more than 3 files" in result.output
    assert int(result.output.split("stopped after ")[1].split()[0]) <= 3 << 19


@pytest.fixture
def victim():
    """A process of this user, without capabilities, with a secret in its environment."""
    process = subprocess.Popen(
        [sys.executable, "-c", VICTIM], env={"RLKIT_TEST_SECRET": "hunter2-secret"}, stdout=subprocess.PIPE
    )
    process.stdout.readline()
    yield process
    process.kill()
    process.wait()
    process.stdout.close()


def test_without_namespaces_escapes_fail(weak, scratch, victim, subreaper):
    # each of these wrote to /tmp or /dev/shm, or read the victim's environment, through the old guard
    name = f"rlkit-escape-{uuid.uuid4().hex}"
    attacks = [
        dir_fd_escape(scratch, name),
        dir_fd_escape("/dev/shm", name),
        dot_dot_escape(name),
        symlink_escape(scratch, name),
        symlink_escape("/dev/shm", name),
        PROC_ENVIRON,
        KILL_THE_PARENT,
    ]
    prompt, _ = secret_problem()
    try:
        here = score(attacks + [READ_THE_TESTS], [problem("pass\n")] * len(attacks) + [prompt], weak_sandbox=True)
        workers = score(attacks, [problem("pass\n")] * len(attacks), workers=1, weak_sandbox=True)
        assert here == [0.0] * (len(attacks) + 1) and workers == [0.0] * len(attacks)
        assert not os.path.exists(f"/dev/shm/{name}") and victim.poll() is None
    finally:
        for path in glob.glob(f"/dev/shm/{name}*"):
            os.remove(path)
    time.sleep(0.1)
    assert _children() - subreaper == set()
