"""A study's definition, variants and statistics, without running anything."""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path

import pytest
from spine.helpers import EXPERIMENTS

from rlkit.cli import main
from rlkit.errors import ConfigError
from rlkit.studies import report
from rlkit.studies.plan import Factor, Study, Variant, default_directory, normalise_overrides, split_top_level
from rlkit.studies.variants import resolve

DRGRPO = str(EXPERIMENTS / "drgrpo.yaml")
EVERY_STEP = Path(__file__).parents[1] / "spine" / "checkpoint_every_step.yaml"


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(logging, "raiseExceptions", False)  # see tests/spine/test_cli_errors.py


def test_vary_values_split_on_top_level_commas_only():
    factor = Factor.parse("--model.clip={class_path: PPOClip, init_args: {eps_high: 0.28}},NoClip")
    assert factor.key == "model.clip"
    assert factor.values == ("{class_path: PPOClip, init_args: {eps_high: 0.28}}", "NoClip")
    assert split_top_level("'a,b',[1, 2],c") == ["'a,b'", "[1, 2]", "c"]


@pytest.mark.parametrize(
    "text,message",
    [
        ("model.advantage", "KEY=VALUE1,VALUE2"),
        ("model.advantage=", "KEY=VALUE1,VALUE2"),
        ("model.advantage=GroupNorm,GroupNorm", "distinct"),
        ("model.advantage=GroupNorm,,RLOO", "non-empty"),
        ("seed_everything=1,2", "--seeds"),
        ("trainer.logger.init_args.name=a,b", "set by the study"),
    ],
)
def test_malformed_vary_syntax(text, message):
    with pytest.raises(ConfigError, match=message):
        Factor.parse(text)


def test_overrides_are_normalised_and_may_not_fight_a_factor():
    assert normalise_overrides(["--a", "1", "--b=2"]) == ["--a=1", "--b=2"]
    with pytest.raises(ConfigError, match="needs a value"):
        normalise_overrides(["--a"])
    factors = [Factor.parse("model.advantage=GroupNorm")]
    with pytest.raises(ConfigError, match="both varied"):
        Study("s", [DRGRPO], factors, [0], overrides=["--model.advantage=RLOO"])
    with pytest.raises(ConfigError, match="sets --ckpt_path"):
        Study("s", [DRGRPO], factors, [0], overrides=["--ckpt_path=last"])


def test_the_default_folder_is_named_by_config_and_keys():
    factors = [Factor.parse("model.advantage=A"), Factor.parse("model.clip.init_args.eps_high=0.28")]
    assert default_directory([DRGRPO], factors, grid=False) == Path("studies/drgrpo-advantage-clip.eps_high")
    assert default_directory([DRGRPO], factors, grid=True) == Path("studies/drgrpo-advantage-clip.eps_high-grid")


def test_the_base_value_is_found_by_resolving_the_config():
    """GroupMean is drgrpo.yaml's own advantage: it is the base wherever it is listed; the full class
    path of the base's aggregation is the base too."""
    factors = [
        Factor.parse("model.advantage=GroupNorm,GroupMean"),
        Factor.parse("model.aggregation=rlkit.components.SeqMeanTokenSumNorm,SeqMeanTokenMean"),
    ]
    study = Study("s", [DRGRPO], factors, [0, 1])
    assert [(v.name, v.changes) for v in resolve(study)] == [
        ("base", {}),
        ("advantage=GroupNorm", {"model.advantage": "GroupNorm"}),
        ("aggregation=SeqMeanTokenMean", {"model.aggregation": "SeqMeanTokenMean"}),
    ]
    study.grid = True
    assert [v.name for v in resolve(study)] == [
        "base",
        "aggregation=SeqMeanTokenMean",
        "advantage=GroupNorm",
        "advantage=GroupNorm,aggregation=SeqMeanTokenMean",
    ]


def test_a_config_that_writes_every_run_into_one_folder_is_refused():
    study = Study("s", [DRGRPO, str(EVERY_STEP)], [Factor.parse("model.advantage=GroupNorm")], [0])
    with pytest.raises(ConfigError, match="fixed dirpath"):
        resolve(study)


def test_a_different_study_in_the_same_folder_is_refused(capsys):
    args = ["ablate", f"--config={DRGRPO}", "--vary=model.advantage=GroupNorm", "--study=s"]
    variants = [Variant("base"), Variant("advantage=GroupNorm", {"model.advantage": "GroupNorm"})]
    study = Study("s", [DRGRPO], [Factor.parse("model.advantage=GroupNorm")], [0], variants=variants)
    study.save()
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--seeds=3"])
    assert exit_info.value.code == 2
    assert "s holds another study (its seeds differ)" in capsys.readouterr().err
    main([*args, "--dry-run"])  # the same study: accepted
    assert "--model.advantage=GroupNorm --seed_everything=0" in capsys.readouterr().out
    study.variants = variants[:1]  # as if GroupNorm had been the config's own advantage then
    study.save()
    with pytest.raises(SystemExit):
        main([*args, "--dry-run"])
    assert "variants now resolve to ['base', 'advantage=GroupNorm'], not ['base']" in capsys.readouterr().err


