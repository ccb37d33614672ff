"""Shared fixtures. Tests run on 1 thread: the 2 shared cores of CI machines are noisy."""

import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

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
