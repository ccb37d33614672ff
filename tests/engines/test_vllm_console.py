"""vLLM's console under rlkit: the level, the dropped lines and their reasons, the workers' warnings (no vLLM
needed: the logging config is applied to this process's ``vllm`` logger with ``logging.config.dictConfig``, as
vLLM applies it in each of its processes)."""

import io
import logging
import logging.config
import os

import pytest

from rlkit.engines.vllm import VLLMEngine
from rlkit.engines.vllm_console import WORKER_WARNINGS, KnownLines, check_log_level, child_environment, logging_dict

#: The shape of vLLM 0.32's ``DEFAULT_LOGGING_CONFIG`` (its formatter factory needs vLLM; a plain one does here).
DEFAULT = {
    "formatters": {"vllm": {"format": "%(levelname)s %(message)s", "log_level": "INFO"}},
    "handlers": {
        "vllm": {"class": "logging.StreamHandler", "formatter": "vllm", "level": "INFO", "stream": "ext://sys.stdout"}
    },
    "loggers": {"vllm": {"handlers": ["vllm"], "level": "INFO", "propagate": False}},
    "version": 1,
    "disable_existing_loggers": False,
}

PUSH = [  # what every weight push logged before (vLLM 0.32, CPU), in vLLM's own modules
    ("vllm.model_executor.model_loader.reload.inplace", logging.INFO, "Reloading weights inplace..."),
    ("vllm.model_executor.model_loader.reload.layerwise", logging.WARNING, "RotaryEmbedding: Failed to load weights"),
    ("vllm.v1.core.block_pool", logging.INFO, "Successfully reset prefix cache"),
]


@pytest.fixture
def console():
    """Applies a logging dict to this process; returns what vLLM's loggers print, and restores them after."""
    saved = {name: logging.getLogger(name).level for name in ("vllm", "torch._library.triton")}

    def apply(level: str) -> io.StringIO:
        config = logging_dict(DEFAULT, level)
        stream = config["handlers"]["vllm"]["stream"] = io.StringIO()  # instead of sys.stdout, which pytest holds
        logging.config.dictConfig(config)
        return stream

    yield apply
    vllm = logging.getLogger("vllm")
    for handler in list(vllm.handlers):
        vllm.removeHandler(handler)
    for name, level in saved.items():
        logging.getLogger(name).setLevel(level)


def emit(records):
    for name, level, message in records:
        logging.getLogger(name).log(level, message)


def test_a_weight_push_prints_nothing_at_warning_and_everything_at_info(console):
    stream = console("WARNING")
    emit(PUSH)
    assert stream.getvalue() == ""
    emit([("vllm.v1.worker", logging.WARNING, "QKVParallelLinear: Failed to load weights")])  # a real gap stays
    assert stream.getvalue() == "WARNING QKVParallelLinear: Failed to load weights\n"

    stream = console("INFO")
    emit(PUSH)
    assert stream.getvalue().splitlines() == [f"{logging.getLevelName(level)} {text}" for _, level, text in PUSH]


def test_known_lines_match_only_what_they_name():
    def passes(message: str) -> bool:
        return KnownLines().filter(logging.makeLogRecord({"msg": message}))

    for known in (
        "RotaryEmbedding: Failed to load weights",
        "Llama3RotaryEmbedding: Failed to load weights",
        "Triton is not installed. triton-cpu is expected on x86 CPUs.",
        "Enforce eager set, disabling torch.compile, CUDAGraphs, and JIT kernel warmup.",
        "[shutdown] Executor: workers still running after grace period; sending SIGTERM count=1",
    ):
        assert not passes(known), known
    for other in (
        "QKVParallelLinear: Failed to load weights",
        "libtcmalloc is not found in LD_PRELOAD. For best performance, ...",
        "Following weights were not loaded from checkpoint: {'lm_head.weight'}",
        "[shutdown] Process manager: force killing remaining processes count=1",
    ):
        assert passes(other), other


def test_torch_triton_notice_is_raised_to_error_only_when_quiet():
    assert logging_dict(DEFAULT, "WARNING")["loggers"]["torch._library.triton"] == {"level": "ERROR"}
    assert "torch._library.triton" not in logging_dict(DEFAULT, "INFO")["loggers"]
    assert "filters" not in logging_dict(DEFAULT, "DEBUG")["handlers"]["vllm"]
    assert DEFAULT["loggers"]["vllm"]["level"] == "INFO"  # vLLM's default is copied, not changed


def test_vllm_processes_start_with_their_warning_filter_and_the_environment_is_restored(monkeypatch):
    monkeypatch.setenv("PYTHONWARNINGS", "error::UserWarning")
    monkeypatch.delenv("VLLM_LOGGING_CONFIG_PATH", raising=False)
    with child_environment("WARNING", "/tmp/logging.json"):
        assert os.environ["PYTHONWARNINGS"] == f"error::UserWarning,{WORKER_WARNINGS}"
        assert os.environ["VLLM_LOGGING_CONFIG_PATH"] == "/tmp/logging.json"
    assert os.environ["PYTHONWARNINGS"] == "error::UserWarning"
    assert "VLLM_LOGGING_CONFIG_PATH" not in os.environ
    monkeypatch.delenv("PYTHONWARNINGS")
    with child_environment("INFO"):
        assert "PYTHONWARNINGS" not in os.environ
    with child_environment("ERROR"):
        assert os.environ["PYTHONWARNINGS"] == WORKER_WARNINGS
    assert "PYTHONWARNINGS" not in os.environ


def test_log_level_is_checked_and_normalised():
    assert check_log_level("info") == "INFO"
    assert VLLMEngine(log_level="error").log_level == "ERROR"
    with pytest.raises(ValueError, match="log_level must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL"):
        VLLMEngine(log_level="LOUD")
