"""A run on the user's own prompts never validates silently on the embedded task: it holds out a share of
the user's prompts by a fixed hash (``data.val_fraction``), or says plainly that it has no held-out set."""

import json

import pytest
from scripted_engine import ScriptedEngine
from spine.helpers import EXPERIMENTS

from rlkit.cli import build_cli
from rlkit.data.prompts import PromptFile, PromptSubset
from rlkit.embedded.chain import AdditionChain
from rlkit.embedded.model import build_tokenizer
from rlkit.errors import ConfigError
from rlkit.rewards import ExactAnswer
from rlkit.rollouts.datamodule import RolloutDataModule


def _file(tmp_path, n=40):
    path = tmp_path / "mine.jsonl"
    rows = [{"prompt": f"{a}*{a}=", "reward_model": {"ground_truth": str(a * a)}} for a in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _data(prompts, **kwargs):
    engine = ScriptedEngine(build_tokenizer(), lambda call, ids, j, seed: "1")
    return RolloutDataModule(prompts, engine, [ExactAnswer()], prompts_per_step=2, samples_per_prompt=2, **kwargs)


def test_embedded_held_out_set_is_not_used_beside_own_prompts(tmp_path, capsys):
    data = _data(PromptFile(str(_file(tmp_path))), val_prompts=AdditionChain(num_prompts=8, split="test"))
    assert data.held_out is None and data.val_dataloader() == []
    data.setup("fit")
    data.setup("fit")
    err = capsys.readouterr().err
    assert err.count("no held-out set") == 1  # said once
    assert "AdditionChain" in err and "--data.val_fraction" in err


def test_val_fraction_holds_out_a_fixed_hash_share(tmp_path):
    source = PromptFile(str(_file(tmp_path)))
    data = _data(source, val_prompts=AdditionChain(num_prompts=8, split="test"), val_fraction=0.25)
    train, held = data.prompts, data.held_out.prompts
    assert isinstance(train, PromptSubset) and isinstance(held, PromptSubset)
    texts = lambda s: [s[i].prompt for i in range(len(s))]  # noqa: E731
    assert len(train) + len(held) == 40 and not set(texts(train)) & set(texts(held))
    assert 3 <= len(held) <= 20  # a quarter of 40, give or take the hash
    assert held.location(0).startswith(str(source.path))  # messages still name the file's line
    # fixed by the text, not the order or a seed: the reversed file holds out the same prompts
    path = tmp_path / "reversed.jsonl"
    path.write_text("".join(reversed(_file(tmp_path).read_text().splitlines(keepends=True))))
    again = _data(PromptFile(str(path)), val_fraction=0.25)
    assert set(texts(again.held_out.prompts)) == set(texts(held))
    assert "held-out set" in data.held_out_note
    assert data.task == "PromptFile"


def test_val_fraction_errors(tmp_path):
    source = PromptFile(str(_file(tmp_path)))
    with pytest.raises(ConfigError, match="both name a held-out set"):
        _data(source, val_prompts=PromptFile(str(_file(tmp_path))), val_fraction=0.2)
    with pytest.raises(ConfigError, match=r"val_fraction must lie in \(0, 1\)"):
        _data(source, val_fraction=1.5)
    with pytest.raises(ConfigError, match="holds out none of them: raise data.val_fraction"):
        _data(PromptFile(str(_file(tmp_path, n=3))), val_fraction=0.001)


def test_cli_own_prompts_with_val_fraction(tmp_path):
    """The issue's command: an experiment with ``--data.prompts=PromptFile`` validates on the user's prompts."""
    path = _file(tmp_path)
    args = [
        f"--config={EXPERIMENTS / 'drgrpo.yaml'}",
        "--data.prompts=PromptFile",
        f"--data.prompts.path={path}",
        "--data.val_fraction=0.2",
        f"--trainer.logger.init_args.save_dir={tmp_path / 'runs'}",
    ]
    cli = build_cli(args, run=False)
    held = cli.datamodule.held_out.prompts
    assert isinstance(held, PromptSubset) and held.source.path == path
    assert all("*" in held[i].prompt for i in range(len(held)))  # the user's task, not "4+2="
