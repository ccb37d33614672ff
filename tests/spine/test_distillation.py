"""The distillation family: the teacher's vocabulary check, the teacher kept out of checkpoints and moved
with the module, its metrics, and micro-batch invariance. The teacher here is a small model built in a
fixture and given a few supervised steps; the embedded teacher is exercised by the learning test."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlkit.algorithms.teacher import load_teacher
from rlkit.cli import build_cli, main
from rlkit.embedded.cache import embedded_checkpoint
from rlkit.embedded.model import build_tiny_checkpoint
from rlkit.errors import ConfigError
from rlkit.models import load_policy, load_tokenizer
from rlkit.spine.policy import Policy
from spine.helpers import FLOAT64, assert_same_update, run_rlkit, short_args
from spine.test_fit import _scalars

EVERY_STEP = Path(__file__).with_name("checkpoint_every_step.yaml")
SGD = [
    "--model.optim.optimizer=torch.optim.SGD",
    "--model.optim.optimizer.init_args.lr=0.1",
    "--model.optim.max_grad_norm=null",
]


def _supervised_steps(directory: Path, steps: int, seed: int = 0) -> None:
    """A few steps of next-token cross-entropy on ``a+b=c`` strings (a teacher that knows something)."""
    model, tokenizer = load_policy(directory).train(), load_tokenizer(directory)
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        texts = [f"{a}+{b}={a + b}" for a, b in ((rng.randrange(10), rng.randrange(10)) for _ in range(32))]
        batch = tokenizer([t + tokenizer.eos_token for t in texts], return_tensors="pt", padding=True)
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)  # [32, L]
        loss = model(**batch, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(directory)


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory) -> Path:
    directory = build_tiny_checkpoint(tmp_path_factory.mktemp("teacher"), hidden_size=96, num_heads=3, seed=1)
    _supervised_steps(directory, steps=30)
    return directory


def _args(tmp_path: Path, teacher: Path, *extra: str) -> list[str]:
    return short_args(tmp_path, "opd", f"--model.teacher={teacher}", *extra)


def _fit(tmp_path: Path, monkeypatch, teacher: Path, *extra: str):
    tmp_path.mkdir(exist_ok=True)
    monkeypatch.chdir(tmp_path)
    return build_cli(_args(tmp_path, teacher, *extra))  # `rlkit fit ...`, as typed


def _with_vocabulary_edit(target: Path, edit) -> Path:
    """A tiny checkpoint at ``target`` whose tokenizer.json vocabulary went through ``edit``."""
    build_tiny_checkpoint(target, hidden_size=64, seed=2)
    spec = json.loads((target / "tokenizer.json").read_text())
    edit(spec["model"]["vocab"])
    (target / "tokenizer.json").write_text(json.dumps(spec))
    return target


def test_a_teacher_with_another_vocabulary_is_a_one_line_config_error(tmp_path, monkeypatch, capsys):
    """One more token in the teacher's tokenizer: `rlkit fit` exits 2 with one line naming both checkpoints."""
    teacher = _with_vocabulary_edit(tmp_path / "teacher", lambda vocab: vocab.update({"@": len(vocab)}))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(logging, "raiseExceptions", False)
    with pytest.raises(SystemExit) as exit_info:
        main(_args(tmp_path, teacher))
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("rlkit: error:")]
    assert exit_info.value.code == 2 and "Traceback" not in err, err
    assert len(lines) == 1 and str(teacher) in lines[0] and "embedded-" in lines[0], err
    assert "tokens in the student's tokenizer" in lines[0]


def test_swapped_token_ids_are_refused(tmp_path):
    def swap(vocab):
        vocab["a"], vocab["b"] = vocab["b"], vocab["a"]

    student = Policy.load(str(build_tiny_checkpoint(tmp_path / "student")))
    teacher = _with_vocabulary_edit(tmp_path / "teacher", swap)
    with pytest.raises(ConfigError, match=r"token 'a' has id \d+ for the student, \d+ for the teacher"):
        load_teacher(str(teacher), student)


def test_teacher_is_frozen_out_of_the_checkpoint_and_on_the_module_device(tmp_path, monkeypatch, teacher_dir):
    cli = _fit(tmp_path, monkeypatch, teacher_dir, f"--config={EVERY_STEP}", "--trainer.max_steps=2")
    module = cli.model
    teacher = module.spine.frozen["teacher"]
    assert not any(p.requires_grad for p in teacher.parameters()) and not teacher.training
    assert {p.device for p in teacher.parameters()} == {module.device}
    checkpoint = torch.load(tmp_path / "ckpts" / "last.ckpt", weights_only=True)
    assert set(checkpoint["state_dict"]) == {f"policy.{name}" for name in module.policy.state_dict()}
    student_size = sum(p.numel() for p in module.policy.parameters())
    assert sum(v.numel() for v in checkpoint["state_dict"].values()) == student_size
    metrics = cli.trainer.callback_metrics
    for name in ("distill/kl", "distill/kl_k3", "distill/teacher_logprob", "distill/loss", "loss/policy"):
        assert name in metrics, f"{name} not logged; got {sorted(metrics)}"
    assert metrics["distill/kl_k3"] >= 0 and metrics["distill/teacher_logprob"] < 0
    # the advantage is minus the per-token k1 estimate: their token means agree
    assert metrics["advantage/mean"].item() == pytest.approx(-metrics["distill/kl"].item(), abs=1e-5)


