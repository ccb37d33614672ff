"""rlkit.fit: the ``rlkit fit`` command as a function call, with its parser, presets and one-line errors."""

import subprocess
import sys

import pytest

import rlkit
from rlkit.api import command_line
from rlkit.errors import ConfigError


def test_overrides_become_the_command_line():
    overrides = {
        "trainer": {"max_steps": 3, "logger": False, "val_check_interval": None},
        "model.advantage": "GroupNorm",
        "model": {"clip": {"class_path": "PPOClip", "init_args": {"eps_high": 0.28}}},
        "data": {"rewards": [{"class_path": "MathAnswer"}]},
    }
    assert command_line(overrides) == [
        "--trainer.max_steps=3",
        "--trainer.logger=false",
        "--trainer.val_check_interval=null",
        "--model.advantage=GroupNorm",
        '--model.clip={"class_path": "PPOClip", "init_args": {"eps_high": 0.28}}',
        '--data.rewards=[{"class_path": "MathAnswer"}]',
    ]
    with pytest.raises(ConfigError, match="cannot write object"):
        command_line({"seed_everything": object()})


def test_import_rlkit_does_not_import_lightning():
    code = "import sys, rlkit; print('lightning' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_fit_trains_and_returns_the_module_and_the_run_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = rlkit.fit(
        "drgrpo",
        trainer={
            "max_steps": 2,
            "val_check_interval": None,
            "limit_val_batches": 0,
            "enable_progress_bar": False,
            "default_root_dir": str(tmp_path),
            "logger": {"init_args": {"save_dir": str(tmp_path / "runs")}},
        },
        data={"prompts_per_step": 2, "samples_per_prompt": 2},
        **{"model.advantage": "GroupNorm"},
    )
    assert isinstance(result, rlkit.FitResult)
    assert result.trainer.global_step == 2 and result.module is result.trainer.lightning_module
    assert type(result.module.advantage).__name__ == "GroupNorm"  # the dotted override reached the family
    assert result.module.policy is not None and "reward/mean" in result.trainer.callback_metrics
    # the run folder is the one `rlkit fit` makes: named after the preset and the changed options
    assert result.run_dir.parent.parent == tmp_path / "runs" / "drgrpo"
    assert result.run_dir.parent.name == "prompts_per_step=2,samples_per_prompt=2,advantage=GroupNorm"
    assert (result.run_dir / "config.yaml").is_file() and (result.run_dir / "checkpoints" / "last.ckpt").is_file()


def test_errors_are_config_errors_with_the_command_lines_message(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"unknown advantage .GroupMaen. for --model.advantage \(did you mean GroupM"):
        rlkit.fit("drgrpo", model={"advantage": "GroupMaen"})
    with pytest.raises(ConfigError, match=r"no --config given: .* `rlkit fit --config drgrpo`"):
        rlkit.fit()
    with pytest.raises(ConfigError, match=r"drgrpoo.*did you mean"):
        rlkit.fit("drgrpoo")
    assert "usage:" not in capsys.readouterr().err  # raised, not printed
