"""docs/extending.md's examples are true: its code blocks are extracted, checked by hand-worked numbers, and
trained with through `rlkit fit --imports=[...]` exactly as the page says (no rlkit file edited)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
from spine.helpers import EXPERIMENTS, ROOT, SHORT, run_rlkit
from spine.test_fit import _scalars

from rlkit.components import AdvantageInputs, ClipInputs, LogProb
from rlkit.errors import ConfigError

PAGE = ROOT / "docs" / "extending.md"


@pytest.fixture(scope="module")
def extension(tmp_path_factory):
    """The page's ``python file=my_rlkit_ext.py`` blocks as a module, and its YAML preset, in a directory."""
    directory = tmp_path_factory.mktemp("ext")
    text = PAGE.read_text()
    code = re.findall(r"```python file=my_rlkit_ext\.py\n(.*?)```", text, re.S)
    assert len(code) == 3, "the advantage, the clip and the family"
    (directory / "my_rlkit_ext.py").write_text("\n\n".join(code))
    [preset] = re.findall(r"```yaml\n# raft\.yaml\n(.*?)```", text, re.S)
    (directory / "raft.yaml").write_text(preset)
    sys.path.insert(0, str(directory))
    import my_rlkit_ext

    yield directory, my_rlkit_ext
    sys.path.remove(str(directory))


def test_the_worked_examples(extension):
    _, ext = extension
    inputs = AdvantageInputs.from_scores(
        torch.tensor([0.0, 0.0, 1.0, 5.0, 0.0, 1.0, 9.0]), torch.ones(7, 2), torch.tensor([0, 0, 0, 0, 1, 1, 1])
    )
    advantages, _ = ext.GroupMedian()(inputs)
    assert advantages[:, 0].tolist() == [0.0, 0.0, 1.0, 5.0, -1.0, 0.0, 8.0]
    ratio = torch.tensor([[1.0, 1.5]])
    out = ext.TrustMask(delta=0.2)(
        ClipInputs(ratio, ratio.log(), torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2))
    )
    assert out.loss.tolist() == [[-1.0, -0.0]] and out.clipped["fraction"].tolist() == [[False, True]]


def test_the_clip_declares_that_it_bounds_a_ratio(extension):
    _, ext = extension
    from rlkit.algorithms import PolicyGradient
    from rlkit.components import GroupMean, TokenMean

    with pytest.raises(ConfigError, match="model.clip=TrustMask needs an importance ratio around 1"):
        PolicyGradient(GroupMean(), LogProb(), ext.TrustMask(), TokenMean())


def _run(directory: Path, tmp_path: Path, *args: str):
    import os

    env_path = os.pathsep.join([str(directory), os.environ.get("PYTHONPATH", "")])
    os.environ["PYTHONPATH"], previous = env_path, os.environ.get("PYTHONPATH", "")
    try:
        result = run_rlkit(
            ["fit", *args, *SHORT, "--trainer.max_steps=3", f"--trainer.logger.init_args.save_dir={tmp_path / 'runs'}"],
            cwd=tmp_path,
        )
    finally:
        os.environ["PYTHONPATH"] = previous
    assert result.returncode == 0, result.stderr[-3000:]
    return _scalars(tmp_path / "runs")


def test_a_users_advantage_and_clip_by_short_name(extension, tmp_path):
    directory, _ = extension
    scalars = _run(
        directory,
        tmp_path,
        f"--config={EXPERIMENTS / 'drgrpo.yaml'}",
        "--imports=[my_rlkit_ext]",
        "--model.advantage=GroupMedian",
        "--model.clip=TrustMask",
        "--model.loop.minibatches=2",  # off-policy second step: the band can act
    )
    assert len(scalars["loss/policy"]) == 2 and "clip/fraction" in scalars  # 3 optimizer steps of 2 per rollout
    [run] = list((tmp_path / "runs").rglob("version_0"))
    assert "advantage=GroupMedian" in str(run) and "clip=TrustMask" in str(run)


def test_a_users_family_composes_with_the_embedded_task(extension, tmp_path):
    directory, _ = extension
    scalars = _run(
        directory, tmp_path, f"--config={directory / 'raft.yaml'}", f"--config={ROOT / 'configs/tasks/embedded.yaml'}"
    )
    assert len(scalars["loss/nll"]) == 3 and all(value > 0 for value in scalars["loss/nll"])
    assert len(scalars["reward/mean"]) == 3  # the spine writes the rollout's metrics whatever a family logs
