"""``--ckpt_path`` checks what it resumes: one line (exit 2) naming the file and what differs, before any weight
is loaded, and nothing in the run folder is lost or overwritten (issue 21)."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rlkit.cli import build_cli, main
from rlkit.errors import ConfigError
from rlkit.resuming import check_family, check_sharded_folder, check_weights, check_world_size, read_checkpoint
from spine.helpers import EXPERIMENTS, SHORT

USAGE = 2
#: every run of this file has this name, so --ckpt_path=last finds the fixture's run whatever else changes
NAME = "--trainer.logger.init_args.name=resumed"


def _args(root: Path, experiment: str = "drgrpo", *extra: str) -> list[str]:
    return [
        "fit",
        f"--config={EXPERIMENTS / (experiment + '.yaml')}",
        *SHORT,
        "--trainer.max_steps=1",
        f"--trainer.default_root_dir={root}",
        f"--trainer.logger.init_args.save_dir={root / 'runs'}",
        NAME,
        *extra,
    ]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """One Dr.GRPO step of the embedded default, in the default layout (runs/resumed/version_0/...)."""
    root = tmp_path_factory.mktemp("finished")
    with contextlib.chdir(root):
        build_cli(_args(root))
    assert (root / "runs" / "resumed" / "version_0" / "checkpoints" / "last.ckpt").is_file()
    return root


@pytest.fixture
def run(finished_run, tmp_path, monkeypatch) -> Path:
    root = tmp_path / "run"
    shutil.copytree(finished_run, root)
    monkeypatch.chdir(root)
    monkeypatch.setattr(logging, "raiseExceptions", False)  # see test_cli_errors
    return root


def _files(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha1(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()}


def _refused(args: list[str], root: Path, capsys, trainer_started: bool = False) -> str:
    """The one error line; the run folder as it was (once the Trainer has started, Lightning has opened a new,
    empty TensorBoard events file beside the run's: the only addition allowed)."""
    before = _files(root)
    with pytest.raises(SystemExit) as stop:
        main(args)
    err = capsys.readouterr().err
    assert stop.value.code == USAGE, err
    assert "Traceback" not in err and "size mismatch" not in err and "Missing key" not in err, err
    [line] = [line for line in err.splitlines() if line.startswith("rlkit: error:")]
    after = _files(root)
    if trainer_started:
        assert all(Path(name).name.startswith("events.out.tfevents.") for name in after.keys() - before.keys())
        after = {name: digest for name, digest in after.items() if name in before}
    assert after == before, "a refused resume changed the run folder"
    return line


def _last(root: Path) -> Path:
    return root / "runs" / "resumed" / "version_0" / "checkpoints" / "last.ckpt"


def test_a_text_file_is_named(run, capsys):
    (run / "notes.ckpt").write_text("step 300 looked good\n")
    line = _refused(_args(run, "drgrpo", "--ckpt_path=notes.ckpt"), run, capsys)
    assert "notes.ckpt is text" in line and "not a Lightning checkpoint" in line


def test_a_safetensors_file_says_how_to_start_from_it(run, capsys):
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, run / "model.safetensors")
    line = _refused(_args(run, "drgrpo", "--ckpt_path=model.safetensors"), run, capsys)
    assert "model.safetensors is a .safetensors weights file" in line and "--model.policy.checkpoint=DIR" in line


def test_a_missing_file_is_named(run, capsys):
    line = _refused(_args(run, "drgrpo", "--ckpt_path=nowhere/last.ckpt"), run, capsys)
    assert "nowhere/last.ckpt: no such file" in line


def test_a_truncated_checkpoint_is_named(run, capsys):
    torn = run / "torn.ckpt"
    torn.write_bytes(_last(run).read_bytes()[:4000])  # an interrupted copy
    line = _refused(_args(run, "drgrpo", "--ckpt_path=torn.ckpt"), run, capsys)
    assert "torn.ckpt could not be read as a checkpoint, truncated or corrupt" in line


def test_another_family_is_named_before_the_model_loads(run, capsys):
    """A Dr.GRPO checkpoint resumed with ppo.yaml: today ``Missing key(s) ... critic.*``."""
    line = _refused(_args(run, "ppo", "--ckpt_path=last"), run, capsys)
    assert "written by another family (PolicyGradient" in line and "this run is ActorCritic" in line
    assert str(_last(run).relative_to(run)) in line or str(_last(run)) in line


