"""Code-execution reward: run the completion's code against the prompt's unit tests, in a sandbox."""

from __future__ import annotations

import json
import re

from rlkit.data.prompts import Prompt
from rlkit.errors import ConfigError
from rlkit.rewards.base import RewardFunction
from rlkit.rewards.sandbox import missing_layers, run_python, sandbox_layers

_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(completion: str) -> str:
    """The last fenced code block (```` ```python ... ``` ```` or ```` ``` ... ``` ````), else the whole completion."""
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


class CodeExecution(RewardFunction):
    """1.0 when the completion's code passes the prompt's unit tests, else 0.0 (the pass@1 check of
    HumanEval, Chen et al. 2021, as a reward).

    The code is the completion's last fenced block, else the whole completion (``extract_code``); with
    ``include_prompt`` the prompt's text comes first (HumanEval: the completion continues a function
    signature). The tests, from the prompt's ground truth or the column ``tests_key``, are either
    Python that raises when the code is wrong (``assert``s, or HumanEval's ``test`` followed by
    ``check(entry_point)``), calling the code's functions by name; or stdin/stdout cases, as
    ``{"inputs": [...], "outputs": [...]}`` (APPS/TACO's ``input_output``, a dict or its JSON text) or a
    list of ``{"input": ..., "output": ...}``, where the whole program runs on each input and its
    output text must match (line by line, trailing white space aside).

    The grade is two sandboxed processes (``rlkit.rewards.sandbox``): the code runs in one, the tests
    in the other, which calls the code's functions across the process boundary and gets their results
    back as plain data (numbers, strings, lists, tuples, sets, dicts, None; anything else fails the
    test). The code's process never holds the tests or the verdict, so nothing it does to its own
    interpreter can pass a test it does not pass. A run that exits early, crashes, runs out of time,
    memory, disk or output, scores 0. With no Linux namespaces on the machine (an unprivileged
    container) construction stops with a message naming what is missing, unless ``weak_sandbox``.

    Each grade starts two fresh Python processes (about 0.11 s of CPU together); score with
    reward workers (``data.reward_workers``) to run several at once, and keep the scorer's timeout
    above ``timeout_s``.

    Args:
        name: the label of this reward's curve (``reward/<name>``).
        tests_key: the prompt column holding the tests; None reads the ground truth.
        include_prompt: put the prompt's text (plain-text prompts only) before the code.
        timeout_s: wall-clock limit of one grade; CPU time is limited to the same (rounded up).
        memory_mb: address-space limit of each process, in MiB.
        max_processes: process-count limit (``RLIMIT_NPROC``).
        max_file_bytes: the largest file the code may write.
        max_disk_bytes: all the bytes the code's files may hold together.
        max_files: the most files and directories the code may create.
        max_output_bytes: stdout and stderr beyond this end the run as a failure.
        weak_sandbox: accept a machine without the namespaces the sandbox is built on (then only the
            Python audit hook, resource limits and the separate grader stand between the code and
            this user's files and processes; see ``rlkit.rewards.sandbox``).
    """

    def __init__(
        self,
        name: str = "code",
        tests_key: str | None = None,
        include_prompt: bool = False,
        timeout_s: float = 5.0,
        memory_mb: int = 1024,
        max_processes: int = 16,
        max_file_bytes: int = 1 << 20,
        max_disk_bytes: int = 1 << 24,
        max_files: int = 256,
        max_output_bytes: int = 1 << 16,
        weak_sandbox: bool = False,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"CodeExecution: timeout_s must be positive, got {timeout_s}.")
        if memory_mb < 64:
            raise ValueError(f"CodeExecution: memory_mb={memory_mb} is too little to start Python; give >= 64.")
        sizes = ("max_processes", max_processes), ("max_file_bytes", max_file_bytes), ("max_disk_bytes", max_disk_bytes)
        for label, value in (*sizes, ("max_files", max_files)):
            if value < 1:
                raise ValueError(f"CodeExecution: {label} must be >= 1, got {value}.")
        if max_output_bytes < 1:
            raise ValueError(f"CodeExecution: max_output_bytes must be >= 1, got {max_output_bytes}.")
        missing = missing_layers(sandbox_layers())
        if missing and not weak_sandbox:
            raise ConfigError(
                f"CodeExecution: this machine gives the code sandbox no {', '.join(missing)} (the kernel or "
                f"container refuses Linux namespaces), so only these weaker layers would contain the code: "
                f"{', '.join(sandbox_layers())}. Run where user namespaces are allowed, or accept the weaker "
                f"sandbox with weak_sandbox=true (init_args of CodeExecution)."
            )
        self.name = name
        self.tests_key = tests_key
        self.include_prompt = include_prompt
        self.limits = {
            "timeout_s": float(timeout_s),
            "memory_mb": int(memory_mb),
            "max_processes": int(max_processes),
            "max_file_bytes": int(max_file_bytes),
            "max_disk_bytes": int(max_disk_bytes),
            "max_files": int(max_files),
            "max_output_bytes": int(max_output_bytes),
            "weak": bool(weak_sandbox),
        }

    def __call__(self, completion: str, prompt: Prompt) -> float:
        return float(run_python(self.program(completion, prompt), self.tests(prompt), **self.limits).passed)

    def program(self, completion: str, prompt: Prompt) -> str:
        """The code that runs: the prompt's text (with ``include_prompt``) and the extracted code."""
        code = extract_code(completion)
        if not self.include_prompt:
            return code
        if not isinstance(prompt.prompt, str):
            raise ValueError(
                "CodeExecution(include_prompt=True) needs plain-text prompts (the code's beginning); this "
                "prompt is chat messages. Set include_prompt=False and ask for complete code."
            )
        return prompt.prompt + code

    def tests(self, prompt: Prompt) -> str | list[tuple[str, str]]:
        """The prompt's unit tests: Python source, or (stdin, expected stdout) pairs."""
        if self.tests_key is None:
            tests = prompt.ground_truth
            where = "ground truth (PromptFile's answer_key)"
        else:
            tests = prompt.meta.get(self.tests_key)
            where = f"column {self.tests_key!r} (its columns: {sorted(prompt.meta)})"
        if isinstance(tests, str) and tests.lstrip().startswith("{"):
            try:
                tests = json.loads(tests)
            except ValueError:
                pass  # Python that starts with a set or dict
        cases = _io_cases(tests)
        if cases is not None:
            return cases
        if not isinstance(tests, str) or not tests.strip():
            raise ValueError(
                f"CodeExecution: the prompt has no tests in its {where}; give each row its unit tests as "
                f'Python source or stdin/stdout cases ({{"inputs": [...], "outputs": [...]}}), or set '
                f"tests_key to the column holding them."
            )
        return tests


def _io_cases(tests) -> list[tuple[str, str]] | None:
    """stdin/stdout cases from APPS's ``{"inputs": [...], "outputs": [...]}`` or ``[{"input", "output"}]``."""
    if isinstance(tests, dict) and set(tests) >= {"inputs", "outputs"}:
        pairs = list(zip(tests["inputs"], tests["outputs"], strict=True))
    elif (
        isinstance(tests, list)
        and tests
        and all(isinstance(c, dict) and {"input", "output"} <= c.keys() for c in tests)
    ):
        pairs = [(c["input"], c["output"]) for c in tests]
    else:
        return None
    if not pairs or not all(isinstance(x, str) and isinstance(y, str) for x, y in pairs):
        raise ValueError(
            "CodeExecution: stdin/stdout cases must be non-empty and text (each input and output a string); "
            "call-based cases (APPS's fn_name) are written as Python tests instead."
        )
    return pairs
