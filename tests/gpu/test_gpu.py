"""GPU checks (marked ``gpu``; skipped without CUDA): chunked log-probs on CUDA and a short bf16 fit."""

from __future__ import annotations

import pytest
import torch

from rlkit.components.logprobs import token_log_probs

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_log_probs_on_cuda(dtype):
    generator = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(2, 64, 32_000, device="cuda", generator=generator).to(dtype).requires_grad_()
    targets = torch.randint(0, 32_000, (2, 64), device="cuda", generator=generator)
    chunked = token_log_probs(logits, targets, chunk_rows=16)
    (chunked * torch.linspace(0, 1, 64, device="cuda")).sum().backward()
    grad_chunked, logits.grad = logits.grad.clone(), None
    full = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    (full * torch.linspace(0, 1, 64, device="cuda")).sum().backward()
    assert chunked.dtype == torch.float32
    torch.testing.assert_close(chunked, full, atol=1e-5, rtol=0)
    torch.testing.assert_close(
        grad_chunked.float(), logits.grad.float(), atol=1e-2 if dtype == torch.bfloat16 else 1e-6, rtol=0
    )


@pytest.mark.parametrize("experiment", ["drgrpo", "ppo"])
def test_short_fit_on_one_gpu(experiment, tmp_path, monkeypatch):
    from spine.helpers import ROOT, devices_while_training, short_args

    from rlkit.cli import build_cli

    monkeypatch.chdir(tmp_path)
    args = short_args(
        tmp_path,
        experiment,
        f"--config={ROOT / 'configs' / 'trainer' / 'single_gpu.yaml'}",
        "--data.engine.init_args.device=cuda",
        "--trainer.max_steps=3",
    )[1:]
    cli = build_cli(args, run=False)
    devices = devices_while_training(cli)
    cli.trainer.fit(cli.model, cli.datamodule)
    assert cli.trainer.global_step == 3
    assert devices["policy"].type == "cuda"
    if experiment == "ppo":
        assert devices["critic"].type == "cuda"
        assert "value/explained_variance" in cli.trainer.callback_metrics
    assert cli.trainer.callback_metrics["mismatch/logprob_abs_diff"].item() < 0.05  # bf16 autocast vs fp32 engine


def test_distillation_teacher_follows_the_student_to_the_gpu(tmp_path, monkeypatch):
    """On-policy distillation: the frozen teacher (kept out of the module's parameters) is on the GPU with
    the student and scores there; a top-k loss gathers the student's log-probs on the GPU too."""
    from spine.helpers import ROOT, devices_while_training, short_args

    from rlkit.cli import build_cli
    from rlkit.embedded.cache import embedded_checkpoint

    monkeypatch.chdir(tmp_path)
    args = short_args(
        tmp_path,
        "opd",
        f"--config={ROOT / 'configs' / 'trainer' / 'single_gpu.yaml'}",
        "--data.engine.init_args.device=cuda",
        f"--model.teacher={embedded_checkpoint()}",
        "--model.loss=TopKForwardKL",
        "--trainer.max_steps=2",
    )[1:]
    cli = build_cli(args, run=False)
    devices = devices_while_training(cli)
    cli.trainer.fit(cli.model, cli.datamodule)
    assert devices["teacher"].type == "cuda" and devices["policy"].type == "cuda"
    assert cli.trainer.callback_metrics["distill/teacher_top_mass"].item() > 0.5


@pytest.mark.parametrize("attention", ["sdpa", "flash_attention_2"])
def test_packed_forward_equals_padded_on_cuda(attention, tmp_path):
    """``model.loop.pack_sequences`` on CUDA: bf16 autocast, sdpa (dense block mask) and flash attention (varlen,
    the case packing is for; skipped where flash-attn is not installed)."""
    from spine.helpers import random_rollout

    from rlkit.embedded.model import build_tiny_checkpoint
    from rlkit.spine.policy import Policy

    if attention == "flash_attention_2":
        pytest.importorskip("flash_attn")
    checkpoint = build_tiny_checkpoint(tmp_path / "tiny", seed=2)
    batch = random_rollout(seed=0, N=16, P=8, T=24)
    batch = type(batch)(**{k: v.cuda() if torch.is_tensor(v) else v for k, v in vars(batch).items()})
    valid = batch.completion_mask.bool()  # [N, T]
    scores = {}
    for pack in (False, True):
        policy = Policy.load(str(checkpoint), pack=pack, attn_implementation=attention).cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            scores[pack] = policy(batch, 1.0, entropy=True).logprobs.float()  # [N, T]
    torch.testing.assert_close(scores[True][valid], scores[False][valid], atol=5e-2, rtol=0)
    assert policy._packing_checked


def test_short_packed_fit_on_one_gpu(tmp_path, monkeypatch):
    from spine.helpers import ROOT, short_args

    from rlkit.cli import build_cli

    monkeypatch.chdir(tmp_path)
    args = short_args(
        tmp_path,
        "drgrpo",
        f"--config={ROOT / 'configs' / 'trainer' / 'single_gpu.yaml'}",
        "--data.engine.init_args.device=cuda",
        "--model.loop.pack_sequences=true",
        "--model.loop.micro_batch_tokens=256",
        "--trainer.max_steps=3",
    )[1:]
    cli = build_cli(args, run=False)
    cli.trainer.fit(cli.model, cli.datamodule)
    assert cli.trainer.global_step == 3 and cli.model.policy._packing_checked
    assert cli.trainer.callback_metrics["perf/padding_fraction"].item() == 0.0
    assert cli.trainer.callback_metrics["mismatch/logprob_abs_diff"].item() < 0.05
