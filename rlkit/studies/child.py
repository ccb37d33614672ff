"""The process behind each run of a study: ``rlkit fit``, which does not outlive the study that started it.

``python -m rlkit.studies.child STUDY_PID fit --config ...`` asks Linux to send it SIGTERM when the
study's process dies (``PR_SET_PDEATHSIG``; also on ``kill -9``, which the study itself cannot catch), so
the run stops as on ``kill``: Lightning finishes the step and the run exits (143). A watchdog thread also
notices that the study is gone (on systems without ``prctl`` too) and, if the run is still alive
``GRACE_S`` seconds later, ends it for good (SIGKILL). The run folder's lock, inherited from the study,
is held until this process exits, so a resume waits for it (see :mod:`rlkit.studies.locks`).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

#: Seconds a run may take to stop by itself once its study is gone, before it is killed.
GRACE_S = 60.0
_PR_SET_PDEATHSIG = 1


def die_with(parent: int) -> None:
    """End this process when process ``parent`` (the study) ends: SIGTERM at once, SIGKILL after ``GRACE_S``."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the watchdog alone
        pass
    threading.Thread(target=_watch, args=(parent,), name="rlkit-study-watchdog", daemon=True).start()


def _watch(parent: int) -> None:
    while os.getppid() == parent:  # once the study dies, this process is re-parented
        time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGTERM)  # a second SIGTERM after PR_SET_PDEATHSIG's is harmless
    time.sleep(GRACE_S)
    os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str]) -> None:
    parent, args = int(argv[0]), argv[1:]
    die_with(parent)
    sys.argv = ["rlkit", *args]
    from rlkit.cli import main as rlkit

    rlkit(args)


if __name__ == "__main__":
    main(sys.argv[1:])
