"""The first code a sandboxed run executes (``python -I -c <this file's text> <config>``): it locks the
process down, then runs the solution and its tests. Standard library only; see ``sandbox.py``.

Order: read the payload from stdin; ask to die with the parent; enter new user (when not root),
mount, network and PID namespaces where the kernel allows; as PID 1 of the new PID namespace mount
a fresh /proc, remount every file system read-only except the working directory, replace /dev by a
tmpfs holding null/zero/random/urandom; set resource limits; drop capabilities and forbid new
privileges; install the Python audit-hook guard; run the solution, then the tests, each compiled
on its own. Only when both return does it write the nonce (a random token the solution is not
given) to the result pipe: a solution that exits early, with any status, fails.
"""

import builtins
import json
import os
import resource
import select
import signal
import sys


def main():
    config = json.loads(sys.argv[1])
    payload = json.loads(sys.stdin.buffer.read())
    null = os.open("/dev/null", os.O_RDWR)
    os.dup2(null, 0)
    os.close(null)
    workdir, result_fd = config["workdir"], config["result_fd"]
    layers = []
    libc = _libc()
    if libc is not None:
        _die_with_parent(libc, config["parent"])
        if config["namespaces"]:
            _enter_namespaces(libc, workdir, layers)
    _set_limits(config)
    layers.append("rlimits")
    if libc is not None:
        _drop_privileges(libc, layers)
    os.chdir(workdir)
    os.environ.clear()
    os.environ.update(config["env"])
    os.write(result_fd, (json.dumps(layers) + "\n").encode())
    nonce = payload["nonce"]
    del libc
    run, write, exit_ = exec, os.write, os._exit  # bound now: the solution may replace the originals
    pristine = dict(builtins.__dict__)
    if config["guard"]:
        _install_guard(workdir)
    namespace = {"__name__": "__main__", "__builtins__": dict(pristine)}
    try:
        run(compile(payload["solution"], "solution.py", "exec"), namespace)
        namespace["__builtins__"] = dict(pristine)  # the tests see builtins the solution did not touch
        run(compile(payload["tests"], "tests.py", "exec"), namespace)
    except BaseException:  # SystemExit too: exiting is not passing
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        exit_(1)
    sys.stdout.flush()
    write(result_fd, ("\n" + nonce + "\n").encode())
    exit_(0)


def _libc():
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]
        libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
        libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        return libc
    except (OSError, AttributeError, ImportError):
        return None


def _die_with_parent(libc, parent):
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(125)


CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x20000, 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 32, 4096, 16384, 1 << 18, 1 << 21
MS_NOATIME, MS_NODIRATIME = 1024, 2048
MNT_DETACH = 2


def _enter_namespaces(libc, workdir, layers):
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | (CLONE_NEWUSER if uid != 0 else 0)
    if libc.unshare(flags) != 0:
        return
    if uid != 0:
        for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
        layers.append("user-namespace")
    layers += ["network-namespace", "pid-namespace"]
    alive_r, alive_w = os.pipe()  # closes when the outer process dies, however it dies
    child = os.fork()  # the child is PID 1 of the new PID namespace: when it dies, every process in it dies
    if child:
        os.close(alive_r)
        _, status = os.waitpid(child, 0)
        code = os.waitstatus_to_exitcode(status)
        os._exit(code if code >= 0 else 128 - code)
    os.close(alive_w)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: die with the outer process
    if select.select([alive_r], [], [], 0)[0]:  # it died before the request took effect
        os._exit(125)
    os.close(alive_r)
    if libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        return  # without private propagation, remounts are not attempted
    if libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None) == 0:
        layers.append("private-proc")
    if _read_only_except(libc, workdir):
        layers.append("read-only-filesystem")


def _read_only_except(libc, workdir):
    """Every mount read-only, no devices or set-uid, except ``workdir``; /dev holds null/zero/random/urandom."""
    keep = os.path.join(workdir, ".dev")
    os.mkdir(keep)
    ok = libc.mount(b"/dev", keep.encode(), None, MS_BIND | MS_REC, None) == 0
    ok = ok and libc.mount(b"tmpfs", b"/dev", b"tmpfs", MS_NOSUID | MS_NOEXEC, b"size=64k,mode=755") == 0
    for name in ("null", "zero", "random", "urandom"):
        path = f"/dev/{name}"
        if ok:
            open(path, "w").close()
            ok = libc.mount(f"{keep}/{name}".encode(), path.encode(), None, MS_BIND, None) == 0
    ok = ok and libc.umount2(keep.encode(), MNT_DETACH) == 0
    os.rmdir(keep)
    ok = ok and libc.mount(workdir.encode(), workdir.encode(), None, MS_BIND, None) == 0
    if not ok:
        return False
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4].encode().decode("unicode_escape") for line in f]
    devices = {f"/dev/{name}" for name in ("null", "zero", "random", "urandom")}
    for point in points:
        if point in devices:
            continue  # device nodes: writable, on a mount that allows devices
        try:
            flags = os.statvfs(point).f_flag
        except OSError:  # hidden under another mount (the old /dev's submounts)
            continue
        # A remount in a user namespace must keep the flags that were locked when it was copied.
        locked = flags & (MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_NOATIME | MS_NODIRATIME)
        locked |= MS_RELATIME if flags & 4096 else 0  # ST_RELATIME
        wanted = MS_NOSUID | (0 if point == "/dev" else MS_NODEV) | (0 if point == workdir else MS_RDONLY)
        if libc.mount(None, point.encode(), None, MS_REMOUNT | MS_BIND | locked | wanted, None) != 0:
            ok = False
    return ok


