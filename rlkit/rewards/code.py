"""Code-execution reward: run the completion's code against the prompt's unit tests, in a sandbox."""

from __future__ import annotations

import re

from rlkit.data.prompts import Prompt
from rlkit.rewards.base import RewardFunction
from rlkit.rewards.sandbox import run_python

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
    signature). The tests are Python that raises when the code is wrong (e.g. ``assert``s, or
    HumanEval's ``test`` followed by ``check(entry_point)``), taken from the prompt's ground truth or
    from the column ``tests_key``. Code and tests are compiled separately (the code cannot swallow
    the tests) and run in one namespace in a sandbox (``rlkit.rewards.sandbox``): own process, no
    network, a throw-away directory, resource limits, a wall-clock kill. A run that exits early,
    whatever its status, fails.

    Each run takes a fresh Python process (about 0.1 s); score with reward workers
    (``data.reward_workers``) to run several at once, and keep the scorer's timeout above
    ``timeout_s``.

    Args:
        name: the label of this reward's curve (``reward/<name>``).
        tests_key: the prompt column holding the tests; None reads the ground truth.
        include_prompt: put the prompt's text (plain-text prompts only) before the code.
        timeout_s: wall-clock limit of one run; CPU time is limited to the same (rounded up).
        memory_mb: address-space limit of the run, in MiB.
        max_processes: process-count limit (``RLIMIT_NPROC``).
        max_file_bytes: the largest file the run may write.
        max_output_bytes: stdout and stderr beyond this end the run as a failure.
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
        max_output_bytes: int = 1 << 16,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"CodeExecution: timeout_s must be positive, got {timeout_s}.")
        if memory_mb < 64:
            raise ValueError(f"CodeExecution: memory_mb={memory_mb} is too little to start Python; give >= 64.")
        for label, value in (("max_processes", max_processes), ("max_file_bytes", max_file_bytes)):
            if value < 1:
                raise ValueError(f"CodeExecution: {label} must be >= 1, got {value}.")
        if max_output_bytes < 1:
            raise ValueError(f"CodeExecution: max_output_bytes must be >= 1, got {max_output_bytes}.")
        self.name = name
        self.tests_key = tests_key
        self.include_prompt = include_prompt
        self.limits = {
            "timeout_s": float(timeout_s),
            "memory_mb": int(memory_mb),
            "max_processes": int(max_processes),
            "max_file_bytes": int(max_file_bytes),
            "max_output_bytes": int(max_output_bytes),
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

    def tests(self, prompt: Prompt) -> str:
        """The prompt's unit tests."""
        if self.tests_key is None:
            tests = prompt.ground_truth
            where = "ground truth (PromptFile's answer_key)"
        else:
            tests = prompt.meta.get(self.tests_key)
            where = f"column {self.tests_key!r} (its columns: {sorted(prompt.meta)})"
        if not isinstance(tests, str) or not tests.strip():
            raise ValueError(
                f"CodeExecution: the prompt has no tests in its {where}; give each row its unit tests as "
                f"Python source, or set tests_key to the column holding them."
            )
        return tests
