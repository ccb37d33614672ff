"""A study's comparison: TensorBoard events of its finished runs to ``summary.md``, ``summary.csv``,
``runs.csv`` and ``reward.png`` (plus one plot per extra metric).

Per run: the final and the best greedy held-out reward (``val/reward``: before the first update, at
every check and after the last update), the sampled training reward over the last 10 rollouts
(``hp/train_reward``), the rollouts it took to reach a held-out reward threshold, the median
``perf/tokens_per_s`` and the run's wall time (its ``rlkit fit`` processes, summed over attempts).
Per variant: mean ± sample standard deviation over seeds, and the difference from the base *paired by
seed* (every seed runs the same data order in both arms), mean ± std of the per-seed differences.
"""

from __future__ import annotations

import csv
import io
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from rlkit.studies.plan import Study, Variant
from rlkit.studies.runner import read_state, run_status, runs_of

SMOOTHING = 10  # rollouts, as hp/train_reward
HELD_OUT, TRAIN = "val/reward", "hp/train_reward"


def held_out_tag(tag: str) -> bool:
    """A ``val/*`` tag is logged at each held-out check, not each rollout: its final value is reported and
    its curve is not smoothed (a mean of its last 10 points would reach back to the first checks)."""
    return tag.startswith("val/")


def metric_key(tag: str) -> str:
    return f"final:{tag}" if held_out_tag(tag) else f"last:{tag}"


@dataclass
class Measure:
    """One column of the comparison: how a run's value is read from its curves."""

    key: str
    label: str
    digits: int = 3
    paired: bool = True  # reported as a difference from the base too
    short: str = ""  # the difference column's label


def measures(study: Study) -> list[Measure]:
    out = [
        Measure("final_val", "held-out reward, final", short="final held-out"),
        Measure("best_val", "held-out reward, best", short="best held-out"),
        Measure("final_train", f"train reward, last {SMOOTHING}", short="train"),
    ]
    if study.threshold is not None:
        out.append(Measure("to_threshold", f"rollouts to held-out {study.threshold:g}", 0, paired=False))
    out += [
        Measure(metric_key(tag), f"{tag}, {'final' if held_out_tag(tag) else f'last {SMOOTHING}'}", short=tag)
        for tag in study.metrics
    ]
    out += [Measure("tokens_per_s", "tokens/s (median)", 0, paired=False), Measure("wall_s", "wall (s)", 0, False)]
    return out


# ---- reading runs ----


def read_scalars(directory: Path) -> dict[str, tuple[list[int], list[float]]]:
    """Every scalar curve of one run, ``tag -> (steps, values)``, last value per step (resumed runs); the
    HPARAMS metrics (``hp/*``) from the run's ``hparams`` sub-run."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rlkit.spine.reporting import HPARAMS_RUN

    curves = {}
    for run in (Path(directory), Path(directory) / HPARAMS_RUN):
        if not run.is_dir():
            continue
        accumulator = EventAccumulator(str(run), size_guidance={"scalars": 0})
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            points = {event.step: event.value for event in accumulator.Scalars(tag)}
            steps = sorted(points)
            curves[tag] = (steps, [points[s] for s in steps])
    return curves


def run_values(curves: dict, state: dict, study: Study) -> dict[str, float]:
    """The measures of one run (NaN where a curve is missing)."""
    nan = math.nan
    steps, held_out = curves.get(HELD_OUT, ([], []))
    values = {
        "final_val": held_out[-1] if held_out else nan,
        "best_val": max(held_out) if held_out else nan,
        "final_train": curves.get(TRAIN, ([], [nan]))[1][-1],
        "tokens_per_s": statistics.median(curves.get("perf/tokens_per_s", ([], [nan]))[1]),
        "wall_s": state.get("wall_s", nan),
        "rollouts": curves.get("reward/mean", ([-1], []))[0][-1] + 1,  # x = the rollout's index, from 0
    }
    if study.threshold is not None:
        reached = [s for s, v in zip(steps, held_out, strict=True) if v >= study.threshold]
        values["to_threshold"] = reached[0] if reached else nan
    for tag in study.metrics:
        tail = curves.get(tag, ([], []))[1][-(1 if held_out_tag(tag) else SMOOTHING) :]
        values[metric_key(tag)] = sum(tail) / len(tail) if tail else nan
    return values


def outcome(run) -> str:
    """One line on a finished run: its held-out reward before and after, its last training reward."""
    curves = read_scalars(run.directory)
    held_out, train = curves.get(HELD_OUT, ([], []))[1], curves.get(TRAIN, ([], []))[1]
    parts = [f"held-out reward {held_out[0]:.3f} -> {held_out[-1]:.3f}"] if held_out else []
    parts += [f"train reward {train[-1]:.3f}"] if train else []
    return ", ".join(parts) or "no reward curves logged"


@dataclass
class StudyData:
    """Finished runs' curves and values, by variant name and seed."""

    curves: dict[str, dict[int, dict]]
    values: dict[str, dict[int, dict[str, float]]]
    missing: list[str]


