"""``rlkit ablate`` / ``rlkit compare`` through the real command: run folders, hparams, summaries, resume."""

from __future__ import annotations

import csv
import json
import logging
import statistics

import pytest
import spine.helpers
import yaml
from spine.helpers import EXPERIMENTS, run_rlkit

from rlkit.cli import main
from rlkit.spine.reporting import HPARAMS_RUN

QUICK = [*spine.helpers.QUICK, "--trainer.enable_progress_bar=false"]
BASE_CONFIG = f"--config={EXPERIMENTS / 'drgrpo.yaml'}"
# GroupMean is drgrpo.yaml's own advantage: the base; listed second to show that order does not matter.
STUDY = ["ablate", BASE_CONFIG, "--vary", "model.advantage=GroupNorm,GroupMean", "--seeds", "2"]
RUNS = [(variant, seed) for variant in ("base", "advantage=GroupNorm") for seed in (0, 1)]


def _scalars(directory):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(directory), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


def _hparams(accumulator) -> dict:
    from tensorboard.plugins.hparams import plugin_data_pb2

    content = accumulator.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    info = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
    return {k: getattr(v, v.WhichOneof("kind")) for k, v in info.hparams.items()}


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """A 2-variant x 2-seed study of 3 rollouts per run, two runs at a time; then the same command again."""
    workdir = tmp_path_factory.mktemp("ablate")
    args = [*STUDY, "--study=study", "--parallel=2", "--metrics=policy/entropy", "--threshold=0.5", *QUICK]
    first = run_rlkit(args, cwd=workdir)
    assert first.returncode == 0, first.stderr[-3000:]
    events_after_first = sorted(p.name for p in (workdir / "study").rglob("events.out.tfevents.*"))
    second = run_rlkit(args, cwd=workdir)
    return workdir / "study", first, second, events_after_first


def test_every_variant_and_seed_is_its_own_named_run(study):
    directory, first, _, _ = study
    for variant, seed in RUNS:
        run = directory / "runs" / variant / f"seed={seed}"
        assert (run / "config.yaml").is_file() and (run / "checkpoints" / "last.ckpt").is_file()
        assert list(run.glob("events.out.tfevents.*")), f"no TensorBoard events in {run}"
        state = json.loads((run / "run.json").read_text())
        assert state["status"] == "finished" and state["seed"] == seed and state["wall_s"] > 0
    assert sorted(p.name for p in (directory / "runs").iterdir()) == ["advantage=GroupNorm", "base"]
    assert "base seed=0: finished in" in first.stderr and "held-out reward" in first.stderr


def test_hparams_carry_the_change_and_the_seed(study):
    directory, _, _, _ = study
    for variant, seed in RUNS:
        params = _hparams(_scalars(directory / "runs" / variant / f"seed={seed}" / HPARAMS_RUN))
        assert params["advantage"] == ("GroupNorm" if variant != "base" else "GroupMean")
        assert params["seed"] == seed and params["data_seed"] == seed
        assert params["max_steps"] == 3  # the study's extra overrides reach every run


def test_arms_of_a_one_factor_study_differ_only_in_the_named_component(study):
    directory, _, _, _ = study

    def config(variant, seed):
        return yaml.safe_load((directory / "runs" / variant / f"seed={seed}" / "config.yaml").read_text())

    def differences(a, b, path=""):
        if isinstance(a, dict) and isinstance(b, dict):
            return {d for key in a.keys() | b.keys() for d in differences(a.get(key), b.get(key), f"{path}.{key}")}
        return set() if a == b else {path.lstrip(".")}

    # the arms: the advantage, and the run's own folder name
    assert differences(config("base", 0), config("advantage=GroupNorm", 0)) == {
        "model.init_args.advantage.class_path",
        "model.init_args.advantage.init_args",
        "trainer.logger.init_args.name",
    }
    # two seeds of one arm: the seed (every stream follows it) and the folder
    assert differences(config("base", 0), config("base", 1)) == {"seed_everything", "trainer.logger.init_args.version"}
    assert config("advantage=GroupNorm", 1)["model"]["init_args"]["advantage"]["class_path"].endswith("GroupNorm")


