"""Problems and hostile completions shared by the CodeExecution tests.

Each attack on the grade is written to *pass* its tests exactly when the attack works (a wrong
``add``, or no answer at all, that a fooled grader would pass), so a 0 score means it failed.
"""

import secrets

from rlkit.data.prompts import Prompt
from rlkit.rewards import CodeExecution, RewardScorer

TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"
GOOD = "def add(a, b):\n    return a + b\n"
WRONG = "def add(a, b):\n    return 0\n"


def problem(tests=TESTS, **meta):
    return Prompt("Write add(a, b).", ground_truth=tests, meta=meta)


def reward(**kwargs):
    return CodeExecution(timeout_s=kwargs.pop("timeout_s", 2.0), **kwargs)


def score(completions, prompts, workers=0, **limits):
    """The scores of ``completions`` through a RewardScorer (``reward_on_error=raise``, as by default in
    training: a reward call that raises stops the test)."""
    scorer = RewardScorer([reward(**limits)], timeout_s=30.0, workers=workers)
    try:
        total, _ = scorer.score(completions, prompts, [1] * len(completions))
    finally:
        scorer.close()
    return total.tolist()


# --- attacks on the grade --------------------------------------------------------------------------

ALWAYS_EQUAL = """
class Anything(int):
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
    __hash__ = int.__hash__

def add(a, b):
    return Anything(0)
"""

ALWAYS_EQUAL_OBJECT = """
class Anything:
    def __eq__(self, other):
        return True

def add(a, b):
    return Anything()
"""

PATCH_THE_GRADER = """
import builtins, sys
real_compile = builtins.compile
builtins.compile = lambda source, filename, mode, *a, **k: real_compile("pass", filename, mode)
builtins.AssertionError = type("Never", (Exception,), {})
words = ("test", "check", "grade", "verdict", "report", "serve", "ask", "decode", "receive", "exec", "run")
for module in list(sys.modules.values()):
    for name, value in list(vars(module).items()):
        if callable(value) and any(word in name.lower() for word in words):
            try:
                setattr(module, name, lambda *a, **k: True)
            except Exception:
                pass
sys.excepthook = lambda *a: None

def add(a, b):
    return 0
"""

# Every 32-hex-digit string in any frame's locals and globals (a pass token) goes to every descriptor,
# then the process exits with status 0.
FRAME_WALK = """
import os, re, sys
tokens = set()
frame = sys._getframe()
while frame is not None:
    for scope in (frame.f_locals, frame.f_globals):
        for value in list(scope.values()):
            for item in (list(value.values()) if isinstance(value, dict) else [value]):
                if isinstance(item, str) and re.fullmatch("[0-9a-f]{32}", item):
                    tokens.add(item)
    frame = frame.f_back
for fd in range(3, 64):
    for token in tokens or {"0" * 32}:
        try:
            os.write(fd, ("\\n" + token + "\\n").encode())
        except OSError:
            pass
os._exit(0)
"""

# Looks for the tests' expected answer (a "tok-" token) in the frames, the garbage collector's objects,
# /proc (every process's command line, environment and open files) and the files under /tmp and its
# working directory, and
# returns what it finds.
READ_THE_TESTS = """
import gc, os, re, sys
found = []
def look(value):
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    if isinstance(value, str):
        found.extend(re.findall("tok-[0-9a-f]{32}", value))
frame = sys._getframe()
while frame is not None:
    for scope in (frame.f_locals, frame.f_globals):
        for value in list(scope.values()):
            for item in (list(value.values()) if isinstance(value, dict) else [value]):
                look(item)
    frame = frame.f_back
try:
    for obj in gc.get_objects():
        if obj is not found and isinstance(obj, (dict, list, tuple)):
            for item in list(obj.values() if isinstance(obj, dict) else obj):
                look(item)
except Exception:
    pass
def read(path):
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            return os.read(fd, 1 << 20)
        finally:
            os.close(fd)
    except Exception:
        return b""
for pid in os.listdir("/proc"):
    if pid.isdigit() or pid == "self":
        for name in ("cmdline", "environ"):
            look(read(f"/proc/{pid}/{name}"))
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                look(read(f"/proc/{pid}/fd/{fd}"))
        except Exception:
            pass
folders = ["/tmp", os.getcwd()]
for folder in folders[:100]:
    try:
        for entry in list(os.scandir(folder))[:100]:
            if entry.is_dir(follow_symlinks=False):
                folders.append(entry.path)
            else:
                look(read(entry.path))
    except Exception:
        pass

def secret():
    return found[0] if found else None
"""