def load(study: Study) -> StudyData:
    curves: dict[str, dict[int, dict]] = {v.name: {} for v in study.variants}
    values: dict[str, dict[int, dict[str, float]]] = {v.name: {} for v in study.variants}
    missing = []
    for run in runs_of(study):
        state = read_state(run.directory)
        if state.get("status") != "finished":
            missing.append(f"{run.label} ({run_status(run.directory)})")
            continue
        run_curves = read_scalars(run.directory)
        curves[run.variant.name][run.seed] = run_curves
        values[run.variant.name][run.seed] = run_values(run_curves, state, study)
    return StudyData(curves, values, missing)


def check_metrics(metrics: list[str], data: StudyData) -> None:
    """A ``--metrics`` tag that no finished run logged (a typo: ``policy/entrpy``) is a ``ConfigError``
    listing the tags the runs have, rather than an empty column and an empty plot."""
    known = sorted({tag for runs in data.curves.values() for curves in runs.values() for tag in curves})
    unknown = [tag for tag in metrics if tag not in known]
    if not unknown:
        return
    import difflib

    from rlkit.errors import ConfigError

    close = {tag: difflib.get_close_matches(tag, known, n=1) for tag in unknown}
    named = ", ".join(f"{tag} (did you mean {close[tag][0]}?)" if close[tag] else tag for tag in unknown)
    raise ConfigError(f"--metrics: no finished run logged {named}; the runs' tags: {', '.join(known)}")


# ---- statistics ----


def mean_std(xs: list[float]) -> tuple[float, float, int]:
    """Mean and sample standard deviation of the finite values, and how many there were."""
    finite = [x for x in xs if x is not None and math.isfinite(x)]
    if not finite:
        return math.nan, math.nan, 0
    return statistics.fmean(finite), statistics.stdev(finite) if len(finite) > 1 else math.nan, len(finite)


def table(study: Study, data: StudyData) -> list[dict]:
    """One row per variant with runs: ``{key: (mean, std, n)}`` and ``delta:key`` against the base."""
    base = data.values[study.base.name]
    rows = []
    for variant in study.variants:
        runs = data.values[variant.name]
        if not runs:
            continue
        row: dict = {"variant": variant, "seeds": sorted(runs)}
        for measure in measures(study):
            row[measure.key] = mean_std([v[measure.key] for v in runs.values()])
            if measure.paired and not variant.is_base:
                paired = [runs[s][measure.key] - base[s][measure.key] for s in runs if s in base]
                row[f"delta:{measure.key}"] = mean_std(paired)
        rows.append(row)
    return rows


# ---- writing ----


