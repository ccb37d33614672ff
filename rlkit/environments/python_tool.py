"""A code-interpreter tool: the model's Python runs in ``CodeExecution``'s sandbox, and its output is the result."""

from __future__ import annotations

from rlkit.errors import ConfigError
from rlkit.rewards.sandbox import missing_layers, run_python, sandbox_layers


class PythonTool:
    """Runs a Python program in the sandbox of :mod:`rlkit.rewards.sandbox` (the layers and limits of
    ``CodeExecution``: its own namespaces, CPU, memory, disk and output limits, a wall-clock kill) and answers
    with what it printed, stdout and stderr (a traceback included: the model reads its own errors). A program
    stopped by a limit answers with its output so far and a line saying which limit. Offered as the tool
    ``python``; give ``ToolEnvironment.tool_timeout_s`` more than ``timeout_s`` (start-up takes ~0.1 s).

    Args:
        timeout_s: wall-clock (and CPU) limit of one run, in seconds.
        memory_mb: address-space limit, in MiB.
        max_output_bytes: output beyond this stops the run.
        weak_sandbox: accept a machine without the namespaces the sandbox is built on (see ``CodeExecution``).
    """

    name = "python"

    def __init__(
        self, timeout_s: float = 5.0, memory_mb: int = 512, max_output_bytes: int = 4096, weak_sandbox: bool = False
    ) -> None:
        if not timeout_s > 0 or memory_mb < 64 or max_output_bytes < 1:
            raise ConfigError(
                f"PythonTool: timeout_s must be > 0, memory_mb >= 64 and max_output_bytes >= 1, got {timeout_s}, "
                f"{memory_mb} and {max_output_bytes}"
            )
        missing = missing_layers(sandbox_layers())
        if missing and not weak_sandbox:
            raise ConfigError(
                f"PythonTool: this machine gives the code sandbox no {', '.join(missing)}: run where user "
                "namespaces are allowed, or accept the weaker sandbox with weak_sandbox=true"
            )
        self.timeout_s, self.memory_mb = float(timeout_s), int(memory_mb)
        self.max_output_bytes, self.weak_sandbox = int(max_output_bytes), bool(weak_sandbox)

    def __call__(self, code: str) -> str:
        """Run a Python program and return what it prints (stdout and stderr).

        Args:
            code: the program; print() what you want to see.
        """
        result = run_python(
            code,
            "pass",  # nothing to grade: the tool's answer is the program's own output
            timeout_s=self.timeout_s,
            memory_mb=self.memory_mb,
            max_output_bytes=self.max_output_bytes,
            weak=self.weak_sandbox,
        )
        stopped = {
            "timeout": f"[stopped: ran past {self.timeout_s:g} s]",
            "output_limit": f"[stopped: printed more than {self.max_output_bytes} bytes]",
            "killed": "[stopped: killed by a CPU-time or memory limit]",
        }.get(result.status)
        return result.output if stopped is None else f"{result.output}{stopped}"
