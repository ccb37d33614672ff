"""Wall time per rollout with generation ahead of training: ``data.max_staleness`` 0, 1 and 2 side by side.

    python benchmarks/async.py                       # the embedded default (experiments/drgrpo.yaml), 3 runs each
    python benchmarks/async.py --runs 5 --steps 12 --staleness 0 1
    python benchmarks/async.py --workload w1         # W1's model and step shape (benchmarks/throughput.py)
    python benchmarks/async.py --staleness 0 1 --producer thread process   # s=1 in a thread and in a process
    python benchmarks/async.py --reward-workers 0 1  # rewards on the trainer's thread, or in the producer's
    python benchmarks/async.py --staleness 0 1 --engine vllm      # VLLMEngine (the thread drives the one engine)
    python benchmarks/async.py --workload w1 --device cuda        # trainer and HFEngine on one GPU

Each run is the real ``rlkit fit`` (experiments/drgrpo.yaml: the embedded task, Dr.GRPO, 32 prompts x 8,
at most 32 new tokens, HFEngine) in a fresh process, with one torch thread for the trainer and one for the
producer (``data.producer_threads=1``; ``OMP_NUM_THREADS=1``), no validation, no checkpoints. ``--producer``
runs each staleness >= 1 with the producer in a thread and/or in its own process (``data.async_producer``); 0 runs
once (no producer). ``--reward-workers`` runs each variant with rewards scored in this process
(``data.reward_workers=0``: a producer thread hands its scoring to the trainer's thread) and/or in worker
processes (``1``: the producer thread scores itself, so it can run more than one rollout ahead). A run's figure
is the median over rollouts ``--skip``+1..``--steps`` of the wall time between the ends of two training steps;
the runs alternate between the variants (0, 1 thread, 1 process, 0, ...) so that a change of load hits all of
them, and each variant's figure is the median of its runs' figures. Also printed: the
median ``async/trainer_wait_s`` (the trainer waiting for a rollout), ``async/producer_wait_s`` (the
producer waiting for weights, or for its rewards to be scored on the trainer's thread) and the generation time
(``time/generate_s``), the bound overlap can reach (the ``max_staleness=0`` wall less its generation: the
trainer's own work, were generation wholly hidden and neither side slowed by the other), and the 1-minute
load average (``os.getloadavg()``) sampled every 2 s during the runs.

``--workload w1``: W1's random-weight 2.63M-parameter Qwen2 and its shape (16 ``a+b=`` prompts x 8, at most 32
new tokens, ``ExactAnswer``, GroupNorm advantage, token-mean aggregation, AdamW lr 1e-6), built by
``benchmarks/throughput.py``, on the same Dr.GRPO experiment file otherwise.

``--engine vllm``: ``VLLMEngine`` (the same 32 new tokens) instead of ``HFEngine``; with ``max_staleness >= 1``
the producer thread drives the one engine, whose model runs in vLLM's engine-core process (vLLM binds that
process's OpenMP threads itself: by default all CPUs but one reserved for its scheduler), so the figures are
not "one thread each side". ``--producer process`` is refused with it.

``--device cuda``: the trainer (``configs/trainer/single_gpu.yaml``: bf16 autocast) and ``HFEngine`` (its copy of
the weights, in the producer thread or process) on one GPU; each side still drives it from one CPU thread.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from throughput import WORKLOADS, LoadSampler, build_checkpoint  # noqa: E402 - a sibling script, not a package


def worker(args_path: str, result_path: str) -> None:
    """One ``rlkit fit`` with the arguments in ``args_path``; writes each step's wall time and async metrics."""
    import torch

    torch.set_num_threads(1)
    import lightning.pytorch as pl

    from rlkit.cli import build_cli

    rows: list[dict] = []

    class StepTimer(pl.Callback):
        last_end = None

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            now = time.perf_counter()
            if self.last_end is not None:
                stats = batch.stats
                rows.append(
                    {
                        "wall": now - self.last_end,
                        "trainer_wait": stats.get("async/trainer_wait_s", float("nan")),
                        "producer_wait": stats.get("async/producer_wait_s", float("nan")),
                        "generate": batch.timings.get("generate", float("nan")),
                    }
                )
            self.last_end = time.perf_counter()

    cli = build_cli(json.loads(Path(args_path).read_text()), run=False)
    own_callbacks = cli.model.configure_callbacks
    cli.model.configure_callbacks = lambda: [*own_callbacks(), StepTimer()]  # after WeightSync's push
    cli.trainer.fit(cli.model, cli.datamodule)
    Path(result_path).write_text(json.dumps(rows))


