"""Held-out reward against wall seconds for a finished ``rlkit ablate`` study: ``wall.png`` and ``wall.md``.

    python benchmarks/study_wall.py docs/studies/async-staleness                  # seconds chosen from the runs
    python benchmarks/study_wall.py docs/studies/async-staleness --seconds 60,120,180 --dashed rollout_correction

``rlkit compare`` puts rollouts on the x axis; a schedule that overlaps generation with training
(``data.max_staleness >= 1``) pays in accuracy per rollout and wins, if at all, in rollouts per second.
This reads each finished run's greedy held-out checks (``val/reward``) with their TensorBoard event
``wall_time``, relative to the run's first event (written when ``trainer.fit`` starts logging, before the
check that precedes any update; the process's imports and config parsing before it are the same for every
variant and left out). Per variant, averaged over seeds check by check (every run checks at the same
rollouts): the plot puts the mean held-out reward (± std band) at the mean wall second of each check. The
table gives, for each ``N`` of ``--seconds``, the held-out reward of each run's last check at or before
``N`` seconds (mean ± std over the seeds that had one), and the seconds per rollout from the run's start to
its last check (validation included: every variant runs the same checks).

Wall seconds depend on the machine and what else runs on it: report the load beside them.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlkit.studies.plan import Study  # noqa: E402
from rlkit.studies.report import HELD_OUT, mean_std  # noqa: E402
from rlkit.studies.runner import is_finished, runs_of  # noqa: E402

Check = tuple[int, float, float]  # (rollout, seconds since the run's start, held-out reward)


def held_out_checks(directory: Path) -> list[Check]:
    """One run's held-out checks in rollout order; the last value per rollout (a resumed run logs again)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    accumulator.Reload()
    if HELD_OUT not in accumulator.Tags()["scalars"]:
        return []
    start = accumulator.FirstEventTimestamp()
    points = {event.step: (event.wall_time - start, event.value) for event in accumulator.Scalars(HELD_OUT)}
    return [(step, *points[step]) for step in sorted(points)]


def study_checks(study: Study) -> dict[str, dict[int, list[Check]]]:
    """``variant -> seed -> checks`` for every finished run."""
    out: dict[str, dict[int, list[Check]]] = {v.name: {} for v in study.variants}
    for run in runs_of(study):
        if is_finished(run.directory):
            out[run.variant.name][run.seed] = held_out_checks(run.directory)
    return out


def reward_after(checks: list[Check], seconds: float) -> float:
    """The held-out reward of the last check at or before ``seconds`` (NaN before the first)."""
    done = [reward for _, t, reward in checks if t <= seconds]
    return done[-1] if done else math.nan


def seconds_per_rollout(checks: list[Check]) -> float:
    rollout, t, _ = checks[-1]
    return t / rollout if rollout else math.nan


def default_seconds(runs: dict[str, dict[int, list[Check]]], count: int = 4) -> list[float]:
    """``count`` evenly spaced seconds up to the earliest final check of any run, rounded to 10 s, so every
    run has a value at each."""
    last = min(checks[-1][1] for seeds in runs.values() for checks in seeds.values() if checks)
    return sorted({max(10.0, round(last * (i + 1) / count / 10) * 10) for i in range(count)})


def _cell(stats: tuple[float, float, int], digits: int = 3) -> str:
    mean, std, n = stats
    if n == 0:
        return "—"
    return f"{mean:.{digits}f}" if math.isnan(std) else f"{mean:.{digits}f} ± {std:.{digits}f}"


def markdown(runs: dict[str, dict[int, list[Check]]], seconds: list[float]) -> str:
    header = ["variant", "seeds", *(f"held-out after {s:.0f} s" for s in seconds), "s per rollout"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, seeds in runs.items():
        checked = [checks for checks in seeds.values() if checks]
        if not checked:
            continue
        cells = [f"`{name}`", str(len(checked))]
        for s in seconds:
            stats = mean_std([reward_after(checks, s) for checks in checked])
            cells.append(_cell(stats) + (f" (n={stats[2]})" if stats[2] < len(checked) else ""))
        cells.append(_cell(mean_std([seconds_per_rollout(checks) for checks in checked]), 2))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def averaged(seeds: dict[int, list[Check]]) -> tuple[list[float], list[float], list[float]]:
    """Check by check over seeds (the rollouts every seed checked): mean seconds, mean and std reward."""
    by_rollout: dict[int, list[tuple[float, float]]] = {}
    for checks in seeds.values():
        for rollout, t, reward in checks:
            by_rollout.setdefault(rollout, []).append((t, reward))
    shared = [r for r in sorted(by_rollout) if len(by_rollout[r]) == len(seeds)]
    xs = [statistics.fmean(t for t, _ in by_rollout[r]) for r in shared]
    ys = [statistics.fmean(v for _, v in by_rollout[r]) for r in shared]
    sd = [statistics.stdev(v for _, v in by_rollout[r]) if len(seeds) > 1 else 0.0 for r in shared]
    return xs, ys, sd


def plot(study: Study, runs: dict[str, dict[int, list[Check]]], path: Path, dashed: str | None = None) -> None:
    """``dashed``: variants whose name holds it are drawn dashed (one factor's levels, told apart at a glance)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for k, (name, seeds) in enumerate(runs.items()):
        seeds = {s: c for s, c in seeds.items() if c}
        if not seeds:
            continue
        xs, ys, sd = averaged(seeds)
        color, style = f"C{k % 10}", "--" if dashed and dashed in name else "-"
        ax.plot(xs, ys, style, color=color, marker="o", markersize=3, label=f"{name} (n={len(seeds)})")
        ax.fill_between(
            xs,
            [y - s for y, s in zip(ys, sd, strict=True)],
            [y + s for y, s in zip(ys, sd, strict=True)],
            color=color,
            alpha=0.12,
        )
    ax.set_xlabel("wall seconds since the run's start (mean over seeds at each check)")
    ax.set_ylabel("held-out reward (greedy)")
    ax.set_title(f"{study.directory.name}: held-out reward against wall time, mean ± std over seeds", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("study", type=Path, help="the study folder (rlkit ablate --study DIR)")
    parser.add_argument(
        "--seconds", help="comma-separated wall seconds for the table (default: 4 up to the earliest final check)"
    )
    parser.add_argument("--dashed", help="draw the variants whose name holds this dashed, e.g. rollout_correction")
    options = parser.parse_args(argv)
    study = Study.load(options.study)
    runs = study_checks(study)
    if not any(checks for seeds in runs.values() for checks in seeds.values()):
        sys.exit(f"study_wall.py: no finished run with {HELD_OUT} in {options.study}: run the study first")
    seconds = [float(s) for s in options.seconds.split(",")] if options.seconds else default_seconds(runs)
    table = markdown(runs, seconds)
    (options.study / "wall.md").write_text(table + "\n")
    plot(study, runs, options.study / "wall.png", options.dashed)
    print(table)
    print(f"wrote {options.study / 'wall.md'} and {options.study / 'wall.png'}")


if __name__ == "__main__":
    main()