def secret_problem() -> tuple[Prompt, str]:
    """A problem whose only test expects a fresh random token, and that token."""
    token = "tok-" + secrets.token_hex(16)
    return problem(f"assert secret() == {token!r}\n"), token


# --- runs that must fail without stopping anything ---------------------------------------------------

DEEP_TREE = """
def add(a, b):
    return 0

import os
for _ in range(1500):
    os.mkdir("d")
    os.chdir("d")
"""

# Directories without permissions, a file in a directory that cannot be written: clean-up must cope.
PERMISSION_GAMES = """
def add(a, b):
    return 0

import os
os.makedirs("a/b/c")
open("a/b/c/f", "w").write("x")
open("a/b/g", "w").write("x")
for path in ("a/b/c", "a/b", "a"):
    os.chmod(path, 0)
"""

CRASH = WRONG + "import os\nos.abort()\n"

# Files of 512 KiB until a write fails; prints how many bytes it wrote, then fails.
FILL_THE_DISK = """
def add(a, b):
    return 0

written = 0
try:
    for i in range(10_000):
        with open(f"f{i}", "wb") as f:
            for _ in range(8):
                f.write(b"x" * 65536)
                f.flush()
                written += 65536
except OSError as error:
    print("stopped after", written, "bytes:", error)
raise SystemExit(1)
"""


# --- escapes that only the Python guard stands against (no namespaces) -------------------------------


def dir_fd_escape(folder: str, name: str) -> str:
    """Open a directory outside the working directory, then create ``name`` relative to its descriptor."""
    return f"""
import os
fd = os.open({folder!r}, os.O_RDONLY)
os.close(os.open({name!r}, os.O_WRONLY | os.O_CREAT, dir_fd=fd))
"""


def dot_dot_escape(name: str) -> str:
    """Create ``../name`` relative to the working directory's descriptor, from a deeper working directory
    (so that the same path, read from the current directory, is inside)."""
    return f"""
import os
fd = os.open(".", os.O_RDONLY)
os.makedirs("a/b")
os.chdir("a/b")
os.close(os.open("../" + {name!r}, os.O_WRONLY | os.O_CREAT, dir_fd=fd))
"""


def symlink_escape(folder: str, name: str) -> str:
    """A link in the working directory to ``folder``, made from a directory deep enough that its target,
    read from there, is inside; then ``name`` is created through it, by descriptor and by path."""
    return f"""
import os
top = os.getcwd()
depth = top.count("/")
os.makedirs("/".join(["d"] * depth))
os.chdir("/".join(["d"] * depth))
os.symlink("../" * depth + {folder!r}.lstrip("/"), top + "/link")
try:
    fd = os.open(top + "/link", os.O_RDONLY)
    os.close(os.open({name!r}, os.O_WRONLY | os.O_CREAT, dir_fd=fd))
except OSError:
    open(top + "/link/" + {name!r}, "w").close()
"""


# A process of this user, without capabilities (as any process of an unprivileged user), holding a secret
# in its environment: what a solution without namespaces must not read.
VICTIM = """
import ctypes, time
libc = ctypes.CDLL(None)
libc.capset((ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)())
libc.prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE
print("ready", flush=True)
time.sleep(60)
"""

PROC_ENVIRON = """
import os
found = False
for pid in os.listdir("/proc"):
    if pid.isdigit():
        try:
            found = found or b"hunter2-secret" in open(f"/proc/self/../{pid}/environ", "rb").read()
        except OSError:
            pass
print("found" if found else "not found")
assert found
"""

# Signals its parent and its process group; then answers wrongly.
KILL_THE_PARENT = """
def add(a, b):
    return 0

import os, signal
for target in (os.getppid(), 0):
    try:
        os.kill(target, signal.SIGKILL)
    except OSError:
        pass
"""