def w1_overrides(directory: Path) -> list[str]:
    """W1's checkpoint (built into ``directory``) and step shape, as ``rlkit fit`` overrides."""
    shape = WORKLOADS["w1"]
    checkpoint = build_checkpoint(directory, shape)
    prompts = {
        "class_path": "rlkit.embedded.arithmetic.Arithmetic",
        "init_args": {"num_prompts": 4096, "max_operand": 9, "operations": "+", "split": "train"},
    }
    return [
        f"--model.policy.checkpoint={checkpoint}",
        f"--data.prompts={json.dumps(prompts)}",
        "--data.val_prompts=null",
        f"--data.rewards={json.dumps([{'class_path': 'rlkit.rewards.ExactAnswer'}])}",
        f"--data.prompts_per_step={shape['prompts']}",
        f"--data.samples_per_prompt={shape['samples']}",
        f"--data.engine.init_args.max_new_tokens={shape['tokens']}",
        "--model.advantage=GroupNorm",
        "--model.aggregation=TokenMean",
        "--model.optim.optimizer.init_args.lr=1e-6",
    ]


def run_once(staleness: int, producer: str, workers: int, steps: int, workdir: Path, extra: list[str]) -> list[dict]:
    configs = [a for a in extra if a.startswith("--config=")]  # before the overrides below, which they would undo
    args = [
        f"--config={ROOT / 'experiments' / 'drgrpo.yaml'}",
        *configs,
        f"--trainer.max_steps={steps}",
        "--trainer.val_check_interval=null",
        "--trainer.limit_val_batches=0",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_checkpointing=false",
        "--trainer.logger=false",
        "--trainer.callbacks=[]",
        f"--trainer.default_root_dir={workdir}",
        f"--data.max_staleness={staleness}",
        "--data.producer_threads=1",
        *([f"--data.async_producer={producer}"] if staleness else []),
        f"--data.reward_workers={workers}",
        *(a for a in extra if a not in configs),
    ]
    args_path, result_path = workdir / "args.json", workdir / "result.json"
    args_path.write_text(json.dumps(args))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", str(args_path), str(result_path)]
    done = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(
            f"the run with max_staleness={staleness} ({producer}, reward_workers={workers}) failed:\n"
            f"{done.stderr[-4000:]}"
        )
    return json.loads(result_path.read_text())


