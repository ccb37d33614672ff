"""Sharding does not change the maths: FSDP2 on 2 CPU ranks (gloo) ends where 1 process ends.

The same comparison as the DDP test (``test_distributed.py``: float64, SGD, every rank sampling every
second prompt of the step), with the model sharded by ``rlkit.spine.sharding.FSDP2Strategy``
(``configs/trainer/fsdp.yaml``): each decoder layer and the root of the policy, and of the frozen KL
reference GRPO keeps. Here the gradient is clipped (an active ``max_grad_norm``), so the weights agree only if
the norm is the whole model's over both ranks' shards; the logged ``grad/norm`` (before clipping) agrees
only if the aggregation's normaliser is right (clipping alone would hide a normaliser off by the world size).
One 2-rank run serves several checks: the weights, the logged values, every rank's engine after the last
push, and the distributed checkpoint it leaves behind, from which one more 2-rank run resumes.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rlkit.embedded.cache import embedded_checkpoint
from rlkit.embedded.model import build_tiny_checkpoint
from rlkit.errors import ConfigError
from spine.helpers import SAME_MATHS, assert_same_update, run_rlkit, short_args
from spine.test_fit import _scalars

ROOT = Path(__file__).resolve().parents[2]
EVERY_STEP = Path(__file__).with_name("checkpoint_every_step.yaml")
FSDP = [
    f"--config={ROOT / 'configs' / 'trainer' / 'fsdp.yaml'}",
    "--trainer.accelerator=cpu",
    "--trainer.devices=2",
    # Lightning's ModelParallelStrategy accepts no precision=64-true; the plugin itself works with FSDP2
    "--trainer.precision=null",
    "--trainer.plugins=[rlkit.checkpointing.AtomicCheckpointIO, lightning.pytorch.plugins.precision.DoublePrecision]",
]
COMMON = [
    f"--config={EVERY_STEP}",
    "--data.engine=spine.faulty.RecordingEngine",
    "--data.engine.init_args.dtype=float64",
    "--model.optim.optimizer=torch.optim.SGD",
    "--model.optim.optimizer.init_args.lr=0.1",
    "--model.optim.max_grad_norm=0.5",
    "--model.entropy_coef=0.01",
]


def _run(workdir: Path, *extra: str, trainer: list[str] = (), steps: int = 3, experiment: str = "grpo", common=COMMON):
    """``rlkit fit`` of GRPO in ``workdir``; ``trainer`` comes before the every-step checkpoint config
    (a later config's callbacks list is merged into an earlier one's item by item)."""
    workdir.mkdir(exist_ok=True)
    record = f"--data.engine.init_args.record_dir={workdir / 'engines'}"
    args = short_args(workdir, experiment, *trainer, *common, record, *extra, f"--trainer.max_steps={steps}")
    result = run_rlkit(args, cwd=workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _killed_after_checkpoint(workdir: Path, step: int, trainer: list[str]) -> None:
    """Start the 3-step run of :func:`_run` and kill -9 its whole process group (every rank) as soon as the
    checkpoint of ``step`` is in place, i.e. in the middle of the next rollout or of the writing of
    ``last.ckpt``."""
    workdir.mkdir()
    record = f"--data.engine.init_args.record_dir={workdir / 'engines'}"
    args = short_args(workdir, "grpo", *trainer, *COMMON, record, "--trainer.max_steps=3")
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]),
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "rlkit.cli", *args], cwd=workdir, env=env, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    target = workdir / "ckpts" / f"epoch=0-step={step}.ckpt" / "meta.pt"
    deadline = time.monotonic() + 600
    while not target.is_file() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    os.killpg(process.pid, signal.SIGKILL)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == -signal.SIGKILL, f"the run ended before it was killed: {stderr[-3000:]}"


def test_fsdp2_two_ranks_equal_one_process(tmp_path):
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not built in")
    _run(tmp_path / "single", "--trainer.precision=64-true")
    _run(tmp_path / "fsdp", trainer=FSDP)
    single, sharded = (load_file(tmp_path / name / "export" / "model.safetensors") for name in ("single", "fsdp"))
    initial = load_file(embedded_checkpoint() / "model.safetensors")
    update = assert_same_update(single, sharded, initial, SAME_MATHS)
    # the sharded run's HF export is a whole checkpoint that transformers loads as it is
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "fsdp" / "export", dtype=torch.float64).state_dict()
    for name, tensor in sharded.items():
        assert torch.equal(loaded[name], tensor), f"the export loaded by transformers: {name} differs"

    logged = {name: _scalars(tmp_path / name / "runs") for name in ("single", "fsdp")}
    assert max(logged["single"]["grad/norm"]) > 0.5, "the clipping must act for the comparison to mean anything"
    for tag in ("grad/norm", "loss/total", "loss/kl", "loss/entropy", "reward/mean"):
        torch.testing.assert_close(
            torch.tensor(logged["fsdp"][tag]), torch.tensor(logged["single"][tag]), rtol=1e-5, atol=1e-7, msg=tag
        )

    # the weight push, gathered tensor by tensor: each rank's engine holds the whole trained model
    for rank in (0, 1):
        engine = load_file(tmp_path / "fsdp" / "engines" / f"engine-{rank}.safetensors")
        assert engine.keys() == sharded.keys()
        for name, tensor in sharded.items():
            assert torch.equal(engine[name].to(tensor.dtype), tensor), f"rank {rank}'s engine: {name} differs"

    # a distributed checkpoint: a folder with one shard per rank, the policy only (no frozen reference)
    checkpoint = tmp_path / "fsdp" / "ckpts" / "epoch=0-step=2.ckpt"
    shards = sorted(p.name for p in checkpoint.iterdir() if not p.name.startswith("."))  # and DCP's .metadata
    assert shards == ["__0_0.distcp", "__1_0.distcp", "meta.pt"], shards
    keys = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    weights = [k for k in keys if k.startswith("state_dict.")]
    assert weights and all(k.startswith("state_dict.policy.model.") for k in weights), weights[:5]

    # killed (-9, both ranks) once its step-2 checkpoint is on disk, then resumed with --ckpt_path=last on 2
    # ranks: the run ends where the uninterrupted one ended
    resumed = tmp_path / "resumed"
    _killed_after_checkpoint(resumed, 2, trainer=FSDP)
    _run(resumed, "--ckpt_path=last", trainer=FSDP)
    assert_same_update(sharded, load_file(resumed / "export" / "model.safetensors"), initial, SAME_MATHS)
    assert update > 1e-3

    # and one process's step-2 checkpoint (one file) resumes on 2 ranks, ending where one process ends (copied
    # into another run folder, so Lightning writes this run's last checkpoint as last-v1.ckpt beside it)
    converted = tmp_path / "one-to-two"
    (converted / "ckpts").mkdir(parents=True)
    shutil.copy(tmp_path / "single" / "ckpts" / "epoch=0-step=2.ckpt", converted / "ckpts" / "last.ckpt")
    result = _run(converted, "--ckpt_path=last", trainer=FSDP)
    assert_same_update(single, load_file(converted / "export" / "model.safetensors"), initial, SAME_MATHS)
    assert "written by 1 process(es), this run has 2" in result.stderr, "the resume says the world size changed"


#: PPO with its separate critic (sharded like the policy, its own clipped optimizer) and the frozen reference
#: of the KL penalty in the reward; two epochs per rollout (the second off-policy). Smaller steps than GRPO's,
#: as in the DDP test (float noise grows past the tolerance when SGD at 0.1 runs two epochs).
PPO = [
    "--model.optim.optimizer.init_args.lr=0.02",
    "--model.critic_optim.optimizer=torch.optim.SGD",
    "--model.critic_optim.optimizer.init_args.lr=0.01",
    "--model.critic_optim.max_grad_norm=0.5",
    "--model.loop.ppo_epochs=2",
    # an adaptive KL coefficient, steered each step by the KL over both ranks' sequences (a per-rank KL or
    # sequence count would steer each rank's copy apart)
    "--model.kl_in_reward.init_args.controller=AdaptiveKLController",
    "--model.kl_in_reward.init_args.controller.init_args.coef=0.05",
    "--model.kl_in_reward.init_args.controller.init_args.target_kl=0.0001",
    "--model.kl_in_reward.init_args.controller.init_args.horizon=32",
]


def test_fsdp2_actor_critic_equals_one_process(tmp_path):
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not built in")
    runs = {}
    for name, trainer in {"single": ["--trainer.precision=64-true"], "fsdp": FSDP}.items():
        _run(tmp_path / name, *PPO, trainer=trainer, steps=4, experiment="ppo")
        export = tmp_path / name / "export"
        critic = {
            **load_file(export / "critic" / "model.safetensors"),
            **load_file(export / "critic" / "value_head.safetensors"),
        }
        runs[name] = {**load_file(export / "model.safetensors"), **{f"critic.{k}": v for k, v in critic.items()}}
    initial = load_file(embedded_checkpoint() / "model.safetensors")
    moved = max((runs["single"][k] - initial[k]).abs().max().item() for k in initial)
    head = runs["single"]["critic.weight"].abs().max().item()  # the critic's head starts at zero
    assert moved > 1e-3 and head > 1e-3, "policy and critic must move for the comparison to mean anything"
    for name, tensor in runs["single"].items():
        gap = (runs["fsdp"][name].double() - tensor.double()).abs().max().item()
        assert gap <= SAME_MATHS * max(moved, head), f"{name}: FSDP2 vs one process differ by {gap:.3g}"
    coefs = {name: _scalars(tmp_path / name / "runs")["reward/kl_coef"] for name in runs}
    assert coefs["single"][-1] != pytest.approx(0.05, rel=1e-3), "the adaptive coefficient must move"
    torch.testing.assert_close(torch.tensor(coefs["fsdp"]), torch.tensor(coefs["single"]), rtol=1e-9, atol=0)


def test_fsdp2_distillation_with_activation_checkpointing_equals_one_process(tmp_path):
    """On-policy distillation: the frozen teacher (another, wider model) is sharded like the policy and scored
    by both ranks' shards; the sharded student also recomputes its layers' activations in the backward
    (``model.policy.gradient_checkpointing``, non-reentrant) and still ends where one process ends."""
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not built in")
    teacher = build_tiny_checkpoint(tmp_path / "teacher", hidden_size=96, num_heads=3, seed=1)
    common = [*(a for a in COMMON if not a.startswith("--model.entropy_coef")), f"--model.teacher={teacher}"]
    _run(tmp_path / "single", "--trainer.precision=64-true", experiment="opd", common=common)
    _run(tmp_path / "fsdp", "--model.policy.gradient_checkpointing=true", trainer=FSDP, experiment="opd", common=common)
    single, sharded = (load_file(tmp_path / name / "export" / "model.safetensors") for name in ("single", "fsdp"))
    assert_same_update(single, sharded, load_file(embedded_checkpoint() / "model.safetensors"), SAME_MATHS)
    logged = {name: _scalars(tmp_path / name / "runs") for name in ("single", "fsdp")}
    assert min(logged["single"]["distill/kl"]) > 1e-3, "a teacher the student already equals teaches nothing"
    for tag in ("distill/kl", "distill/teacher_logprob", "grad/norm"):
        torch.testing.assert_close(
            torch.tensor(logged["fsdp"][tag]), torch.tensor(logged["single"][tag]), rtol=1e-5, atol=1e-7, msg=tag
        )
    keys = dcp.FileSystemReader(str(tmp_path / "fsdp" / "ckpts" / "last.ckpt")).read_metadata().state_dict_metadata
    weights = [k for k in keys if k.startswith("state_dict.")]
    assert weights and all(k.startswith("state_dict.policy.model.") for k in weights), "the teacher is never saved"


def test_one_process_refuses_a_sharded_checkpoint(tmp_path):
    """A one-process strategy reads checkpoints through rlkit's checkpoint IO, which names the way on for a
    distributed-checkpoint folder (its ``meta.pt`` beside the shards) in one line."""
    from rlkit.checkpointing import AtomicCheckpointIO

    folder = tmp_path / "last.ckpt"
    folder.mkdir()
    torch.save({"global_step": 2}, folder / "meta.pt")
    with pytest.raises(
        ConfigError, match="is a sharded checkpoint.*configs/trainer/fsdp.yaml on 2 or more ranks"
    ) as error:
        AtomicCheckpointIO().load_checkpoint(folder)
    assert "\n" not in str(error.value)
    file = tmp_path / "one.ckpt"
    torch.save({"global_step": 1}, file)
    assert AtomicCheckpointIO().load_checkpoint(file)["global_step"] == 1


def test_one_process_cannot_shard():
    from lightning.fabric.plugins.environments import LightningEnvironment

    from rlkit.spine.sharding import FSDP2Strategy

    strategy = FSDP2Strategy()
    strategy.parallel_devices = [torch.device("cpu")]
    strategy.cluster_environment = LightningEnvironment()
    with pytest.raises(ConfigError, match="set trainer.devices to 2 or more") as error:
        strategy.setup_environment()
    assert "\n" not in str(error.value)


def test_a_bad_dtype_names_the_choices():
    from rlkit.spine.sharding import FSDP2Strategy

    with pytest.raises(ConfigError, match="param_dtype='fp8'.*choose auto, bfloat16"):
        FSDP2Strategy(param_dtype="fp8")


def test_layers_are_found_or_named_as_missing():
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlkit.spine.sharding import decoder_layers

    config = LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=1, head_dim=32)  # fmt: skip
    model = LlamaForCausalLM(config)
    assert decoder_layers(model) == list(model.model.layers)

    class Plain(torch.nn.Module):  # no _no_split_modules and no layer list: nothing to wrap
        def __init__(self):
            super().__init__()
            self.stack = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))

    with pytest.raises(ConfigError, match="cannot find the decoder layers of Plain.*_no_split_modules") as error:
        decoder_layers(Plain())
    assert "\n" not in str(error.value)


def test_mixed_precision_bf16_on_gpu_none_on_cpu():
    from rlkit.spine.sharding import mixed_precision_policy

    assert mixed_precision_policy(torch.device("cpu"), torch.float32) is None
    gpu = mixed_precision_policy(torch.device("cuda"), torch.float32)
    assert (gpu.param_dtype, gpu.reduce_dtype) == (torch.bfloat16, torch.float32)
    forced = mixed_precision_policy(torch.device("cpu"), torch.float32, param_dtype="bfloat16")
    assert (forced.param_dtype, forced.reduce_dtype) == (torch.bfloat16, torch.float32)