@pytest.mark.parametrize(
    "setting",
    [
        ["--model.aggregation=SeqMeanTokenMean"],  # the preset's K1 reverse KL as a policy-gradient signal
        # supervised; at lr 0.1 the first step overshoots (the student's top-k mass 0.97 -> 0.24)
        [
            *["--model.loss=TopKForwardKL", "--model.loss.k=5", "--model.policy_gradient=false"],
            "--model.optim.optimizer.init_args.lr=0.01",
        ],
        ["--model.reward_weight=0.5", "--model.advantage=GroupNorm"],  # mixed with task rewards
    ],
    ids=["reverse-kl-pg", "top-k-supervised", "reward-mixed"],
)
@pytest.mark.parametrize(
    "split",
    ["--model.loop.micro_batch_size=3", "--model.loop.micro_batch_tokens=24", "--model.loop.pack_sequences=true"],
)
def test_micro_batches_change_memory_not_maths(setting, split, tmp_path, monkeypatch, teacher_dir):
    """16 rows in one forward, in micro-batches of 3 (uneven), in token-budget micro-batches (rows
    sorted by length, each cut to its longest row), or packed (student and teacher): the same weights
    after 2 updates (SGD, no clipping, so a wrong normaliser or a mis-sliced teacher top-k would show).

    Micro-batches cut to their own longest row change the matmul shapes, hence the rounding; the top-k
    loss's rest term ``p_rest log q_rest`` amplifies it where the student's top-k mass is near 1 (1e-5 to
    5e-5 of the update in float32), so the comparison runs in float64 (see ``spine.helpers.FLOAT64``). A
    wrong normaliser or a mis-sliced row moves the update by percents."""
    common = ["--trainer.max_steps=2", *FLOAT64, *SGD, *setting]
    whole = _fit(tmp_path / "whole", monkeypatch, teacher_dir, *common)
    micro = _fit(tmp_path / "micro", monkeypatch, teacher_dir, *common, split)
    before = load_policy(whole.model.policy.checkpoint_dir).state_dict()
    assert_same_update(whole.model.policy.model.state_dict(), micro.model.policy.model.state_dict(), before)


def test_task_reward_needs_an_advantage_estimator(tmp_path, monkeypatch, capsys, teacher_dir):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(_args(tmp_path, teacher_dir, "--model.reward_weight=0.5"))
    assert exit_info.value.code == 2
    assert "--model.advantage=GroupNorm" in capsys.readouterr().err


def test_two_ranks_equal_one_process(tmp_path, teacher_dir):
    """DDP on 2 CPU ranks ends where one process ends, and logs the same step values (see
    test_distributed.py for why SGD without clipping)."""
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not built in")
    runs, logged = {}, {}
    for name, extra in {"single": [], "ddp": ["--trainer.devices=2", "--trainer.strategy=ddp"]}.items():
        workdir = tmp_path / name
        workdir.mkdir()
        args = _args(workdir, teacher_dir, f"--config={EVERY_STEP}", "--trainer.max_steps=3", *FLOAT64, *SGD, *extra)
        result = run_rlkit(args, cwd=workdir)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name] = load_file(workdir / "export" / "model.safetensors")
        logged[name] = _scalars(workdir / "runs")
    initial = load_file(embedded_checkpoint() / "model.safetensors")
    assert_same_update(runs["single"], runs["ddp"], initial)
    for tag in ("distill/kl", "distill/teacher_logprob", "loss/policy", "advantage/mean"):
        # logged values pass through float32 metric states: equal to float32 rounding, not 1e-9
        torch.testing.assert_close(
            torch.tensor(logged["ddp"][tag]), torch.tensor(logged["single"][tag]), rtol=1e-5, atol=1e-7, msg=tag
        )


def test_resume_is_exact(tmp_path, monkeypatch, teacher_dir):
    """4 rollouts straight == 2 rollouts, a checkpoint, a new Trainer resuming from it, 2 more: bitwise
    (the teacher is reloaded from its directory, not from the checkpoint)."""
    every = [f"--config={EVERY_STEP}", "--trainer.max_steps=4", "--model.optim.lr_scheduler.init_args.total_steps=4"]
    straight = _fit(tmp_path / "straight", monkeypatch, teacher_dir, *every).model.policy.model.state_dict()
    _fit(tmp_path / "split", monkeypatch, teacher_dir, *every, "--trainer.max_steps=2")
    resumed = _fit(tmp_path / "split", monkeypatch, teacher_dir, *every, "--ckpt_path=ckpts/last.ckpt")
    after = resumed.model.policy.model.state_dict()
    assert str(resumed.trainer.ckpt_path).endswith("last.ckpt") and resumed.trainer.global_step == 4
    for name, tensor in straight.items():
        assert torch.equal(after[name], tensor), f"{name} differs after resume"