def test_a_narrower_model_names_the_first_parameters_that_differ(run, capsys, tmp_path):
    """Another model shape: today a 56-line ``size mismatch`` traceback. ``config.yaml`` stays the run's."""
    from rlkit.embedded.model import build_tiny_checkpoint

    narrow = build_tiny_checkpoint(tmp_path / "narrow", hidden_size=32, num_heads=1)
    args = _args(run, "drgrpo", f"--model.policy.checkpoint={narrow}", "--ckpt_path=last")
    line = _refused(args, run, capsys, trainer_started=True)
    assert "holds another model shape" in line and "last.ckpt" in line
    assert "policy.model.model.embed_tokens.weight [57, 64] in the checkpoint, [57, 32] here" in line
    assert "more)" in line and len(line) < 600  # the first few, then a count


def test_other_data_is_named(run, capsys):
    """The same family and model over other data (a multiturn checkpoint under drgrpo.yaml went on silently):
    the checkpoint's schedule position would mean other prompts."""
    args = _args(run, "drgrpo", "--data.samples_per_prompt=2", "--seed_everything=7", "--ckpt_path=last")
    line = _refused(args, run, capsys, trainer_started=True)
    assert "written with other data" in line and "data.samples_per_prompt 4 there, 2 here" in line
    assert "data.seed 0 there, 7 here" in line and "--model.policy.checkpoint=<run>/hf_export" in line
    assert "data.prompts " not in line  # the same prompts: not named
    with contextlib.chdir(run):  # the same data resumes
        build_cli(_args(run, "drgrpo", "--trainer.max_steps=2", "--ckpt_path=last"))


# ---- the checks on their own (no run) ----


def test_parameters_of_another_family_are_grouped_by_model():
    """A checkpoint without rlkit's metadata (older, or another tool's): the names that differ say which."""
    saved = {"policy.w": torch.zeros(2)}
    expected = {"policy.w": torch.zeros(2), **{f"critic.layer{i}": torch.zeros(1) for i in range(5)}}
    with pytest.raises(ConfigError, match=r"it lacks 5 this run has \(critic.layer0, .*\(2 more\); critic\.\*: 5\)"):
        check_weights("x.ckpt", saved, expected)
    check_weights("x.ckpt", saved, expected, strict=False)  # a module that loads non-strictly: shapes only
    with pytest.raises(ConfigError, match=r"policy.w \[3\] in the checkpoint, \[2\] here"):
        check_weights("x.ckpt", {"policy.w": torch.zeros(3)}, expected, strict=False)


def test_the_family_of_an_older_checkpoint_comes_from_the_config_beside_it(tmp_path):
    version = tmp_path / "version_0"
    (version / "checkpoints").mkdir(parents=True)
    (version / "config.yaml").write_text("model:\n  class_path: rlkit.algorithms.ActorCritic\n")
    module = SimpleNamespace()  # a SimpleNamespace is no ActorCritic
    with pytest.raises(ConfigError, match=r"another family \(ActorCritic, rlkit.algorithms.ActorCritic\)"):
        check_family(version / "checkpoints" / "last.ckpt", {}, module)
    check_family(tmp_path / "elsewhere.ckpt", {}, module)  # nothing says which: the weights check decides
    from rlkit.algorithms.actor_critic import ActorCritic

    check_family(version / "checkpoints" / "last.ckpt", {}, ActorCritic.__new__(ActorCritic))  # by any import path


def test_a_torch_file_that_is_no_lightning_checkpoint(tmp_path):
    torch.save({"weight": torch.zeros(2)}, tmp_path / "plain.pt")
    with pytest.raises(ConfigError, match="plain.pt is a torch file but not a Lightning checkpoint .*weight"):
        read_checkpoint(tmp_path / "plain.pt")
    (tmp_path / "empty.ckpt").write_bytes(b"")
    with pytest.raises(ConfigError, match="empty.ckpt is empty"):
        read_checkpoint(tmp_path / "empty.ckpt")


def test_another_world_size(tmp_path, capsys):
    """A whole-state checkpoint resumes on any number of processes (rlkit's prompt order and seeds do not
    depend on it), said in one line; a sharded folder needs a sharding strategy."""
    from lightning.pytorch.strategies import SingleDeviceStrategy

    trainer = SimpleNamespace(world_size=1, is_global_zero=True, strategy=SingleDeviceStrategy("cpu"))
    check_world_size("a.ckpt", {"rlkit": {"world_size": 1}}, trainer)
    assert capsys.readouterr().err == ""
    check_world_size("a.ckpt", {"rlkit": {"world_size": 2}}, trainer)
    err = capsys.readouterr().err
    assert "a.ckpt was written by 2 process(es), this run has 1" in err and len(err.splitlines()) == 1
    sharded = tmp_path / "last.ckpt"
    sharded.mkdir()
    for rank in range(2):
        (sharded / f"__{rank}_0.distcp").write_bytes(b"")
    (sharded / "meta.pt").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"sharded checkpoint folder \(2 shard file\(s\).* SingleDeviceStrategy"):
        check_sharded_folder(sharded, trainer)
    assert not check_sharded_folder(tmp_path / "file.ckpt", trainer)
