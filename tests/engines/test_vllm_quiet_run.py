"""The console of a real ``rlkit fit`` with ``VLLMEngine`` (one vLLM start per test, a few rollouts): quiet by
default, vLLM's whole output with ``log_level=INFO``; stdout and stderr read as one terminal shows them."""

import re

import pytest
from spine.helpers import run_rlkit, short_args

#: A record in vLLM's format: ``(EngineCore pid=12) WARNING 12-02 14:28:00 [file.py:1] message``.
VLLM_RECORD = re.compile(r"\((?:MainProcess|EngineCore|\w*Worker)[\w-]* pid=\d+\) (?:DEBUG|INFO|WARNING|ERROR) ")
#: The per-push lines of the console before issue 19, and the exit warnings.
NEVER = ("Failed to load weights", "Loading safetensors checkpoint shards", "leaked shared_memory", "force killing")


def fit_console(tmp_path, rollouts: int, *extra: str) -> list[str]:
    args = short_args(
        tmp_path,
        "drgrpo",
        "--data.engine=VLLMEngine",
        f"--trainer.max_steps={rollouts}",
        "--trainer.enable_progress_bar=true",  # the bar, to see that nothing breaks into it
        *extra,
    )
    result = run_rlkit(args, cwd=tmp_path, console=True)
    assert result.returncode == 0, result.stdout[-3000:]
    return result.stdout.split("\n")  # lines as a terminal ends them; the bar's "\r" redraws stay on one


@pytest.mark.vllm
def test_vllm_is_quiet_by_default(tmp_path):
    """A run prints vLLM's start-up advice once (2 lines on CPU: tcmalloc, libiomp), nothing per weight push
    (3 rollouts = 4 pushes), nothing into the progress bar, and no shared-memory leak at exit."""
    pytest.importorskip("vllm")
    lines = fit_console(tmp_path, 3)
    text = "\n".join(lines)
    vllm_lines = [line for line in lines if VLLM_RECORD.search(line)]
    assert len(vllm_lines) <= 3, "\n".join(vllm_lines)
    for words in NEVER:
        assert words not in text, f"{words!r} in the console:\n{text[-3000:]}"
    for line in lines:
        if "rollouts:" in line:
            assert not VLLM_RECORD.search(line), f"vLLM broke into the progress bar: {line!r}"
    assert "rlkit: run finished." in text


@pytest.mark.vllm
def test_vllm_log_level_info_restores_its_output(tmp_path):
    """``data.engine.init_args.log_level=INFO``: vLLM's start-up and per-push records are back (the knob
    reaches the engine and worker processes, not only this one)."""
    pytest.importorskip("vllm")
    lines = fit_console(tmp_path, 1, "--data.engine.init_args.log_level=INFO")
    records = [line for line in lines if VLLM_RECORD.search(line)]
    assert len(records) > 20, "\n".join(lines)
    for process in ("MainProcess", "EngineCore", "Worker"):
        assert any(f"({process} pid=" in line for line in records), f"no INFO record from vLLM's {process}"
    assert sum("Reloading weights inplace" in line for line in records) >= 1  # a push, from the worker
