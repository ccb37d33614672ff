"""Shared helpers of the training-spine tests: short runs of the real CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from rlkit.data.batch import Rollout

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS = ROOT / "experiments"

# A few prompts, a few samples, a few steps: seconds per run on 2 cores.
SHORT = [
    "--data.prompts_per_step=4",
    "--data.samples_per_prompt=4",
    "--trainer.max_steps=4",
    "--trainer.val_check_interval=null",
    "--trainer.limit_val_batches=0",
    "--trainer.enable_progress_bar=false",
]

# A few steps with held-out checks (before the first update, after rollout 2 and after the last).
QUICK = [
    "--data.prompts_per_step=4",
    "--data.samples_per_prompt=4",
    "--trainer.max_steps=3",
    "--trainer.val_check_interval=2",
    "--data.val_prompts.init_args.num_prompts=8",
]

#: Multi-turn episodes on the embedded task: two model turns per sample (a plain-text environment that asks
#: again, tests/environments/turn_engine.py), a reward for each right turn, credited per turn.
EPISODES = [
    "--data.environment=environments.turn_engine.Retry",
    "--data.environment.init_args.turn_reward=0.5",
    "--model.advantage=TurnDiscountedReturn",
    "--model.advantage.init_args.gamma=0.9",
]


def short_args(tmp_path: Path, experiment: str = "drgrpo", *extra: str) -> list[str]:
    return [
        "fit",
        f"--config={EXPERIMENTS / (experiment + '.yaml')}",
        *SHORT,
        f"--trainer.default_root_dir={tmp_path}",
        f"--trainer.logger.init_args.save_dir={tmp_path / 'runs'}",
        *extra,
    ]


def event_files(runs: Path) -> list[Path]:
    """The main TensorBoard events files under ``runs`` (not those of a run's HPARAMS sub-run)."""
    from rlkit.spine.reporting import HPARAMS_RUN

    return sorted(p for p in runs.rglob("events.out.tfevents.*") if p.parent.name != HPARAMS_RUN)


def run_rlkit(args: list[str], cwd: Path, timeout: float = 600, console: bool = False) -> subprocess.CompletedProcess:
    """Run the installed ``rlkit`` console script in a new process; ``console=True`` merges stderr into stdout
    in the order written, as a terminal shows them."""
    tests = str(ROOT / "tests")  # the tests' own modules (spine.faulty, ...) by import path
    path = os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=path)
    command = [sys.executable, "-m", "rlkit.cli", *args]
    streams = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT} if console else {"capture_output": True}
    return subprocess.run(command, cwd=cwd, env=env, text=True, timeout=timeout, **streams)


def random_rollout(seed: int = 0, N: int = 7, P: int = 5, T: int = 9, vocabulary: int = 20) -> Rollout:
    """Left-padded prompts (1..P tokens), right-padded completions (0..T tokens, one empty, one full)."""
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(1, P + 1, (N,), generator=generator)  # [N]
    completion = torch.randint(0, T + 1, (N,), generator=generator)  # [N]
    completion[0], completion[1] = 0, T
    columns = torch.arange(P + T)  # [P + T]
    mask = (columns >= P - prompt[:, None]) & (columns < P + completion[:, None])  # [N, P + T]
    ids = torch.randint(4, vocabulary, (N, P + T), generator=generator).masked_fill(~mask, 0)  # [N, P + T]
    return Rollout(
        input_ids=ids,
        attention_mask=mask.long(),
        completion_mask=mask[:, P:].float(),
        group_ids=torch.zeros(N, dtype=torch.long),
        scores=torch.zeros(N),
        engine_logprobs=torch.zeros(N, T),
        truncated=torch.zeros(N, dtype=torch.bool),
        temperature=0.7,
    )


#: Invariance comparisons ("micro-batches, packing and data parallelism change memory, not the maths") run
#: in float64, the trainer and the engine: rounding is then ~1e-16 of a value, so on any CPU two runs of the
#: same maths agree to ~1e-12 of their update, while a wrong normaliser (a micro-batch's or a rank's own
#: totals instead of the step's) moves the update by O(1) of itself. A float32 tolerance is one CPU's rounding.
FLOAT64 = ["--trainer.precision=64-true", "--data.engine.init_args.dtype=float64"]
#: the largest gap between two such runs, relative to the largest update of a weight
SAME_MATHS = 1e-9


def assert_same_update(after: dict, other: dict, before: dict, tolerance: float = SAME_MATHS) -> float:
    """Every tensor of ``other`` equals ``after`` to ``tolerance`` of the largest update (``after - before``,
    which must be visible); returns that update."""
    update = max((after[k].double() - before[k].double()).abs().max().item() for k in before)
    assert update > 1e-4, f"training moved no weight by more than {update}: the comparison tests nothing"
    for name, tensor in after.items():
        gap = (other[name].double() - tensor.double()).abs().max().item()
        assert gap <= tolerance * update, (
            f"{name}: differs by {gap:.3g}, more than {tolerance:g} x the update {update:.3g}"
        )
    return update


def devices_while_training(cli) -> dict[str, torch.device]:
    """The devices of the policy (and of a critic or a teacher) during the first training step, recorded by a
    callback: Lightning moves the module back to the CPU when ``fit`` ends (``Strategy.teardown``), so after it
    they say nothing of where training ran."""
    import lightning.pytorch as pl

    seen: dict[str, torch.device] = {}

    class Devices(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if not seen:
                seen["policy"] = next(module.policy.parameters()).device
                if getattr(module, "critic", None) is not None:
                    seen["critic"] = next(module.critic.parameters()).device
                teacher = getattr(module.spine, "frozen", {}).get("teacher")
                if teacher is not None:
                    seen["teacher"] = next(teacher.parameters()).device

    cli.trainer.callbacks.append(Devices())
    return seen
