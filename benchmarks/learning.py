"""Learning on the embedded task: held-out greedy accuracy before and after the default run, per seed.

    python benchmarks/learning.py                       # experiments/drgrpo.yaml, seeds 0 1 2
    python benchmarks/learning.py --seeds 0 1 2 3 4 --experiment grpo
    python benchmarks/learning.py --compare=--model.aggregation=SeqMeanTokenMean --warm-up-seed 0   # an ablation pair

Each seed ``s`` runs as a new machine would: a new, empty ``RLKIT_CACHE``; the embedded warm-up with seed
``s`` (``embedded_checkpoint(seed=s)`` in its own process: ``s = 0`` is the checkpoint the experiment uses by
default, other seeds stand in for another machine's float rounding, which moves the warm-up's phase
transition the same way); then the experiment, unchanged but for ``--seed_everything=s`` (every random
stream of the run) and ``--model.policy.checkpoint`` naming that warm-up, as ``rlkit fit`` in a subprocess in a
temporary directory. Per seed it prints the warm-up's steps and its stopping accuracy (greedy decoding
writes the worked solution), ``val/reward`` (greedy held-out accuracy under the run's reward, 512
questions) at the start and at the end, the wall times, the CPU times (user + system of the child
processes; one thread per run, so on idle cores the wall time is close to it) and the 1-minute load
average (the 2 cores are shared); then the mean and spread (max - min) over seeds.

``--warm-up-seed N`` keeps one warm-up (``N = 0``: the default checkpoint) for every seed, so only the run's
own random streams change, as when a user repeats a command with ``--seed_everything``. ``--compare ARGS``
runs every seed twice, without and with ``ARGS``, and prints a table of the metrics that show a
component's effect, each averaged over the run's last ``--tail`` rollouts: per arm the mean over seeds
and the spread, and the paired difference per seed. Both arms share each seed's warm-up. ``--keep DIR``
keeps the runs' TensorBoard logs there (``tensorboard --logdir DIR``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Metrics of the ablation table, averaged over the run's last rollouts.
TAIL_METRICS = (
    "reward/mean",
    "completion/length",
    "completion/length_neg_adv",
    "completion/length_pos_adv",
    "policy/entropy",
)


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _run(command: list[str], cwd: Path | None, env: dict) -> tuple[subprocess.CompletedProcess, float, float]:
    """Run a child process: its result, wall seconds and CPU seconds (user + system)."""
    cpu, start = _children_cpu(), time.perf_counter()
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    return result, time.perf_counter() - start, _children_cpu() - cpu


def _scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, list[tuple[int, float]]] = {}
    for events in sorted(directory.rglob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0})
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            values = [(e.step, e.value) for e in accumulator.Scalars(tag) if e.value == e.value]
            out.setdefault(tag, []).extend(values)
    return {tag: sorted(values) for tag, values in out.items()}


def warm_up(seed: int, cache: Path, env: dict) -> tuple[str, dict]:
    """The embedded checkpoint of warm-up seed ``seed`` in ``cache``: its directory and record (with times)."""
    code = f"from rlkit.embedded import embedded_checkpoint; print(embedded_checkpoint({str(cache)!r}, seed={seed}))"
    result, wall, cpu = _run([sys.executable, "-c", code], None, env)
    if result.returncode:
        raise SystemExit(f"warm-up failed:\n{result.stderr[-3000:]}")
    directory = result.stdout.strip().splitlines()[-1]
    record = json.loads((Path(directory) / "rlkit_embedded.json").read_text())["warm_up"]
    return directory, {**record, "wall": wall, "cpu": cpu}


def fit(experiment: str, seed: int, checkpoint: str, extra: list[str], workdir: Path, env: dict) -> dict:
    """One ``rlkit fit`` of the experiment: its scalars, wall and CPU time, the load average around it."""
    workdir.mkdir(parents=True)
    command = [
        sys.executable,
        "-m",
        "rlkit.cli",
        "fit",
        f"--config={ROOT / 'experiments' / (experiment + '.yaml')}",
        f"--seed_everything={seed}",
        f"--model.policy.checkpoint={checkpoint}",
        "--trainer.enable_progress_bar=false",
        *extra,
    ]
    load = os.getloadavg()[0]
    result, wall, cpu = _run(command, workdir, env)
    if result.returncode:
        raise SystemExit(f"rlkit fit failed (seed {seed}, {extra}):\n{result.stderr[-3000:]}")
    return {"scalars": _scalars(workdir / "runs"), "wall": wall, "cpu": cpu, "load": (load + os.getloadavg()[0]) / 2}


def _tail_mean(values: list[tuple[int, float]], tail: int) -> float:
    return statistics.fmean(v for _, v in values[-tail:]) if values else float("nan")


def _spread(values: list[float], digits: int = 3) -> str:
    return f"{statistics.fmean(values):.{digits}f} (spread {max(values) - min(values):.{digits}f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experiment", default="drgrpo", help="experiments/<name>.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--compare", default=None, help="options of the second arm, e.g. --model.advantage=GroupNorm")
    parser.add_argument("--warm-up-seed", type=int, default=None, help="one warm-up for all seeds")
    parser.add_argument("--tail", type=int, default=50, help="rollouts averaged for the ablation table")
    parser.add_argument("--keep", type=Path, default=None, help="keep the runs' logs and caches in this directory")
    parser.add_argument("extra", nargs="*", help="options added to every run (after --)")
    args = parser.parse_args()

    arms = {"base": list(args.extra)}
    if args.compare:
        arms[args.compare] = [*args.extra, *args.compare.split()]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    warm_seed = "each seed's own" if args.warm_up_seed is None else args.warm_up_seed
    print(
        f"experiments/{args.experiment}.yaml, seeds {args.seeds}, warm-up seed {warm_seed}, "
        f"{os.cpu_count()} cores, one thread per run"
    )
    rows: dict[str, list[dict]] = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory(prefix="rlkit-learning-") as scratch:
        tmp = args.keep or Path(scratch)
        for seed in args.seeds:
            env["RLKIT_CACHE"] = str(Path(tmp) / f"cache-{seed}")  # new and empty for each seed
            warm_up_seed = seed if args.warm_up_seed is None else args.warm_up_seed
            checkpoint, record = warm_up(warm_up_seed, Path(env["RLKIT_CACHE"]), env)
            for k, (arm, extra) in enumerate(arms.items()):
                run = fit(args.experiment, seed, checkpoint, extra, Path(tmp) / f"run-{seed}-{k}", env)
                val = run["scalars"]["val/reward"]
                row = {
                    "seed": seed,
                    "warm_steps": record["steps"],
                    "warm_accuracy": record["accuracy"],
                    "start": val[0],
                    "end": val[-1],
                    "wall": record["wall"] + run["wall"],
                    "cpu": record["cpu"] + run["cpu"],
                    "load": run["load"],
                    **{m: _tail_mean(run["scalars"].get(m, []), args.tail) for m in TAIL_METRICS},
                }
                rows[arm].append(row)
                print(
                    f"[{arm}] seed {seed}: warm-up {row['warm_steps']} steps to {row['warm_accuracy']:.3f} "
                    f"(worked solutions) | val/reward {row['start'][1]:.3f} (step {row['start'][0]}) -> "
                    f"{row['end'][1]:.3f} (step {row['end'][0]}), gain {row['end'][1] - row['start'][1]:+.3f} | "
                    f"wall: warm-up {record['wall']:.0f} s + fit {run['wall']:.0f} s = {row['wall']:.0f} s | "
                    f"CPU: {record['cpu']:.0f} s + {run['cpu']:.0f} s = {row['cpu']:.0f} s | load {run['load']:.1f}",
                    flush=True,
                )
    for arm, results in rows.items():
        gains = [r["end"][1] - r["start"][1] for r in results]
        print(
            f"[{arm}] over {len(results)} seeds: start {_spread([r['start'][1] for r in results])}, "
            f"end {_spread([r['end'][1] for r in results])}, gain {_spread(gains)} (min {min(gains):+.3f}), "
            f"wall {_spread([r['wall'] for r in results], 0)} s, CPU {_spread([r['cpu'] for r in results], 0)} s"
        )
    if args.compare:
        base, other = rows["base"], rows[args.compare]
        print(f"\nlast {args.tail} rollouts, mean over seeds (spread = max - min over seeds):")
        print(f"| metric | base | {args.compare} | difference per seed |")
        print("|---|---|---|---|")
        for metric in ("end", *TAIL_METRICS):
            a = [r[metric][1] if metric == "end" else r[metric] for r in base]
            b = [r[metric][1] if metric == "end" else r[metric] for r in other]
            name = "val/reward (end)" if metric == "end" else metric
            diffs = ", ".join(f"{y - x:+.3f}" for x, y in zip(a, b, strict=True))
            print(f"| {name} | {_spread(a)} | {_spread(b)} | {diffs} |")


if __name__ == "__main__":
    main()