def torch_device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "no visible GPU"


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="runs per staleness value (alternating)")
    parser.add_argument("--steps", type=int, default=10, help="rollouts per run")
    parser.add_argument("--skip", type=int, default=3, help="first rollouts left out of a run's median")
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--workload", choices=["embedded", "w1"], default="embedded")
    parser.add_argument("--engine", choices=["hf", "vllm"], default="hf", help="HFEngine or VLLMEngine")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the trainer and HFEngine run")
    parser.add_argument(
        "--producer", choices=["thread", "process"], nargs="+", default=["thread"], help="where s >= 1 produces"
    )
    parser.add_argument(
        "--reward-workers", type=int, nargs="+", default=[0], help="data.reward_workers values (each variant with each)"
    )
    options = parser.parse_args()
    if options.steps - options.skip < 2:
        parser.error("--steps must exceed --skip by at least 2")
    variants = [
        (s, p, w) for w in options.reward_workers for s in options.staleness for p in (options.producer if s else ["-"])
    ]
    figures: dict[tuple[int, str, int], list[dict]] = {v: [] for v in variants}
    with LoadSampler() as load, tempfile.TemporaryDirectory(prefix="rlkit-async-") as tmp:
        extra = w1_overrides(Path(tmp) / "w1") if options.workload == "w1" else []
        if options.engine == "vllm":
            extra += ["--data.engine=rlkit.engines.vllm.VLLMEngine", "--data.engine.init_args.max_new_tokens=32"]
        if options.device == "cuda":
            if options.engine == "vllm":
                parser.error("--device cuda is for HFEngine (VLLMEngine places itself)")
            extra += [
                f"--config={ROOT / 'configs' / 'trainer' / 'single_gpu.yaml'}",
                "--data.engine.init_args.device=cuda",
            ]
        for run in range(options.runs):
            for s, producer, workers in variants:
                workdir = Path(tmp) / f"s{s}-{producer}-w{workers}-run{run}"
                workdir.mkdir()
                rows = run_once(s, producer, workers, options.steps, workdir, extra)[options.skip - 1 :]
                figure = {key: statistics.median(r[key] for r in rows) for key in rows[0]}  # from rollout skip+1
                figures[s, producer, workers].append(figure)
                print(
                    f"run {run + 1} max_staleness={s} {producer} reward_workers={workers}: "
                    f"{figure['wall']:.3f} s/rollout (load {os.getloadavg()[0]:.2f})",
                    flush=True,
                )
    base = statistics.median(f["wall"] for f in figures[variants[0]])
    what = {"embedded": "embedded default (experiments/drgrpo.yaml, 32 prompts x 8, <= 32 new tokens)"}.get(
        options.workload, "W1 (2.63M-parameter Qwen2, 16 prompts x 8, <= 32 new tokens)"
    )
    what += ", VLLMEngine" if options.engine == "vllm" else ", HFEngine, one thread each side"
    what += f", on {torch_device_name()}" if options.device == "cuda" else ""
    print(f"\n{what}; median of {options.runs} runs, rollouts {options.skip + 1}-{options.steps}")
    header = f"{'max_staleness':>13} {'producer':>8} {'workers':>7} {'s/rollout':>10} {'vs first':>9}"
    header += f" {'trainer wait s':>15} {'producer wait s':>16} {'generate s':>10}"
    print(f"{header}  runs")
    for (s, producer, workers), runs in figures.items():
        wall = statistics.median(f["wall"] for f in runs)
        trainer_wait = statistics.median(f["trainer_wait"] for f in runs)
        producer_wait = statistics.median(f["producer_wait"] for f in runs)
        each = " ".join(f"{f['wall']:.3f}" for f in runs)
        row = f"{s:>13} {producer:>8} {workers:>7} {wall:>10.3f} {wall / base:>8.2f}x"
        generate = statistics.median(f["generate"] for f in runs)
        row += f" {trainer_wait:>15.3f} {producer_wait:>16.3f} {generate:>10.3f}"
        print(f"{row}  {each}")
    if variants[0][0] == 0:  # what overlap can reach at best: s = 0's rollout with its generation hidden
        generate = statistics.median(f["generate"] for f in figures[variants[0]])
        print(
            f"overlap bound: max_staleness=0 less its generation, {base - generate:.3f} s/rollout "
            f"({(base - generate) / base:.2f}x): with generation wholly hidden, each side at its own speed"
        )
    samples = load.samples or [os.getloadavg()[0]]
    print(
        f"load average (1 min) during the runs: median {statistics.median(samples):.2f}, "
        f"min {min(samples):.2f}, max {max(samples):.2f} on {os.cpu_count()} CPUs"
    )


if __name__ == "__main__":
    main()
