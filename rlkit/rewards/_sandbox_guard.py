"""The Python audit hook of a sandboxed process (PEP 578): a tripwire, not a boundary.

Part of the programs that run inside the sandbox (``sandbox.py`` joins the files into one ``python -c``
text); standard library only. Where the kernel gives namespaces, the read-only file system, the private
/proc and the missing network are what contain a run, and this hook only fails early what they would
refuse. Where it gives none (``weak`` runs) the hook is the only layer between the solution and the
caller's user, and what it does not see (C code, system calls Python does not audit) it cannot stop.

What it refuses: processes (fork, exec, spawn, ``os.system``), sockets, ``ctypes`` and other C-level
modules, signals to other processes, symbolic links, the garbage collector's object lists, other
threads' frames, and these file operations:

- any path with a ``..`` component, and paths that are not ``str`` or ``bytes``;
- writing, creating, removing, renaming or changing anything outside the working directory, or through
  a symbolic link inside it: each component below the working directory is ``lstat``-ed in turn and
  must be a real directory, the last must not be a link;
- opening a directory outside the working directory (so no directory descriptor outside it exists to
  resolve a relative path against), and reading ``/proc/<pid>`` of another process (links resolved);
- with ``max_files``, creating more than that many files and directories.

With no links inside the working directory, no ``..`` and no directory descriptor outside it, a
relative path (whatever directory descriptor it is resolved against) stays inside the working
directory. The hook uses only values bound when it is installed (not ``os``, ``stat`` or ``builtins``
as they are when it runs) and defines no other function, so the solution cannot change what it calls.
"""

import itertools
import os
import stat


def install_guard(workdir: str, max_files: int | None) -> None:
    """Install the hook for the rest of this process's life (audit hooks cannot be removed)."""
    blocked = frozenset(
        {
            "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "subprocess.Popen",
            "pty.spawn", "socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo",
            "socket.gethostbyname", "socket.sendto", "socket.sendmsg", "signal.pthread_kill", "os.chroot",
            "os.symlink", "gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys._current_frames",
        }
    )  # fmt: skip
    no_import = frozenset({"ctypes", "_ctypes", "cffi", "_posixsubprocess", "_testcapi", "_testinternalcapi"})
    changing = frozenset(
        {
            "os.remove", "os.rmdir", "os.rename", "os.mkdir", "os.link", "os.chmod", "os.chown", "os.truncate",
            "os.utime", "shutil.rmtree", "os.setxattr", "os.removexattr", "os.chdir",
        }
    )  # fmt: skip
    creating = frozenset({"os.mkdir", "os.link"})
    two_paths = frozenset({"os.rename", "os.link"})
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
    o_creat = os.O_CREAT
    root = workdir.rstrip("/") + "/"
    pid = os.getpid()
    created = itertools.count(1)  # can only go up, even for a solution that finds it
    most = max_files
    # Bound now: the hook reads no global or builtin name when it runs.
    lstat, readlink, is_dir, is_link = os.lstat, os.readlink, stat.S_ISDIR, stat.S_ISLNK
    str_, bytes_, int_, type_, len_, range_ = str, bytes, int, type, len, range
    next_, reversed_, list_ = next, reversed, list
    denied, missing, os_error = PermissionError, FileNotFoundError, OSError

    def guard(event, args):
        if event in blocked or str_.startswith(event, "ctypes."):
            raise denied(f"sandbox: {event} is not allowed")
        if event == "import":
            if str_.split(args[0], ".")[0] in no_import:
                raise denied(f"sandbox: importing {str_.split(args[0], '.')[0]} is not allowed")
            return
        if event == "os.kill" or event == "os.killpg":
            if args[0] != pid and args[0] != 0:
                raise denied(f"sandbox: {event} of another process is not allowed")
            return
        if event == "open":
            if type_(args[2]) is not int_:
                raise denied("sandbox: open flags must be an int")
            targets = args[:1]
            writing = args[2] & write_flags
            create = args[2] & o_creat
        elif event in changing:
            targets = args[:2] if event in two_paths else args[:1]
            writing = True
            create = event in creating
        else:
            return
        for path in targets:
            kind = type_(path)
            if kind is int_ or path is None:
                continue  # a file descriptor (opened through this hook) or no path
            if kind is bytes_:
                path = bytes_.decode(path, "utf-8", "surrogateescape")
            elif kind is not str_:
                raise denied("sandbox: a path must be str or bytes")
            parts = str_.split(path, "/")
            if ".." in parts:
                raise denied(f"sandbox: '..' in a path is not allowed: {path!r}")
            absolute = str_.startswith(path, "/")
            if writing:
                if path == "/dev/null":
                    continue
                if absolute and not str_.startswith(path + "/", root):
                    raise denied(f"sandbox: {event} outside the working directory is not allowed: {path!r}")
                names = list_()
                for name in str_.split(path[len_(root) :] if absolute else path, "/"):
                    if name and name != ".":
                        names.append(name)
                prefix = root[:-1] if absolute else "."
                for depth in range_(len_(names)):
                    prefix = prefix + "/" + names[depth]
                    try:
                        mode = lstat(prefix).st_mode
                    except missing:
                        if create and depth == len_(names) - 1 and most is not None and next_(created) > most:
                            raise denied(f"sandbox: more than {most} files is not allowed") from None
                        break  # a new file; or a missing directory, which fails the call itself
                    except os_error:
                        break  # e.g. a file used as a directory: the call fails by itself
                    if is_link(mode):
                        raise denied(f"sandbox: {event} through a symbolic link is not allowed: {path!r}")
                    if depth < len_(names) - 1 and not is_dir(mode):
                        break
                continue
            if not absolute or str_.startswith(path + "/", root):
                continue  # reading inside the working directory (no links there)
            resolved, pending, links = "", list_(reversed_(parts)), 0
            while pending:
                name = pending.pop()
                if not name or name == ".":
                    continue
                if name == "..":  # from a link's target
                    resolved = resolved[: str_.rfind(resolved, "/")]
                    continue
                candidate = resolved + "/" + name
                try:
                    is_a_link = is_link(lstat(candidate).st_mode)
                except os_error:
                    is_a_link = False
                if not is_a_link:
                    resolved = candidate
                    continue
                links += 1
                if links > 40:
                    raise denied(f"sandbox: too many symbolic links in {path!r}")
                target = readlink(candidate)
                pending.extend(reversed_(str_.split(target, "/")))
                if str_.startswith(target, "/"):
                    resolved = ""
            if str_.startswith(resolved + "/", root):
                continue
            fields = str_.split(resolved, "/")
            if len_(fields) > 2 and fields[1] == "proc" and str_.isdigit(fields[2]) and int_(fields[2]) != pid:
                raise denied(f"sandbox: reading another process ({path!r}) is not allowed")
            try:
                outside_dir = is_dir(lstat(resolved or "/").st_mode)
            except os_error:
                outside_dir = False
            if outside_dir:
                raise denied(f"sandbox: opening a directory outside the working directory is not allowed: {path!r}")

    sys_ = __import__("sys")
    sys_.addaudithook(guard)
