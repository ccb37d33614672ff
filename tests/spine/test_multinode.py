"""Many nodes on an existing launcher: FSDP2 started by ``torchrun`` as two "nodes" of one process each.

Both "nodes" run on this machine, each its own ``torchrun --nnodes=2 --nproc-per-node=1`` agent meeting the
other at a c10d rendezvous on 127.0.0.1, each agent starting one ``python -m rlkit.cli fit`` with
``configs/trainer/multinode.yaml`` and ``--trainer.num_nodes=2 --trainer.devices=1``. Lightning then takes
the ranks from torchrun's environment (``TorchElasticEnvironment``) and starts no processes itself; without
it, a ``num_nodes=2`` run would wait for a second node forever. The run is test_sharded's GRPO run (float64,
SGD, clipped gradients, a frozen reference sharded too), so it must end where one process ends.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from rlkit.embedded.cache import embedded_checkpoint
from rlkit.errors import ConfigError
from spine.helpers import SAME_MATHS, assert_same_update, short_args
from spine.test_fit import _scalars
from spine.test_sharded import COMMON, FSDP, ROOT, _run

MULTINODE = [
    *(a for a in FSDP if not a.startswith("--trainer.devices")),
    f"--config={ROOT / 'configs' / 'trainer' / 'multinode.yaml'}",
    "--trainer.num_nodes=2",
    "--trainer.devices=1",
]
STEPS = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun_two_nodes(workdir: Path, args: list[str], timeout: float = 300) -> list[str]:
    """Start both "nodes" (two torchrun agents, one worker each); their combined outputs once both ended."""
    port = _free_port()
    tests = str(ROOT / "tests")
    path = os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=path)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1"]
    rendezvous = ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=rlkit-test"]
    nodes = [
        subprocess.Popen(
            [*launcher, *rendezvous, "-m", "rlkit.cli", *args],
            cwd=workdir,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for _ in range(2)
    ]
    try:
        outputs = [node.communicate(timeout=timeout)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    for node, output in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, output[-3000:]
    return outputs


def test_two_torchrun_nodes_equal_one_process(tmp_path):
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not built in")
    initial = load_file(embedded_checkpoint() / "model.safetensors")  # built here, before both nodes start
    _run(tmp_path / "single", "--trainer.precision=64-true", steps=STEPS)

    nodes = tmp_path / "nodes"
    nodes.mkdir()
    record = f"--data.engine.init_args.record_dir={nodes / 'engines'}"
    args = short_args(nodes, "grpo", *MULTINODE, *COMMON, record, f"--trainer.max_steps={STEPS}")
    outputs = _torchrun_two_nodes(nodes, args)
    joined = "\n".join(outputs)
    assert "GLOBAL_RANK: 0, MEMBER: 1/2" in joined and "GLOBAL_RANK: 1, MEMBER: 2/2" in joined, joined[-3000:]

    single, sharded = (load_file(tmp_path / name / "export" / "model.safetensors") for name in ("single", "nodes"))
    assert_same_update(single, sharded, initial, SAME_MATHS)
    logged = {name: _scalars(tmp_path / name / "runs") for name in ("single", "nodes")}
    assert len(logged["nodes"]["grad/norm"]) == STEPS  # one optimizer step per rollout, all of them logged
    for tag in ("grad/norm", "loss/total", "reward/mean"):
        torch.testing.assert_close(
            torch.tensor(logged["nodes"][tag]), torch.tensor(logged["single"][tag]), rtol=1e-5, atol=1e-7, msg=tag
        )
    # each node's engine got the whole trained model from the last push
    for rank in (0, 1):
        engine = load_file(nodes / "engines" / f"engine-{rank}.safetensors")
        for name, tensor in sharded.items():
            assert torch.equal(engine[name].to(tensor.dtype), tensor), f"node {rank}'s engine: {name} differs"
    # the sharded checkpoint has one shard per node and counts the steps of the run
    last = nodes / "ckpts" / "last.ckpt"
    assert sorted(p.name for p in last.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert torch.load(last / "meta.pt", weights_only=False)["global_step"] == STEPS


def test_a_launch_of_another_size_than_the_trainer_names_the_settings(monkeypatch):
    """torchrun started 2 processes (``--nnodes=2``) but the trainer was left at one node: one line naming
    both settings, not FSDP2's refusal of one process nor torch's error on a mesh of the wrong size."""
    from lightning.fabric.plugins.environments import TorchElasticEnvironment

    from rlkit.spine.sharding import FSDP2Strategy

    for key, value in {"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    strategy = FSDP2Strategy()
    strategy.parallel_devices = [torch.device("cpu")]
    strategy.cluster_environment = TorchElasticEnvironment()
    with pytest.raises(ConfigError, match=r"started 2 processes .*= 1 x 1 = 1: set --trainer.num_nodes") as error:
        strategy.setup_environment()
    assert "\n" not in str(error.value)


def test_prompts_per_step_that_does_not_split_over_the_ranks():
    """Each rank generates ``prompts_per_step / world_size`` prompts of the step: 6 over 4 ranks is refused
    at setup, before the engine starts."""
    from rlkit.embedded.chain import AdditionChain
    from rlkit.engines.hf import HFEngine
    from rlkit.rewards import FinalAnswer
    from rlkit.rollouts.datamodule import RolloutDataModule

    data = RolloutDataModule(AdditionChain(num_prompts=32), HFEngine(), [FinalAnswer()], prompts_per_step=6)
    data.trainer = SimpleNamespace(global_rank=0, world_size=4)
    with pytest.raises(ConfigError, match="prompts_per_step=6 does not split over 4 .*multiple of 4") as error:
        data.setup("fit")
    assert "\n" not in str(error.value)
    data.trainer = SimpleNamespace(global_rank=0, world_size=2)
    data.setup("fit")  # 6 = 2 x 3
