"""``benchmarks/study_wall.py``: held-out reward against wall seconds, read from a study's event files.

A hand-made study folder (two variants x two seeds, ``val/reward`` written with chosen wall times) stands
in for a real one, so the numbers below are worked by hand.
"""

from __future__ import annotations

import importlib.util
import json
import time

import pytest
from spine.helpers import EXPERIMENTS, ROOT

from rlkit.studies.plan import Factor, Study, Variant

# (rollout, seconds after the writer's first event, held-out reward), per variant and seed
CHECKS = {
    "base": {0: [(0, 5.0, 0.30), (10, 15.0, 0.50)], 1: [(0, 7.0, 0.30), (10, 27.0, 0.70)]},
    "max_staleness=1": {0: [(0, 4.0, 0.30), (10, 10.0, 0.40)], 1: [(0, 4.0, 0.30), (10, 12.0, 0.60)]},
}


def _module():
    spec = importlib.util.spec_from_file_location("study_wall", ROOT / "benchmarks" / "study_wall.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    from torch.utils.tensorboard import SummaryWriter

    directory = tmp_path_factory.mktemp("wall") / "study"
    study = Study(
        directory,
        [str(EXPERIMENTS / "drgrpo.yaml")],
        [Factor("data.max_staleness", ("0", "1"))],
        [0, 1],
        variants=[Variant("base"), Variant("max_staleness=1", {"data.max_staleness": "1"})],
    )
    study.save()
    for name, seeds in CHECKS.items():
        for seed, checks in seeds.items():
            run = study.run_dir(next(v for v in study.variants if v.name == name), seed)
            start = time.time()  # the writer's first event (file_version) is written now
            writer = SummaryWriter(str(run))
            for rollout, seconds, reward in checks:
                writer.add_scalar("val/reward", reward, rollout, walltime=start + seconds)
            writer.close()
            (run / "run.json").write_text(json.dumps({"status": "finished", "wall_s": 30.0}))
    return study


def test_the_table_reads_each_runs_last_check_before_each_second(study):
    wall = _module()
    runs = wall.study_checks(study)
    assert [len(c) for c in runs["base"].values()] == [2, 2]
    # after 20 s: base seed 0 has checked at 15 s (0.50), seed 1 only at 7 s (0.30): mean 0.40, std 0.141
    assert wall.reward_after(runs["base"][0], 20) == pytest.approx(0.50)
    assert wall.reward_after(runs["base"][1], 20) == pytest.approx(0.30)
    assert wall.reward_after(runs["base"][1], 3) != wall.reward_after(runs["base"][1], 3)  # NaN: no check yet
    table = wall.markdown(runs, [20.0]).splitlines()
    assert table[2].startswith("| `base` | 2 | 0.400 ± 0.141 |")
    assert table[3].startswith("| `max_staleness=1` | 2 | 0.500 ± 0.141 |")
    # seconds per rollout to the last check: base 1.5 and 2.7 s -> 2.10 ± 0.85; max_staleness=1 1.0 and 1.2
    assert table[2].endswith("| 2.10 ± 0.85 |") and table[3].endswith("| 1.10 ± 0.14 |")


def test_seeds_are_averaged_check_by_check(study):
    wall = _module()
    xs, ys, sd = wall.averaged(wall.study_checks(study)["base"])
    assert xs == pytest.approx([6.0, 21.0], abs=0.05) and ys == pytest.approx([0.30, 0.60])
    assert sd == pytest.approx([0.0, 0.1414], abs=1e-3)
    # every run has a value at each default second: the earliest final check (10 s) bounds them
    assert wall.default_seconds(wall.study_checks(study)) == [10.0]


def test_the_script_writes_the_plot_and_the_table(study, capsys):
    pytest.importorskip("matplotlib")
    _module().main([str(study.directory), "--seconds", "10,20", "--dashed", "staleness"])
    assert (study.directory / "wall.png").stat().st_size > 0
    assert "held-out after 20 s" in (study.directory / "wall.md").read_text()
    assert "wrote" in capsys.readouterr().out
