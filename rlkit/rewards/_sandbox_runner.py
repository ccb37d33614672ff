"""The lock-down every sandboxed process goes through, then its role (``serve``: the solution's or the
grader's side). ``sandbox.py`` runs ``python -I -S -B -u -c <program> <config>``, where the program is
``_plain_data.py``, ``_sandbox_guard.py``, one role file and this file, joined: ``Channel``,
``install_guard`` and ``serve`` come from the parts before this one. Standard library only.

Order: read the payload from stdin; ask to die with the caller; where the kernel allows and the
caller asks, enter new mount, network and PID namespaces (and a user namespace when not root); fork.
The parent stays behind as a keeper that only waits: it is the process the caller started, and with
namespaces it is outside the PID namespace and the child's session, so the sandbox can neither see
nor signal it, and it exits (reaped by the caller) after its child, leaving no zombie with the caller.
Without namespaces it is the child subreaper of the sandbox and kills what the sandbox left running.
The child starts a new session; with namespaces it is PID 1 of the new PID namespace (every process
it starts dies with it) and mounts a tmpfs of ``max_disk_bytes`` and ``max_files`` on the working
directory (freed with the namespace: nothing reaches the caller's disk), a fresh /proc, a /dev of
null/zero/random/urandom, and remounts everything else read-only. Then: resource limits, no
capabilities, no new privileges, not dumpable (no ptrace, no /proc/<pid>/mem of it); it reports its
layers to the caller on ``report_fd``, stops there if one the caller requires is missing, installs
the audit-hook guard and serves its role.
"""

import json
import os
import resource
import select
import signal
import sys


def main():
    config = json.loads(sys.argv[1])
    payload = json.loads(sys.stdin.buffer.read())
    sys.path.extend(config["path"])  # site-packages, without running their .pth files
    null = os.open("/dev/null", os.O_RDWR)
    os.dup2(null, 0)
    os.close(null)
    workdir, report = config["workdir"], config["report_fd"]
    layers = []
    libc = _libc()
    if libc is not None:
        _die_with_parent(libc, config["parent"])
    namespaces = config["namespaces"] and libc is not None and _unshare(libc, layers)
    _fork_keeper(libc, namespaces, keep=(config["read_fd"], config["write_fd"], report))
    if namespaces:
        _mount_private(libc, config, layers)
    _set_limits(config)
    layers.append("rlimits")
    if libc is not None:
        _drop_privileges(libc, layers)
    os.chdir(workdir)
    os.environ.clear()
    os.environ.update(config["env"])
    os.write(report, (json.dumps(layers) + "\n").encode())
    if any(name not in layers for name in config["required"]):
        os._exit(126)  # the caller names what is missing
    del libc
    channel = Channel(config["read_fd"], config["write_fd"])  # noqa: F821 (from _plain_data.py)
    if config["guard"]:
        install_guard(workdir, None if namespaces else config["max_files"])  # noqa: F821 (_sandbox_guard.py)
    try:
        code = serve(payload, channel, report)  # noqa: F821 (from the role file)
    except BaseException:  # SystemExit too: exiting is not passing
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    os._exit(code)


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


PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER = 1, 4, 36


def _die_with_parent(libc, parent):
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(125)


CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x20000, 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 32, 4096, 16384, 1 << 18, 1 << 21
MS_NOATIME, MS_NODIRATIME = 1024, 2048
MNT_DETACH = 2


def _unshare(libc, layers):
    """New mount, network and PID namespaces (and user, when not root); False where the kernel refuses."""
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | (CLONE_NEWUSER if uid != 0 else 0)) != 0:
        return False
    if uid != 0:
        for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
        layers.append("user-namespace")
    layers += ["network-namespace", "pid-namespace"]
    return True


def _fork_keeper(libc, namespaces, keep):
    """Fork; the parent becomes the keeper (it never returns), the child goes on into a new session."""
    if not namespaces and libc is not None:
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # the sandbox's orphans come back to the keeper
    alive_r, alive_w = os.pipe()  # closes when the keeper dies, however it dies
    child = os.fork()
    if child:
        for fd in keep + (alive_r,):
            os.close(fd)  # the sandbox's ends of its pipes: they report EOF when the sandbox ends
        _keep(child)
    os.close(alive_w)
    os.setsid()  # out of the keeper's process group: kill(0, ...) does not reach it
    if libc is not None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if select.select([alive_r], [], [], 0)[0]:  # it died before the request took effect
            os._exit(125)
    os.close(alive_r)


def _keep(child):
    """Wait for the sandbox; kill and reap whatever it left running (its orphans come here); exit with
    its status (128 + the signal that killed it)."""
    code = None
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        if pid == child:
            code = os.waitstatus_to_exitcode(status)
        if code is not None:
            try:
                with open(f"/proc/self/task/{os.getpid()}/children") as f:
                    left = [int(p) for p in f.read().split()]
            except OSError:
                left = []
            for p in left:
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    os._exit(code if code >= 0 else 128 - code)


def _mount_private(libc, config, layers):
    """In the new mount namespace: the working directory a tmpfs, a fresh /proc, every other mount read-only."""
    workdir = config["workdir"]
    if libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        return  # without private propagation, mounts are not attempted
    size = f"size={config['max_disk_bytes']},nr_inodes={config['max_files'] + 1},mode=700".encode()
    if libc.mount(b"tmpfs", workdir.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, size) == 0:
        layers.append("workdir-tmpfs")
    elif libc.mount(workdir.encode(), workdir.encode(), None, MS_BIND, None) != 0:
        return  # the working directory must be a mount point to stay writable below
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
    """No capabilities, none regained by exec or set-uid files (root in a namespace, or real root); not
    dumpable, so a process of the same user without CAP_SYS_PTRACE cannot read or trace this one."""
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
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) == 0:
        layers.append("not-dumpable")
    sys.modules.pop("ctypes", None)
    sys.modules.pop("_ctypes", None)


main()