def _cell(stats: tuple[float, float, int], digits: int, signed: bool = False) -> str:
    mean, std, n = stats
    if n == 0:
        return "—"
    sign = "+" if signed else ""
    text = f"{mean:{sign}.{digits}f}"
    return text if math.isnan(std) else f"{text} ± {std:.{digits}f}"


def markdown_table(study: Study, rows: list[dict]) -> str:
    cols = measures(study)
    header = ["variant", "seeds"]
    for m in cols:
        header.append(m.label)
        if m.paired:
            header.append(f"Δ {m.short}")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        variant: Variant = row["variant"]
        cells = [f"`{variant.name}`", str(len(row["seeds"]))]
        for m in cols:
            cell = _cell(row[m.key], m.digits)
            if m.key == "to_threshold":
                cell += f" ({row[m.key][2]}/{len(row['seeds'])} reached)"
            cells.append(cell)
            if m.paired:
                cells.append("(base)" if variant.is_base else _cell(row[f"delta:{m.key}"], m.digits, signed=True))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def command_line(study: Study) -> str:
    seeds = study.seeds
    given = str(len(seeds)) if seeds == list(range(len(seeds))) else ",".join(map(str, seeds))
    parts = ["rlkit ablate", *(f"--config {c}" for c in study.configs)]
    parts += [f"--vary {f.key}={','.join(f.values)}" for f in study.factors]
    parts += [f"--seeds {given}", *(["--grid"] if study.grid else []), *study.overrides]
    return " ".join(parts)


def write(study: Study, out: Path | None = None) -> str:
    """Write the summary files into the study folder; return the markdown table."""
    out = Path(out or study.directory)
    out.mkdir(parents=True, exist_ok=True)
    data = load(study)
    rows = table(study, data)
    if not rows:
        raise FileNotFoundError(f"no finished run in {study.directory}: run the study first (rlkit ablate --resume)")
    check_metrics(study.metrics, data)
    md = markdown_table(study, rows)
    plots = plot(study, data, out)
    total = sum(v["wall_s"] for runs in data.values.values() for v in runs.values() if math.isfinite(v["wall_s"]))
    rollouts = sorted({int(v["rollouts"]) for runs in data.values.values() for v in runs.values()})
    levels = "; ".join(f"`{f.key}` ∈ {{{', '.join(f.values)}}}" for f in study.factors) or "none (seeds only)"
    text = [
        f"# Study `{study.directory.name}`",
        "",
        f"Command: `{command_line(study)}`",
        "",
        f"Factors: {levels}; {'full grid' if study.grid else 'one factor at a time'}; base config: "
        + ", ".join(f"`{c}`" for c in study.configs)
        + f"; seeds {', '.join(map(str, study.seeds))}; rollouts per run: {', '.join(map(str, rollouts))}.",
        f"Wall time of all runs together: {total:.0f} s ({total / 60:.1f} min).",
        "",
        md,
        "",
        "Mean ± sample standard deviation over seeds. Δ: the difference from the base run with the same seed "
        "(same data order and sampling seeds), mean ± std over seeds. Held-out reward: greedy, on the held-out "
        f"prompts (`{HELD_OUT}`), final = after the last update, best = the highest check (the check before any "
        f"update included). Train reward: sampled, mean of the last {SMOOTHING} rollouts (`{TRAIN}`); other "
        f"tags likewise, except held-out ones (`val/*`): their final check. "
        "tokens/s: median over rollouts of `perf/tokens_per_s`. Wall: the run's `rlkit fit` processes.",
    ]
    if data.missing:
        text += ["", "Not included (not finished): " + ", ".join(data.missing) + "."]
    text += ["", *(f"![{name}]({name})" for name in plots)]
    (out / "summary.md").write_text("\n".join(text) + "\n")
    _write_csv(study, rows, out / "summary.csv")
    _write_runs_csv(study, data, out / "runs.csv")
    return md


