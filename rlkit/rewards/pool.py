"""Worker processes that run reward calls, each call under a deadline; an overrunning worker is killed.

A worker is a plain ``python -c`` process talking over a socket pair, not a ``multiprocessing``
child: it does not re-import the caller's ``__main__`` (which, under ``rlkit fit``, imports torch),
so it starts in about the time it takes to import the reward functions themselves.
"""

from __future__ import annotations

import atexit
import os
import pickle
import socket
import subprocess
import sys
import time
import traceback
import weakref
from collections import deque
from multiprocessing.connection import Connection, wait

from rlkit.rewards.calls import Failure, RewardError, call_item

_START_TIMEOUT_S = 120.0  # importing the reward functions' modules in a fresh process
_CHUNKS_PER_WORKER = 4  # calls go out in chunks: fewer messages, still balanced across workers


class _Worker:
    def __init__(self, blob: bytes) -> None:
        ours, theirs = socket.socketpair()
        # The worker imports rlkit (and the reward functions) from exactly this process's path.
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sys; from rlkit.rewards.pool import serve; serve(int(sys.argv[1]))",
                str(theirs.fileno()),
            ],
            pass_fds=[theirs.fileno()],
            env=env,
        )
        theirs.close()
        self.conn = Connection(ours.detach())
        self.conn.send((os.getpid(), list(sys.path), blob))
        self.chunk: list[tuple] = []
        self.position = 0
        self.deadline = 0.0

    def ready(self) -> None:
        """Wait until the worker has loaded the functions; a RewardError if it cannot."""
        if not self.conn.poll(_START_TIMEOUT_S):
            self.kill()
            raise RewardError(f"a reward worker process did not start within {_START_TIMEOUT_S:.0f} s.")
        try:
            status, detail = self.conn.recv()
        except (EOFError, OSError):
            status, detail = "died", f"exit code {self.process.wait()}"
        if status != "ready":
            self.kill()
            raise RewardError(
                f"a reward worker process could not load the reward functions ({detail.strip()}). Every "
                f"module they come from must be importable in a fresh Python process (on PYTHONPATH); or "
                f"set workers=0 (data.reward_workers=0) to score in this process."
            )

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.conn.close()


class RewardPool:
    """``workers`` processes that score reward calls, started on first use and kept for later batches.

    Args:
        functions: the reward functions, sent to every worker once (they must pickle).
        workers: the number of worker processes.
    """

    def __init__(self, functions: list, workers: int) -> None:
        try:
            self._blob = pickle.dumps(functions)
        except Exception as e:
            raise ValueError(
                f"RewardScorer(workers={workers}): the reward functions cannot be sent to worker processes "
                f"({type(e).__name__}: {e}). Define them at module level (no lambdas or local classes), or "
                f"set workers=0 (data.reward_workers=0) to score in this process."
            ) from e
        self.size = workers
        self._workers: list[_Worker] = []
        self._finalizer = weakref.finalize(self, RewardPool._kill_all, self._workers)
        atexit.register(self._finalizer)

    def close(self) -> None:
        RewardPool._kill_all(self._workers)

    @staticmethod
    def _kill_all(workers: list[_Worker]) -> None:
        while workers:
            workers.pop().kill()

    def _spawn(self, count: int) -> list[_Worker]:
        started = [_Worker(self._blob) for _ in range(count)]
        try:
            for worker in started:
                worker.ready()
        except BaseException:
            for worker in started:
                worker.kill()
            raise
        self._workers.extend(started)
        return started

    def _replace(self, worker: _Worker) -> _Worker:
        worker.kill()
        self._workers.remove(worker)
        return self._spawn(1)[0]

    def run(self, calls, completions, prompts, lengths, timeout_s: float, check) -> dict:
        """Results of ``calls`` (``(k, i)`` pairs), each call stopped after ``timeout_s``;
        ``check(k, i, result)`` sees each as it arrives and may raise to stop everything. A call whose ``i``
        is a tuple of rows is one batched call (``call_batch``), in a chunk of its own, with ``timeout_s``
        per row."""
        if len(self._workers) < self.size:
            self._spawn(self.size - len(self._workers))
        batches = [(k, i) for k, i in calls if isinstance(i, tuple)]
        calls = [(k, i) for k, i in calls if not isinstance(i, tuple)]
        size = max(1, -(-len(calls) // (self.size * _CHUNKS_PER_WORKER)))
        pending = deque(
            [(k, i, completions[i], prompts[i], lengths[i]) for k, i in calls[start : start + size]]
            for start in range(0, len(calls), size)
        )
        for k, rows in batches:
            batch = ([completions[i] for i in rows], [prompts[i] for i in rows], [lengths[i] for i in rows])
            pending.appendleft([(k, rows, *batch)])  # the longest calls first
        results: dict[tuple[int, int], float | Failure] = {}
        idle, busy = list(self._workers), []
        try:
            while pending or busy:
                while pending and idle:
                    worker = idle.pop()
                    worker.chunk, worker.position = pending.popleft(), 0
                    worker.deadline = time.monotonic() + timeout_s * _rows(worker.chunk[0][1])
                    worker.conn.send(worker.chunk)
                    busy.append(worker)
                soonest = min(w.deadline for w in busy)
                ready = wait([w.conn for w in busy], timeout=max(0.0, soonest - time.monotonic()))
                for worker in list(busy):
                    lost = False  # the worker is gone or must go: killed for overrunning, or died
                    if worker.conn in ready:
                        try:
                            k, i, result = worker.conn.recv()
                        except (EOFError, OSError):  # it died in the middle of a call
                            k, i = worker.chunk[worker.position][:2]
                            result = Failure("died", f"exit code {worker.process.wait()}")
                            lost = True
                    elif time.monotonic() > worker.deadline:
                        k, i = worker.chunk[worker.position][:2]
                        result, lost = Failure("timeout", ""), True
                    else:
                        continue
                    results[k, i] = result
                    worker.position += 1
                    if worker.position < len(worker.chunk):
                        worker.deadline = time.monotonic() + timeout_s * _rows(worker.chunk[worker.position][1])
                    if lost:
                        busy.remove(worker)
                        if worker.position < len(worker.chunk):
                            pending.appendleft(worker.chunk[worker.position :])
                        check(k, i, result)  # may raise before a replacement is started
                        idle.append(self._replace(worker))
                        continue
                    check(k, i, result)
                    if worker.position == len(worker.chunk):
                        busy.remove(worker)
                        idle.append(worker)
        except BaseException:
            self.close()  # busy workers hold stale work; fresh ones start on the next batch
            raise
        return results


def serve(fd: int) -> None:
    """A worker's main loop: load the functions, then answer chunks of calls until the socket closes."""
    conn = Connection(fd)
    parent, path, blob = conn.recv()
    _die_with_parent(parent)
    sys.path[:] = path
    try:
        functions = pickle.loads(blob)
    except BaseException:
        conn.send(("error", traceback.format_exc(limit=-3)))
        return
    conn.send(("ready", ""))
    while True:
        try:
            chunk = conn.recv()
        except (EOFError, OSError):
            return
        for k, i, completion, prompt, length in chunk:
            conn.send((k, i, call_item(functions[k], i, completion, prompt, length)))


def _rows(i) -> int:
    """How many completions a call scores: a tuple of rows is a batch."""
    return len(i) if isinstance(i, tuple) else 1


def _die_with_parent(parent: int) -> None:
    """Ask Linux to kill this worker when the scoring process dies, even mid-call (best effort)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(0)
