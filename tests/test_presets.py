"""The presets ship with the package and are found by name from any working directory: a wheel holds
``rlkit/presets/{configs,experiments}``, and ``--config drgrpo`` runs outside the checkout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from rlkit.cli import main
from rlkit.errors import ConfigError
from rlkit.presets import ROOT, presets, resolve
from rlkit.runs import expand_config_defaults

CHECKOUT = Path(__file__).resolve().parents[1]


def test_every_checkout_config_is_a_preset():
    names = presets()
    on_disk = {p.relative_to(CHECKOUT / "experiments").stem for p in (CHECKOUT / "experiments").glob("*.yaml")}
    assert on_disk <= set(names) and "algorithms/grpo" in names and "trainer/cpu" in names
    assert names["drgrpo"].read_text() == (CHECKOUT / "experiments" / "drgrpo.yaml").read_text()


def test_config_names_resolve_from_anywhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # outside the checkout: experiments/drgrpo.yaml is not here
    drgrpo = str(ROOT / "experiments" / "drgrpo.yaml")
    for value in ("drgrpo", "drgrpo.yaml", "rlkit:experiments/drgrpo.yaml", "experiments/drgrpo.yaml"):
        assert resolve(value) == drgrpo, value
    assert resolve("trainer/cpu") == str(ROOT / "configs" / "trainer" / "cpu.yaml")
    expanded = expand_config_defaults(["fit", "--config", "drgrpo", "--config=trainer/cpu"])
    assert [a for a in expanded if a.endswith(".yaml")][-1].endswith("configs/trainer/cpu.yaml")
    (tmp_path / "drgrpo.yaml").write_text("trainer: {max_steps: 1}\n")
    assert resolve("drgrpo.yaml") == "drgrpo.yaml"  # a file of the user's comes first
    with pytest.raises(ConfigError, match=r"no preset of that name \(did you mean drgrpo"):
        resolve("drgrp")


def test_presets_command_and_fit_without_a_config(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    main(["presets"])
    out = capsys.readouterr().out
    assert "drgrpo" in out and "algorithms/grpo" in out and "trainer/cpu" in out and "Dr.GRPO" in out
    with pytest.raises(SystemExit) as stop:
        main(["fit"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "rlkit fit --config drgrpo" in err and "rlkit presets" in err
    assert len(err.splitlines()) < 5, err
    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    first = capsys.readouterr().out.splitlines()[:8]  # where the options that are not the Trainer's are
    assert any("--model.help PolicyGradient" in line for line in first), first
    assert any("--data.help RolloutDataModule" in line for line in first), first


def test_a_wheel_holds_the_presets_and_runs_them_outside_the_checkout(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(CHECKOUT / name, source / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("rlkit", "configs", "experiments"):
        shutil.copytree(CHECKOUT / name, source / name, symlinks=True, ignore=ignore)
    build = [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "-q"]
    result = subprocess.run([*build, "-w", str(tmp_path / "wheel")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    [wheel] = list((tmp_path / "wheel").glob("rlkit-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        archive.extractall(tmp_path / "site")
    expected = {f"rlkit/presets/{p.relative_to(CHECKOUT).as_posix()}" for p in CHECKOUT.glob("configs/**/*.yaml")}
    expected |= {f"rlkit/presets/experiments/{p.name}" for p in CHECKOUT.glob("experiments/*.yaml")}
    assert expected <= names, sorted(expected - names)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(tmp_path / "site"), OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "rlkit.cli", "fit", "--config", "drgrpo", "--print_config"]
    result = subprocess.run(command, cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "rlkit.embedded.AdditionChain" in result.stdout and "advantage:" in result.stdout
    probe = "import rlkit.presets as p; print(p.resolve('rlkit:experiments/drgrpo.yaml'))"
    result = subprocess.run([sys.executable, "-c", probe], cwd=elsewhere, env=env, capture_output=True, text=True)
    assert result.stdout.strip() == str(tmp_path / "site" / "rlkit" / "presets" / "experiments" / "drgrpo.yaml")
