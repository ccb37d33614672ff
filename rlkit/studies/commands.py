"""``rlkit ablate`` and ``rlkit compare``: plain argparse commands beside LightningCLI's ``fit``.

Examples::

    rlkit ablate --config experiments/drgrpo.yaml \\
        --vary model.advantage=GroupMean,GroupNorm \\
        --vary model.aggregation=SeqMeanTokenSumNorm,SeqMeanTokenMean --seeds 3
    rlkit ablate --resume studies/drgrpo-advantage-aggregation
    rlkit compare studies/drgrpo-advantage-aggregation --metrics completion/length_neg_adv,policy/entropy
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rlkit.errors import ConfigError, RLKitError
from rlkit.studies import report
from rlkit.studies.locks import STUDY_LOCK, describe, holder, own_study
from rlkit.studies.plan import STUDY_FILE, Factor, Study, Variant, default_directory
from rlkit.studies.runner import StudyInterrupted, run_study
from rlkit.studies.variants import resolve

ABLATE = """\
Run a study: the base config, and each --vary value as its own variant (one factor at a time; every
combination with --grid), every variant once per seed with the same data order and seeds. Every run is
an `rlkit fit` with its own TensorBoard folder STUDY/runs/<variant>/seed=<s>; every variant is parsed by
`rlkit fit`'s parser before anything runs. A value that resolves to the base config's own value is the
base (listed or not). Options not listed below (--key=value) apply to every run.
At the end: STUDY/summary.md, summary.csv, runs.csv, reward.png. Rerunning the same command (or
--resume STUDY) skips finished runs and resumes interrupted ones from their last checkpoint. One process
runs a study at a time (STUDY/study.lock): a second one on the same folder stops at once (exit 2)."""


def _seeds(text: str) -> list[int]:
    try:
        return list(range(int(text))) if text.isdigit() else [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a count (3 = seeds 0,1,2) or a list (0,5,7)") from None


def _tags(text: str) -> list[str]:
    return [tag.strip() for tag in text.split(",") if tag.strip()]


def _report_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--threshold", type=float, help="report the rollouts each run took to reach this held-out reward"
    )
    parser.add_argument(
        "--metrics",
        type=_tags,
        help="more TensorBoard tags to tabulate and plot, e.g. completion/length_neg_adv,policy/entropy",
    )


def ablate(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="rlkit ablate",
        description=ABLATE,
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", action="append", default=[], help="base config (repeatable, composed in order)")
    parser.add_argument("--vary", action="append", default=[], metavar="KEY=V1,V2", help="a factor (repeatable)")
    parser.add_argument("--seeds", type=_seeds, default=[0], help="a count (3 = seeds 0,1,2) or a list (0,5,7)")
    parser.add_argument("--grid", action="store_true", help="every combination of the factors' values")
    parser.add_argument("--study", help="the study folder (default: studies/<config>-<varied keys>)")
    parser.add_argument("--resume", metavar="STUDY", help="continue the study in this folder (needs nothing else)")
    parser.add_argument("--parallel", type=int, default=1, help="runs at a time (default 1: one after another)")
    parser.add_argument("--dry-run", action="store_true", help="parse every variant, print the runs, run nothing")
    _report_options(parser)
    args, extra = parser.parse_known_args(argv)
    if args.parallel < 1:
        parser.error("--parallel must be at least 1")
    lock = None
    try:
        if args.resume:
            if args.config or args.vary or args.grid or args.study or extra:
                parser.error("--resume STUDY takes the study's own definition: give no --config, --vary or overrides")
            Study.load(args.resume)  # is it a study folder? (before a lock file is put there)
            lock = None if args.dry_run else own_study(Path(args.resume))
            study = Study.load(args.resume)  # read again, now that no other process can change it
            study.check_configs_unchanged()
            _resolve(study, saved=study.variants)
        else:
            if not args.config:
                parser.error("give the base config (--config FILE) or --resume STUDY")
            factors = [Factor.parse(text) for text in args.vary]
            directory = Path(args.study or default_directory(args.config, factors, args.grid))
            # an existing folder is taken before it is read; a new one once the variants parse (no folder
            # is left behind by a study that fails to parse)
            lock = own_study(directory) if directory.is_dir() and not args.dry_run else None
            study = Study(directory, args.config, factors, args.seeds, args.grid, extra)
            _resolve(study, saved=_same_study(study))
            if lock is None and not args.dry_run:
                lock = own_study(directory)
        _ablate(study, args)
    finally:
        if lock is not None:
            lock.release()


def _ablate(study: Study, args: argparse.Namespace) -> None:
    """Run a resolved study whose folder this process owns, then report on it."""
    if args.threshold is not None:
        study.threshold = args.threshold
    if args.metrics is not None:
        study.metrics = args.metrics
    runs = len(study.variants) * len(study.seeds)
    names = ", ".join(v.name for v in study.variants)
    print(
        f"rlkit ablate: study {study.directory}: {len(study.variants)} variants x {len(study.seeds)} seeds = "
        f"{runs} runs, {args.parallel} at a time: {names}",
        file=sys.stderr,
    )
    if args.dry_run:
        for variant in study.variants:
            for seed in study.seeds:
                print("rlkit " + " ".join(study.fit_args(variant, seed)))
        return
    study.save()
    try:
        failed = run_study(study, args.parallel, on_finish=report.outcome)
    except StudyInterrupted:
        print(f"rlkit ablate: interrupted; continue with: rlkit ablate --resume {study.directory}", file=sys.stderr)
        sys.exit(130)
    try:
        print(report.write(study))
        print(
            f"rlkit ablate: summary in {study.directory}/summary.md (tensorboard --logdir {study.directory})",
            file=sys.stderr,
        )
    except FileNotFoundError:
        if not failed:
            raise
    if failed:
        raise RLKitError(
            f"{len(failed)} of {runs} runs failed ({', '.join(r.label for r in failed)}); each run's output is in its "
            f"rlkit.log; after a fix, rlkit ablate --resume {study.directory} reruns only the unfinished ones"
        )


def _resolve(study: Study, saved: list[Variant]) -> None:
    """Parse every variant; a continued study must resolve to the variants its runs were made with."""
    study.variants = resolve(study)
    names, before = [v.name for v in study.variants], [v.name for v in saved]
    if saved and names != before:
        raise ConfigError(
            f"the study's variants now resolve to {names}, not {before} as when it began: the config or rlkit "
            "changed since; start a new study (--study DIR)"
        )


def _same_study(study: Study) -> list[Variant]:
    """A folder holds one study: rerunning its command continues it; a different study is refused.
    Returns the variants the folder's study was made with (none for a new folder)."""
    if not (study.directory / STUDY_FILE).is_file():
        return []
    existing = Study.load(study.directory)
    old, new = existing.definition(), study.definition()
    changed = [key for key in new if key != "config_sha256" and old.get(key) != new[key]]
    if changed:
        raise ConfigError(
            f"{study.directory} holds another study (its {', '.join(changed)} differ): continue it with "
            f"rlkit ablate --resume {study.directory}, or give this one its own folder with --study DIR"
        )
    existing.check_configs_unchanged()
    return existing.variants


def compare(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="rlkit compare",
        description="Compare a study's finished runs: writes summary.md, summary.csv, runs.csv and reward.png.",
        allow_abbrev=False,
    )
    parser.add_argument("study", help="the study folder (holds study.yaml)")
    _report_options(parser)
    args = parser.parse_args(argv)
    study = Study.load(args.study)
    if args.threshold is not None:
        study.threshold = args.threshold
    if args.metrics is not None:
        study.metrics = args.metrics
    owner = holder(study.directory / STUDY_LOCK)
    if owner is not None:
        print(
            f"rlkit compare: the study is still running ({owner.get('command', 'rlkit ablate')}, {describe(owner)}): "
            "this report covers the runs finished so far",
            file=sys.stderr,
        )
    try:
        table = report.write(study)
    except FileNotFoundError:
        if owner is None:
            raise
        raise FileNotFoundError(
            f"no finished run in {study.directory} yet: the study is still running ({describe(owner)}); "
            "compare again once a run has finished"
        ) from None
    print(table)
    print(f"rlkit compare: wrote {study.directory}/summary.md, summary.csv, runs.csv, reward.png", file=sys.stderr)
