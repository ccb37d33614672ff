"""Every problem of the data against the run's settings in one message, before the engine starts: too few
prompts, a validation interval longer than an epoch, a chat template the tokenizer lacks, long prompts."""

import json
import logging
from types import SimpleNamespace

import pytest
from spine.helpers import EXPERIMENTS

from rlkit.cli import main
from rlkit.data.prompts import PromptFile, encode_prompt
from rlkit.embedded.chain import AdditionChain
from rlkit.embedded.model import build_tokenizer
from rlkit.rollouts.data_check import DataLimits, prompt_lengths, prompt_problems, val_interval_problem


def _file(tmp_path, rows):
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_prompt_lengths_are_those_training_encodes():
    tokenizer, prompts = build_tokenizer(), AdditionChain(num_prompts=64)
    lengths, error = prompt_lengths(prompts, tokenizer, None)
    assert error is None and lengths == [len(encode_prompt(prompts[i], tokenizer)) for i in range(64)]


def test_long_prompts_are_counted_with_the_limit_that_fits(tmp_path):
    rows = [{"prompt": "7" * n, "reward_model": {"ground_truth": "7"}} for n in (3, 30, 40)]
    prompts = PromptFile(str(_file(tmp_path, rows)))
    lengths, _ = prompt_lengths(prompts, build_tokenizer(), None)
    [problem] = prompt_problems(prompts, lengths, DataLimits(2, 16, "error"))
    assert "2 of 3 prompts are longer than data.max_prompt_length=16" in problem
    assert "the first at" in problem and "line 2" in problem and "--data.max_prompt_length=41" in problem
    [problem] = prompt_problems(prompts, lengths, DataLimits(2, 16, "skip"))  # one fits, a step takes two
    assert "only 1 of 3 prompts fit" in problem
    assert prompt_problems(prompts, lengths, DataLimits(1, 16, "skip")) == []


def test_val_check_interval_longer_than_an_epoch():
    trainer = SimpleNamespace(
        val_check_interval=50, limit_train_batches=1.0, check_val_every_n_epoch=1, limit_val_batches=1.0
    )
    assert "--trainer.check_val_every_n_epoch=null" in val_interval_problem(trainer, 2)
    assert "--trainer.val_check_interval=2" in val_interval_problem(trainer, 2)
    assert val_interval_problem(trainer, 50) is None
    assert val_interval_problem(SimpleNamespace(**{**vars(trainer), "check_val_every_n_epoch": None}), 2) is None


def _fit(tmp_path, monkeypatch, capsys, *extra):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(logging, "raiseExceptions", False)  # in-process runs: see test_cli_errors
    args = [
        "fit",
        f"--config={EXPERIMENTS / 'drgrpo.yaml'}",
        f"--trainer.logger.init_args.save_dir={tmp_path / 'runs'}",
        "--trainer.enable_progress_bar=false",
        "--data.prompts=PromptFile",
        *extra,
    ]
    with pytest.raises(SystemExit) as stop:
        main(args)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "Traceback" not in err, err
    return err


def test_a_ten_row_chat_file_fails_once_listing_every_problem(tmp_path, monkeypatch, capsys):
    """The issue's first try: 10 chat rows on the embedded experiment (32 prompts a step, validation every
    50 rollouts, a tokenizer without a chat template)."""
    chat = [[{"role": "user", "content": f"{a}+{a}="}] for a in range(10)]
    rows = [{"prompt": chat[a], "reward_model": {"ground_truth": str(2 * a)}} for a in range(10)]
    path = _file(tmp_path, rows)
    err = _fit(tmp_path, monkeypatch, capsys, f"--data.prompts.path={path}", "--data.val_fraction=0.3")
    assert "(3 problems)" in err, err
    assert "fewer than data.prompts_per_step=32" in err
    assert "--trainer.check_val_every_n_epoch=null" in err
    assert "no chat template" in err and "--prompt-format text" in err and f"{path}, line 1" in err


def test_plain_text_prompts_over_the_inherited_limit_are_named_with_the_rest(tmp_path, monkeypatch, capsys):
    rows = [
        {"prompt": f"What is {a} plus {a}? Answer:", "reward_model": {"ground_truth": str(a + a)}} for a in range(10)
    ]
    path = _file(tmp_path, rows)
    err = _fit(tmp_path, monkeypatch, capsys, f"--data.prompts.path={path}")
    assert "(3 problems)" in err, err
    assert "10 of 10 prompts are longer than data.max_prompt_length=16" in err
    assert "configs/tasks/embedded.yaml" in err and "--data.max_prompt_length=" in err
    assert "fewer than data.prompts_per_step=32" in err and "--trainer.check_val_every_n_epoch=null" in err
