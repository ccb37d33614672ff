"""A short Dr.GRPO run of a real-shaped preset: rollout tokens/s, training tokens/s and the training MFU.

    python benchmarks/gpu_check.py                                  # one GPU: qwen2-small, HFEngine on CUDA
    python benchmarks/gpu_check.py --engine vllm --steps 20         # VLLMEngine (sleeping between rollouts)
    python benchmarks/gpu_check.py --device cpu --preset qwen2-test --steps 3 --prompts 2 --samples 4 --tokens 8

The run is ``rlkit fit`` on the real Trainer (``experiments/drgrpo.yaml`` with ``configs/trainer/single_gpu.yaml``
on a GPU, ``cpu.yaml`` on CPU), the policy the preset's checkpoint (``rlkit model build``, random weights),
arithmetic prompts in the tokenizer's chat template, and a reward for a completion that starts without white
space (:data:`PATTERN`, so a model of random weights has something to learn). Figures are medians over the
steps after the first (which warms up):

- rollout tokens/s: completion tokens / ``time/generate_s``;
- training tokens/s: the rollout's real prompt + completion tokens (padding excluded) / ``time/update_s``
  (the forward, backward and optimizer step of the update; the old log-prob forward, ``time/logprob_s``, is
  not counted);
- MFU: 6 x parameters x training tokens/s / the device's peak dense bf16 FLOP/s (Kaplan et al. 2020's
  6N FLOPs per trained token; attention FLOPs are not counted, as in PaLM's "MFU without attention").
  The peak is ``RLKIT_PEAK_FLOPS`` when set, else read from :data:`PEAK_BF16_FLOPS` by
  ``torch.cuda.get_device_name()``; on CPU it is ``RLKIT_PEAK_FLOPS`` or a nominal 1e12 (a meaningless
  figure there: the code path is what is checked).

It also prints the reward (``reward/mean``) of the first and last steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Peak dense (no sparsity) bf16 tensor-core FLOP/s from the vendors' data sheets (SXM parts), matched by a
#: substring of ``torch.cuda.get_device_name()``, first match wins.
PEAK_BF16_FLOPS = (
    ("H200", 989e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("GH200", 989e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("A10G", 70e12),
    ("RTX 4090", 165e12),
)
#: The CPU stand-in: MFU on CPU only exercises the code path.
NOMINAL_CPU_FLOPS = 1e12
#: A completion that starts without white space: about 28% of random-weight completions (measured on
#: qwen2-test's tokenizer, uniform tokens), a first-token preference a policy of random weights can learn.
PATTERN = r"\S.*"


def peak_flops(device: str) -> tuple[float, str]:
    """The peak bf16 FLOP/s of ``device`` and where it came from; ``RLKIT_PEAK_FLOPS`` overrides the table."""
    if os.environ.get("RLKIT_PEAK_FLOPS"):
        return float(os.environ["RLKIT_PEAK_FLOPS"]), "RLKIT_PEAK_FLOPS"
    if device == "cpu":
        return NOMINAL_CPU_FLOPS, "nominal CPU figure"
    import torch

    name = torch.cuda.get_device_name()
    for key, flops in PEAK_BF16_FLOPS:
        if key in name:
            return flops, f"{name} (table)"
    raise SystemExit(
        f"no peak bf16 FLOP/s known for {name!r}: set RLKIT_PEAK_FLOPS to its data sheet's dense bf16 figure"
    )


def fit_args(options: argparse.Namespace, checkpoint: str, run_dir: Path) -> list[str]:
    """The ``rlkit fit`` arguments of the run."""
    trainer = "single_gpu.yaml" if options.device == "cuda" else "cpu.yaml"
    if options.engine == "vllm":
        engine = [
            "--data.engine=rlkit.engines.vllm.VLLMEngine",
            f"--data.engine.init_args.max_new_tokens={options.tokens}",
            f"--data.engine.init_args.sleep_between_rollouts={options.device == 'cuda'}",
            "--data.engine.init_args.gpu_memory_utilization=0.3",
            "--data.engine.init_args.max_model_len=512",
        ]
    else:
        engine = [
            "--data.engine=rlkit.engines.hf.HFEngine",
            f"--data.engine.init_args.max_new_tokens={options.tokens}",
            f"--data.engine.init_args.device={options.device}",
        ]
    reward = json.dumps(
        [{"class_path": "rlkit.rewards.FormatReward", "init_args": {"pattern": PATTERN, "name": "no_leading_space"}}]
    )
    return [
        f"--config={ROOT / 'experiments' / 'drgrpo.yaml'}",
        f"--config={ROOT / 'configs' / 'trainer' / trainer}",
        f"--model.policy.checkpoint={checkpoint}",
        f"--data.rewards={reward}",
        f"--model.optim.optimizer.init_args.lr={options.lr}",
        "--data.prompts=rlkit.embedded.Arithmetic",
        "--data.prompts.init_args.num_prompts=4096",
        "--data.val_prompts=null",
        f"--data.prompts_per_step={options.prompts}",
        f"--data.samples_per_prompt={options.samples}",
        "--data.max_prompt_length=64",
        *engine,
        f"--trainer.max_steps={options.steps}",
        "--trainer.val_check_interval=null",
        "--trainer.limit_val_batches=0",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_checkpointing=false",
        "--trainer.callbacks=[]",
        f"--trainer.default_root_dir={run_dir}",
        f"--trainer.logger.init_args.save_dir={run_dir / 'runs'}",
    ]


def step_recorder():
    """A callback that keeps, per step, the phases' seconds, the token counts and the mean reward."""
    import lightning.pytorch as pl

    class StepRecorder(pl.Callback):
        def __init__(self) -> None:
            self.rows: list[dict] = []

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            metrics = trainer.callback_metrics
            self.rows.append(
                {
                    "generate": float(metrics["time/generate_s"]),
                    "update": float(metrics["time/update_s"]),
                    "completion_tokens": float(batch.completion_mask.sum()),
                    "real_tokens": float(batch.attention_mask.sum()),
                    "reward": float(batch.scores.mean()),  # the one reward: reward/mean
                }
            )

    return StepRecorder()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf")
    parser.add_argument("--preset", default="qwen2-small")
    parser.add_argument("--steps", type=int, default=12, help="rollouts (one optimizer step each)")
    parser.add_argument("--prompts", type=int, default=32, help="prompts per step")
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt")
    parser.add_argument("--tokens", type=int, default=64, help="max new tokens per completion")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (random weights learn fast)")
    options = parser.parse_args()
    if options.steps < 2:
        parser.error("--steps must be >= 2: the first step warms up and is left out of the medians")
    import torch

    if options.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch sees no CUDA device: run on a GPU machine, or pass --device cpu")
    from rlkit.cli import build_cli
    from rlkit.model_presets import preset_checkpoint
    from rlkit.models import load_policy

    peak, peak_source = peak_flops(options.device)
    checkpoint = str(preset_checkpoint(options.preset))
    parameters = sum(p.numel() for p in load_policy(checkpoint).parameters())
    run_dir = Path(tempfile.mkdtemp(prefix="rlkit-gpu-check-"))
    os.chdir(run_dir)
    cli = build_cli(fit_args(options, checkpoint, run_dir), run=False)
    recorder = step_recorder()
    cli.trainer.callbacks.append(recorder)
    cli.trainer.fit(cli.model, cli.datamodule)
    rows = recorder.rows[1:]
    rollout_tok_s = statistics.median(r["completion_tokens"] / r["generate"] for r in rows)
    train_tok_s = statistics.median(r["real_tokens"] / r["update"] for r in rows)
    mfu = 6 * parameters * train_tok_s / peak
    device = torch.cuda.get_device_name() if options.device == "cuda" else "cpu"
    print(
        f"gpu_check: {options.preset} ({parameters / 1e6:.1f}M parameters), {options.engine} engine on {device}, "
        f"{options.steps} steps of {options.prompts} x {options.samples} completions of <= {options.tokens} tokens"
    )
    print(f"rollout tokens/s:  {rollout_tok_s:,.0f}  (median of steps 2-{options.steps})")
    print(f"training tokens/s: {train_tok_s:,.0f}  (real prompt + completion tokens / time/update_s)")
    print(f"training MFU:      {mfu:.2%}  (6 x {parameters:,} x {train_tok_s:,.0f} / {peak:.3g} FLOP/s, {peak_source})")
    rewards = [r["reward"] for r in recorder.rows]
    print(f"reward/mean:       {rewards[0]:.3f} (step 1) -> {rewards[-1]:.3f} (step {len(rewards)})")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