def _write_csv(study: Study, rows: list[dict], path: Path) -> None:
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    cols = measures(study)
    header = ["variant", "changes", "seeds"]
    for m in cols:
        header += [f"{m.key}_mean", f"{m.key}_std", f"{m.key}_n"]
        if m.paired:
            header += [f"{m.key}_delta_mean", f"{m.key}_delta_std"]
    writer.writerow(header)
    for row in rows:
        variant = row["variant"]
        line = [variant.name, " ".join(variant.args), len(row["seeds"])]
        for m in cols:
            line += [_num(x) for x in row[m.key]]
            if m.paired:
                delta = row.get(f"delta:{m.key}", (0.0, 0.0, 0))
                line += [_num(delta[0]), _num(delta[1])]
        writer.writerow(line)
    path.write_text(buffer.getvalue())


def _write_runs_csv(study: Study, data: StudyData, path: Path) -> None:
    keys = [m.key for m in measures(study)] + ["rollouts"]
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(["variant", "seed", *keys])
    for name, runs in data.values.items():
        for seed, values in sorted(runs.items()):
            writer.writerow([name, seed, *(_num(values[k]) for k in keys)])
    path.write_text(buffer.getvalue())


def _num(x) -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.6g}"


# ---- plots ----


def plot(study: Study, data: StudyData, out: Path) -> list[str]:
    """``reward.png`` (held-out and training reward) and one PNG per extra metric; the file names."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("rlkit compare: matplotlib is not installed (pip install 'rlkit[ablate]'): no plots", file=sys.stderr)
        return []
    panels = [
        (
            "reward.png",
            [(HELD_OUT, "held-out reward (greedy)", 1), (TRAIN, f"train reward (sampled, last {SMOOTHING})", 1)],
        )
    ]
    panels += [
        (tag.replace("/", "_") + ".png", [(tag, tag, 1 if held_out_tag(tag) else SMOOTHING)]) for tag in study.metrics
    ]
    names = []
    for name, axes_spec in panels:
        fig, axes = plt.subplots(1, len(axes_spec), figsize=(5.5 * len(axes_spec), 3.8), squeeze=False)
        for ax, (tag, title, window) in zip(axes[0], axes_spec, strict=True):
            for k, variant in enumerate(study.variants):
                runs = data.curves[variant.name]
                if not runs:
                    continue
                steps, mean, std = _band([_smooth(c.get(tag, ([], [])), window) for c in runs.values()])
                if not steps:
                    continue
                color = f"C{k % 10}"
                style = {"marker": "o", "markersize": 3} if len(steps) < 20 else {}
                ax.plot(steps, mean, color=color, label=f"{variant.name} (n={len(runs)})", **style)
                if len(runs) > 1:
                    ax.fill_between(
                        steps,
                        [m - s for m, s in zip(mean, std, strict=True)],
                        [m + s for m, s in zip(mean, std, strict=True)],
                        color=color,
                        alpha=0.2,
                    )
            smoothing = f", mean of last {window} rollouts" if window > 1 else ""
            ax.set_title(title + smoothing, fontsize=10)
            ax.set_xlabel("rollout (= updates done before it)")
            ax.xaxis.get_major_locator().set_params(integer=True)
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=8)
        fig.suptitle(f"{study.directory.name}: mean ± std over seeds", fontsize=10)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        names.append(name)
    return names


def _smooth(curve: tuple[list[int], list[float]], window: int) -> dict[int, float]:
    steps, values = curve
    return {s: statistics.fmean(values[max(0, i - window + 1) : i + 1]) for i, s in enumerate(steps)}


def _band(curves: list[dict[int, float]]) -> tuple[list[int], list[float], list[float]]:
    """Mean and std over seeds at every step that some seed logged."""
    steps = sorted(set().union(*curves)) if curves else []
    mean, std = [], []
    for step in steps:
        xs = [c[step] for c in curves if step in c]
        mean.append(statistics.fmean(xs))
        std.append(statistics.stdev(xs) if len(xs) > 1 else 0.0)
    return steps, mean, std
