"""Shared fixtures. Tests run on 1 thread: the 2 shared cores of CI machines are noisy.

Every session gets a new, empty model cache (``RLKIT_CACHE``, inherited by the ``rlkit`` subprocesses the
tests start), so nothing an earlier run left behind (an embedded checkpoint from older warm-up code, say)
can make a test pass: the embedded model is warmed up once per session, as on a new machine.
"""

import atexit
import os
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["RLKIT_CACHE"] = tempfile.mkdtemp(prefix="rlkit-test-cache-")
atexit.register(shutil.rmtree, os.environ["RLKIT_CACHE"], ignore_errors=True)

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

REFERENCE = Path(__file__).resolve().parents[2] / "shared" / "reference" / "verl_cases.pt"


@pytest.fixture(scope="session")
def verl_cases() -> dict:
    """Numbers recorded from verl 0.9.1 (see ../shared/reference/README.md)."""
    if not REFERENCE.exists():
        pytest.fail(f"reference numbers not found at {REFERENCE}: the checkout must sit beside shared/")
    return torch.load(REFERENCE, weights_only=True)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