def _set_limits(config):
    cpu = int(config["cpu_s"])
    limits = (
        (resource.RLIMIT_CPU, cpu, cpu + 1),  # SIGXCPU at the soft limit, SIGKILL one second later
        (resource.RLIMIT_AS, config["memory_bytes"], config["memory_bytes"]),
        (resource.RLIMIT_NPROC, config["max_processes"], config["max_processes"]),
        (resource.RLIMIT_FSIZE, config["max_file_bytes"], config["max_file_bytes"]),
        (resource.RLIMIT_NOFILE, 64, 64),
        (resource.RLIMIT_CORE, 0, 0),
    )
    for which, soft, hard in limits:
        resource.setrlimit(which, (soft, hard))


def _drop_privileges(libc, layers):
    """No capabilities, none regained by exec or set-uid files (root in a namespace, or real root)."""
    import ctypes

    # SECBIT_NOROOT | _LOCKED | SECBIT_NO_SETUID_FIXUP | _LOCKED | SECBIT_KEEP_CAPS_LOCKED
    libc.prctl(28, 0x1 | 0x2 | 0x4 | 0x8 | 0x20, 0, 0, 0)
    for cap in range(64):
        libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP (fails harmlessly without CAP_SETPCAP)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable: all empty
    if libc.capset(header, data) == 0:
        layers.append("no-capabilities")
    if libc.prctl(38, 1, 0, 0, 0) == 0:  # PR_SET_NO_NEW_PRIVS
        layers.append("no-new-privileges")
    sys.modules.pop("ctypes", None)
    sys.modules.pop("_ctypes", None)


def _install_guard(workdir):
    """A Python audit hook refusing processes, sockets, ctypes, writes outside ``workdir``, reading other
    processes and signalling them. It is a tripwire, not a boundary (PEP 578): the namespaces and
    limits above are what hold when it is bypassed."""
    blocked = frozenset(
        {
            "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "subprocess.Popen",
            "pty.spawn", "socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo",
            "socket.gethostbyname", "socket.sendto", "socket.sendmsg", "signal.pthread_kill", "os.chroot",
        }
    )  # fmt: skip
    modules = frozenset({"ctypes", "_ctypes", "cffi", "_posixsubprocess", "_testcapi", "_testinternalcapi"})
    paths = frozenset(
        {
            "os.remove", "os.rmdir", "os.rename", "os.mkdir", "os.symlink", "os.link", "os.chmod", "os.chown",
            "os.truncate", "os.utime", "shutil.rmtree", "os.chflags", "os.lchflags", "os.mkfifo", "os.mknod",
        }
    )  # fmt: skip
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
    realpath, getpid, fspath = os.path.realpath, os.getpid, os.fspath
    root = workdir.rstrip("/") + "/"

    def inside(path):
        try:
            path = fspath(path)
        except TypeError:
            return True  # a file descriptor: already open
        if isinstance(path, bytes):
            path = path.decode(errors="replace")
        full = realpath(path)
        return full + "/" == root or full.startswith(root) or full == "/dev/null"

    def deny(event, detail=""):
        raise PermissionError(f"sandbox: {event} is not allowed{detail}")

    def guard(event, args):
        if event in blocked or event.startswith("ctypes."):
            deny(event)
        elif event == "import" and args[0].split(".")[0] in modules:
            deny(event, f" for {args[0]}")
        elif event in ("os.kill", "os.killpg") and args[0] not in (getpid(), 0):
            deny(event)
        elif event == "open":
            path, mode, flags = args
            if isinstance(path, int):
                return
            writing = (isinstance(flags, int) and flags & write_flags) or (
                isinstance(mode, str) and any(c in mode for c in "wax+")
            )
            if writing and not inside(path):
                deny("writing", f" outside the working directory: {path!r}")
            text = path.decode(errors="replace") if isinstance(path, bytes) else str(path)
            if text.startswith("/proc/"):
                part = text.split("/")[2]
                if part.isdigit() and int(part) != getpid():
                    deny("reading other processes")
        elif event in paths:
            for arg in args[:2]:
                if isinstance(arg, str | bytes | os.PathLike) and not inside(arg):
                    deny(event, f" outside the working directory: {arg!r}")

    sys.addaudithook(guard)


main()