def test_differences_from_the_base_are_paired_by_seed():
    study = Study("s", [DRGRPO], [Factor.parse("model.advantage=GroupNorm")], [0, 1, 2])
    study.variants = [Variant("base"), Variant("advantage=GroupNorm", {"model.advantage": "GroupNorm"})]

    def run(final_val):
        return {"final_val": final_val, "best_val": 1.0, "final_train": 0.5, "tokens_per_s": 10.0, "wall_s": 2.0}

    data = report.StudyData(
        curves={"base": {}, "advantage=GroupNorm": {}},
        values={
            "base": {0: run(0.5), 1: run(0.7), 2: run(0.9)},
            "advantage=GroupNorm": {0: run(0.6), 1: run(0.9)},  # seed 2 not finished
        },
        missing=["advantage=GroupNorm seed=2 (running)"],
    )
    base, variant = report.table(study, data)
    assert base["final_val"][:2] == pytest.approx((0.7, 0.2)) and base["final_val"][2] == 3
    mean, std, n = variant["delta:final_val"]  # seeds 0 and 1: +0.1, +0.2
    assert (mean, std, n) == (pytest.approx(0.15), pytest.approx(math.sqrt(0.005)), 2)
    assert variant["delta:best_val"] == (0.0, 0.0, 2) and "delta:wall_s" not in variant
    table = report.markdown_table(study, [base, variant])
    assert "| `advantage=GroupNorm` | 2 | 0.750 ± 0.212 | +0.150 ± 0.071 |" in table


def test_a_held_out_metric_is_its_final_check_and_a_rollout_metric_its_last_ten_rollouts():
    study = Study("s", [DRGRPO], [], [0])
    study.metrics = ["val/accuracy", "episode/turns"]
    checks = ([0, 25, 50, 75, 100], [0.1, 0.2, 0.3, 0.4, 0.6])
    per_rollout = (list(range(20)), [1.0] * 10 + [2.0] * 9 + [3.0])
    values = report.run_values({"val/accuracy": checks, "episode/turns": per_rollout}, {}, study)
    assert values["final:val/accuracy"] == 0.6
    assert values["last:episode/turns"] == pytest.approx(2.1)
    labels = [m.label for m in report.measures(study)]
    assert "val/accuracy, final" in labels and "episode/turns, last 10" in labels


def test_a_whole_component_given_inline_names_its_variant_by_class_and_settings():
    factor = Factor.parse("model.clip={class_path: PPOClip, init_args: {eps_high: 0.28}},NoClip")
    names = [v.name for v in resolve(Study("s", [DRGRPO], [factor], [0]))]
    assert names == ["base", "clip=PPOClip+eps_high=0.28", "clip=NoClip"]


def test_a_resume_after_a_change_to_an_included_config_is_refused(tmp_path):
    preset = tmp_path / "preset.yaml"
    preset.write_text("model:\n  init_args:\n    advantage: GroupMean\n")
    experiment = tmp_path / "experiment.yaml"
    experiment.write_text(f"defaults: [{preset.name}]\nseed_everything: 0\n")
    study = Study("s", [DRGRPO, str(experiment)], [], [0])
    study.check_configs_unchanged()
    preset.write_text("model:\n  init_args:\n    advantage: GroupNorm\n")  # the experiment file itself is unchanged
    with pytest.raises(ConfigError, match="changed since the study began"):
        study.check_configs_unchanged()


def test_an_included_config_with_a_long_body_of_its_own_is_hashed(tmp_path):
    preset = tmp_path / "preset.yaml"
    preset.write_text("model:\n  init_args:\n    advantage: GroupMean\n")
    experiment = tmp_path / "experiment.yaml"
    body = "".join(f"  key_{i}: {'x' * 20}\n" for i in range(20))  # longer than a file name may be
    experiment.write_text(f"defaults: [{preset.name}]\nextra:\n{body}")
    study = Study("s", [str(experiment)], [], [0])
    study.check_configs_unchanged()
    experiment.write_text(f"defaults: [{preset.name}]\nextra:\n{body}  key_last: y\n")
    with pytest.raises(ConfigError, match="changed since the study began"):
        study.check_configs_unchanged()


@pytest.mark.parametrize(
    "cut,what",
    [
        (0.5, r"not valid YAML at line \d+|should be|no "),  # in the middle of a line
        ("variants:", "no variants, report"),  # at a line boundary: later sections gone
        (0.0, "it is empty"),
    ],
)
def test_a_damaged_study_file_is_named_with_what_is_wrong(cut, what, capsys):
    study = Study("s", [DRGRPO], [Factor.parse("model.advantage=GroupNorm")], [0, 1], variants=[Variant("base")])
    study.save()
    path = Path("s") / "study.yaml"
    text = path.read_text()
    damaged = text[: text.index(cut)] if isinstance(cut, str) else text[: int(len(text) * cut)]
    path.write_text(damaged)
    for command in (["compare", "s"], ["ablate", "--resume", "s"]):
        with pytest.raises(SystemExit) as exit_info:
            main(command)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1  # one line, no traceback
        assert err.startswith(f"rlkit: error: {path}: ") and re.search(what, err), err
        assert "the file is damaged (cut short, or edited)" in err
    assert path.read_text() == damaged and sorted(p.name for p in Path("s").iterdir()) == ["study.yaml"]


def test_compare_refuses_a_metric_no_run_logged():
    """``rlkit compare --metrics policy/entrpy`` (a typo) names the tag and lists the runs' own tags."""
    from rlkit.errors import ConfigError
    from rlkit.studies.report import StudyData, check_metrics

    curves = {"policy/entropy": ([1], [0.5]), "val/reward": ([0], [0.1])}
    data = StudyData(curves={"base": {0: curves}, "advantage=GroupNorm": {}}, values={}, missing=[])
    check_metrics(["policy/entropy"], data)
    with pytest.raises(
        ConfigError,
        match=r"policy/entrpy \(did you mean policy/entropy\?\); the runs' tags: "
        r"policy/entropy, val/reward",
    ):
        check_metrics(["policy/entropy", "policy/entrpy"], data)
