"""Any Lightning logger keeps rlkit's run folder: ``runs/<name>/version_N`` with config.yaml, checkpoints/,
hf_export/ and samples.jsonl, ``--ckpt_path=last`` resumes there, and the summary names the logger."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

import rlkit
import rlkit.errors

# a tiny embedded run: two rollouts of 2 x 2 completions, held-out checks before and after on 4 prompts
TINY = {
    "data": {"prompts_per_step": 2, "samples_per_prompt": 2, "val_prompts": {"init_args": {"num_prompts": 4}}},
    "trainer": {"max_steps": 2, "val_check_interval": None, "enable_progress_bar": False},
}
NAME = "prompts_per_step=2,samples_per_prompt=2,val_prompts.num_prompts=4"


def _fit(logger, *, max_steps: int = 2, **extra):
    trainer = {**TINY["trainer"], "logger": logger, "max_steps": max_steps}
    return rlkit.fit("drgrpo", data=TINY["data"], trainer=trainer, **extra)


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]


def _assert_run_folder(run: Path, cwd: Path) -> None:
    assert run == Path("runs") / "drgrpo" / NAME / "version_0"  # rlkit's name, relative to the working directory
    assert (cwd / run / "config.yaml").is_file()
    assert (cwd / run / "checkpoints" / "last.ckpt").is_file()
    assert (cwd / run / "hf_export" / "model.safetensors").is_file()
    assert not (cwd / "hf_export").exists() and not (cwd / "lightning_logs").exists()
    rows = _rows(cwd / run)
    training = [r for r in rows if r["table"] == "samples"]
    # samples_every=10: rollout 0 only (x = rollout)
    assert training and all(r["rollout"] == 0 and r["step"] == 0 for r in training)
    assert {"prompt", "completion", "tokens", "reward", "advantage"} <= set(training[0])
    validation = [r for r in rows if r["table"] == "validation"]
    assert sorted({r["step"] for r in validation}) == [0, 2] and len(validation) == 8  # 4 prompts, twice


def _assert_resumes(logger, run: Path, capsys) -> None:
    resumed = _fit(logger, max_steps=3, ckpt_path="last")
    err = capsys.readouterr().err
    assert f"resuming from {run / 'checkpoints' / 'last.ckpt'}" in err, err
    assert resumed.run_dir == run and resumed.trainer.global_step == 3
    assert not (run.parent / "version_1").exists()
    assert "held-out reward:  " in err and "after rollout 3)" in err


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(logging, "raiseExceptions", False)  # in-process runs: see tests/spine/test_cli_errors.py
    return tmp_path


def test_a_csv_logger_run_keeps_rlkits_run_folder_and_resumes_there(in_tmp, capsys):
    result = _fit("CSVLogger")
    _assert_run_folder(result.run_dir, in_tmp)
    assert (result.run_dir / "metrics.csv").is_file()
    err = capsys.readouterr().err
    assert f"CSV logs:         {result.run_dir / 'metrics.csv'}" in err and "TensorBoard" not in err
    reward = result.trainer.callback_metrics["val/reward"].item()
    assert f"held-out reward:  {reward:.4g} (val/reward after rollout 2)" in err
    _assert_resumes("CSVLogger", result.run_dir, capsys)


def test_an_offline_wandb_run_keeps_rlkits_run_folder_and_gets_the_tables(in_tmp, capsys, monkeypatch):
    pytest.importorskip("wandb", reason="wandb not installed (pip install 'rlkit[wandb]')")
    for variable in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(variable, str(in_tmp / "wandb-home"))  # nothing written outside the test's folder
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = {"class_path": "WandbLogger", "init_args": {"offline": True}}  # its save_dir is W&B's default, "."
    result = _fit(logger)
    _assert_run_folder(result.run_dir, in_tmp)
    [offline] = (result.run_dir / "wandb").glob("offline-run-*")  # W&B's own files, inside the run folder
    assert result.trainer.logger.experiment.name == f"drgrpo/{NAME}"  # the W&B run has rlkit's name
    tables = offline / "files" / "media" / "table"
    [first, *_] = sorted(tables.glob("samples_*.table.json"))
    table = json.loads(first.read_text())
    assert table["columns"] == ["step", "rollout", "prompt", "completion", "tokens", "reward", "advantage"]
    assert len(table["data"]) == 2 and len(list(tables.glob("validation_*.table.json"))) == 2
    assert f"W&B (offline):    {offline}" in capsys.readouterr().err
    _assert_resumes(logger, result.run_dir, capsys)


def test_a_run_without_a_logger_keeps_rlkits_run_folder_and_its_bar_shows_val_reward(in_tmp, capsys):
    result = _fit(False, **{"trainer.enable_progress_bar": True})
    _assert_run_folder(result.run_dir, in_tmp)
    out, err = capsys.readouterr()
    assert "logger:           none" in err
    # shorter than val_check_interval: the held-out score before the first update is in the bar; the finished
    # bar is drawn once (it was three times: the last batch, the epoch's end, the close)
    assert "val_reward=" in out and out.count("2/2 [") == 1, out


def test_a_logger_whose_package_is_missing_is_one_config_error(in_tmp):
    try:
        import mlflow  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("mlflow is installed: no missing package to report")
    with pytest.raises(rlkit.errors.ConfigError, match=r"not installed: .*mlflow"):
        _fit("MLFlowLogger")