def test_summary_files_hold_every_variant_with_seed_spread(study):
    directory, first, _, _ = study
    with open(directory / "summary.csv") as f:
        rows = {row["variant"]: row for row in csv.DictReader(f)}
    assert set(rows) == {"base", "advantage=GroupNorm"}
    for name, row in rows.items():
        finals = [_scalars(directory / "runs" / name / f"seed={s}").Scalars("val/reward")[-1].value for s in (0, 1)]
        assert float(row["final_val_mean"]) == pytest.approx(statistics.fmean(finals), abs=1e-5)
        assert float(row["final_val_std"]) == pytest.approx(statistics.stdev(finals), abs=1e-5)
        assert row["final_val_n"] == "2" and row["last:policy/entropy_n"] == "2" and row["seeds"] == "2"
    assert rows["advantage=GroupNorm"]["changes"] == "--model.advantage=GroupNorm"
    assert rows["advantage=GroupNorm"]["final_val_delta_mean"] != ""
    with open(directory / "runs.csv") as f:
        runs = list(csv.DictReader(f))
    assert len(runs) == 4 and {row["rollouts"] for row in runs} == {"3"}  # x = rollout index 0..2: 3 rollouts
    assert all(row["final_train"] != "" for row in runs)  # hp/train_reward, read from the hparams sub-run
    summary = (directory / "summary.md").read_text()
    assert "| `base` | 2 |" in summary and "| `advantage=GroupNorm` | 2 |" in summary
    assert "![reward.png](reward.png)" in summary and "policy/entropy" in summary
    assert "rollouts to held-out 0.5" in summary
    for plot in ("reward.png", "policy_entropy.png"):
        assert (directory / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| `advantage=GroupNorm` |" in first.stdout  # the table is printed too
    definition = yaml.safe_load((directory / "study.yaml").read_text())
    assert [v["name"] for v in definition["variants"]] == ["base", "advantage=GroupNorm"]
    assert definition["seeds"] == [0, 1] and definition["overrides"] == QUICK


def test_a_second_call_skips_finished_runs(study):
    directory, _, second, events_after_first = study
    assert second.returncode == 0, second.stderr[-3000:]
    assert second.stderr.count("finished earlier, skipped") == 4
    assert "started" not in second.stderr and "resuming" not in second.stderr
    assert sorted(p.name for p in directory.rglob("events.out.tfevents.*")) == events_after_first


def test_compare_rewrites_the_summary_from_the_events_alone(study, tmp_path):
    directory, _, _, _ = study
    (directory / "summary.csv").unlink()
    result = run_rlkit(["compare", str(directory), "--metrics=completion/length"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "completion/length, last 10" in (directory / "summary.md").read_text()
    assert (directory / "completion_length.png").is_file() and (directory / "summary.csv").is_file()


def test_an_interrupted_run_resumes_from_its_checkpoint(study, tmp_path):
    """A run that stopped after its last checkpoint (killed, say) continues from it, in its own folder."""
    directory, _, _, _ = study
    run = directory / "runs" / "base" / "seed=1"
    state = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**state, "status": "interrupted"}))
    result = run_rlkit(["ablate", "--resume", str(directory)], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count("finished earlier, skipped") == 3
    assert f"base seed=1: resuming from {run.resolve() / 'checkpoints' / 'last.ckpt'}" in result.stderr
    attempts = json.loads((run / "run.json").read_text())["attempts"]
    assert len(attempts) == 2 and attempts[1]["resumed_from"].endswith("last.ckpt")
    assert "--ckpt_path=" in json.loads((run / "run.json").read_text())["command"]
    folders = sorted(p.name for p in run.iterdir() if p.is_dir())
    assert folders == ["checkpoints", "hf_export", HPARAMS_RUN]  # no version_1


# ---- a malformed study fails before anything runs, with rlkit fit's own message ----


@pytest.fixture()
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(logging, "raiseExceptions", False)  # see tests/spine/test_cli_errors.py
    return tmp_path


def _exit(args, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    return exit_info.value.code, capsys.readouterr().err


@pytest.mark.parametrize(
    "vary,bad",
    [
        ("model.advantag=GroupMean,GroupNorm", "GroupMean"),  # unknown key
        ("model.advantage=GroupMean,GroupMaen", "GroupMaen"),  # unknown class
        ("data.max_prompt_length=16,many", "many"),  # wrong type
        ("model.clip.init_args.eps_high=0.28,-1", "-1"),  # a value the component rejects
    ],
)
def test_a_malformed_vary_fails_before_anything_runs(vary, bad, in_tmp, capsys):
    key = vary.split("=")[0]
    code, fit_err = _exit(["fit", BASE_CONFIG, *QUICK, f"--{key}={bad}"], capsys)
    assert code == 2
    # rlkit fit's message (after its one-line usage), on one line
    fit_message = " ".join(line.strip() for line in fit_err.split("error: ", 1)[1].strip().splitlines())

    code, err = _exit([*STUDY[:3], vary, *QUICK], capsys)
    assert code == 2
    assert err.strip().splitlines() == [f"rlkit: error: --vary {key}={bad}: {fit_message}"]
    assert not (in_tmp / "studies").exists()  # no study folder, no run
