"""What vLLM prints under rlkit: its logging at one level in every process it starts, and the lines it repeats
that say nothing about the run dropped, each with its reason.

vLLM 0.32 configures the ``vllm`` logger hierarchy from a ``LoggingConfig`` (``log_level``, or a Python
``dictConfig`` file, ``pylogging_config_file``) in the calling process when ``LLM`` starts, and again in its
engine-core and worker processes (``vllm.logger.configure_logging``); ``VLLM_LOGGING_LEVEL`` is only that
config's default. A dictConfig file therefore reaches every process, and a filter named in it by dotted path
(:class:`KnownLines`) is installed in each of them.
"""

from __future__ import annotations

import copy
import logging
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager

#: ``VLLMEngine.log_level`` values (Python's level names).
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

#: vLLM warnings dropped below INFO, and why each says nothing about the run.
KNOWN_LINES = {
    # Every weight push. vLLM's in-place reload (model_loader/reload/layerwise.py) warns for each layer that no
    # tensor of the file reached. A rotary embedding's only tensor is its cos/sin cache, a non-persistent buffer
    # computed from the config's rope settings and in no checkpoint (rlkit pushes the state dict, which holds no
    # buffer, and vLLM's Llama/Qwen2 loaders skip ``rotary_emb.inv_freq`` anyway), so nothing can be pushed
    # into it; vLLM puts its own cache back. Any other layer named in this warning is still shown.
    r"^\w*RotaryEmbedding: Failed to load weights$": "a rotary cache is computed, never loaded",
    # The CPU install removes PyPI's CUDA triton (import vllm fails with it, scripts/install.sh); vLLM's CPU
    # platform then says so on each start, in each process. A GPU install has triton and never prints them.
    r"^Triton is not installed": "triton is removed on CPU on purpose",
    r"^Model Runner V2 requires Triton": "triton is removed on CPU on purpose",
    # Both restate VLLMEngine's enforce_eager=True (its default: faster start; see its docstring).
    r"^Enforce eager set": "restates enforce_eager",
    r"^Inductor compilation was disabled by user settings": "restates enforce_eager",
    # vLLM's CPU platform prints it for every model; it concerns Mamba-style state caches only.
    r"^Reset SSM cache type": "Mamba-style models only",
    # Most closes on vLLM 0.32 (CPU): its worker does not leave its idle wait when the engine's death pipe
    # closes, so after a 5 s grace the engine process sends it SIGTERM, which ends it; a normal exit.
    r"^\[shutdown\] Executor: workers still running after grace period": "vLLM's normal close path here",
}
_PATTERNS = [re.compile(pattern) for pattern in KNOWN_LINES]

#: A torch deprecation (``torch.distributed.reduce_op``) that vLLM's own op dispatcher triggers in each worker
#: as it scans torch's attributes: nothing a user can act on. Passed to vLLM's processes as PYTHONWARNINGS.
WORKER_WARNINGS = "ignore::FutureWarning:vllm.triton_utils.dispatcher"


class KnownLines(logging.Filter):
    """Drops the vLLM lines listed in :data:`KNOWN_LINES`; every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(pattern.search(message) for pattern in _PATTERNS)


def check_log_level(level: str) -> str:
    """``level`` in upper case; a ValueError naming the choices otherwise."""
    if not isinstance(level, str) or level.upper() not in LOG_LEVELS:
        raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)} (vLLM's own logging), got {level!r}")
    return level.upper()


def is_quiet(level: str) -> bool:
    """Below INFO vLLM's console is trimmed (known lines, load bars); INFO and DEBUG show all of it."""
    return logging.getLevelName(level) > logging.INFO


def logging_dict(default: dict, level: str) -> dict:
    """vLLM's own ``dictConfig`` (``vllm.logger.DEFAULT_LOGGING_CONFIG``, passed as ``default``) at ``level``.

    Below INFO its handler gets :class:`KnownLines`, and torch's "Triton not available" notice
    (``torch._library.triton``, printed by each vLLM process on CPU, where triton is removed on purpose) is
    raised to ERROR. The format is vLLM's, so the remaining lines read as they do without rlkit.
    """
    config = copy.deepcopy(default)
    for formatter in config["formatters"].values():
        formatter["log_level"] = level
    config["handlers"]["vllm"]["level"] = level
    config["loggers"]["vllm"]["level"] = level
    if is_quiet(level):
        config["filters"] = {"rlkit_known_lines": {"()": f"{__name__}.KnownLines"}}
        config["handlers"]["vllm"]["filters"] = ["rlkit_known_lines"]
        config["loggers"]["torch._library.triton"] = {"level": "ERROR"}
    return config


@contextmanager
def child_environment(level: str, logging_file: str | None = None) -> Iterator[None]:
    """The environment vLLM's processes start with (they inherit it), restored afterwards: below INFO,
    :data:`WORKER_WARNINGS` added to ``PYTHONWARNINGS``; with ``logging_file``, ``VLLM_LOGGING_CONFIG_PATH``
    (for vLLM releases without ``LoggingConfig``, which read their logging config from the environment)."""
    changes = {}
    if is_quiet(level):
        before = os.environ.get("PYTHONWARNINGS")
        changes["PYTHONWARNINGS"] = f"{before},{WORKER_WARNINGS}" if before else WORKER_WARNINGS
    if logging_file is not None:
        changes["VLLM_LOGGING_CONFIG_PATH"] = logging_file
    saved = {name: os.environ.get(name) for name in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
