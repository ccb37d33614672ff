"""Per-step time breakdown of ``rlkit fit`` and rollout tokens/s, HFEngine vs VLLMEngine, same workload.

    python benchmarks/step.py                       # both engines, embedded task, 12 steps each
    python benchmarks/step.py --engines hf --steps 30 --prompts 16 --samples 8

Prints, per engine, the median seconds of each phase (generate / score / logprob / update / sync), the
wall time of the whole step as Lightning sees it, the remainder ("other": Lightning, collation,
metrics), its share of the step, and rollout tokens/s. The first 2 steps are warm-up and not counted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

ENGINES = {"hf": "rlkit.engines.hf.HFEngine", "vllm": "rlkit.engines.vllm.VLLMEngine"}
PHASES = ("generate", "score", "logprob", "update", "sync")


def measure(engine: str, steps: int, prompts: int, samples: int, max_new_tokens: int, experiment: str) -> dict:
    import lightning.pytorch as pl

    from rlkit.cli import build_cli

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    workdir = tempfile.mkdtemp(prefix="rlkit-bench-")
    os.chdir(workdir)
    args = [
        f"--config={os.path.join(root, 'experiments', experiment + '.yaml')}",
        f"--data.engine={ENGINES[engine]}",
        f"--data.engine.init_args.max_new_tokens={max_new_tokens}",
        f"--data.prompts_per_step={prompts}",
        f"--data.samples_per_prompt={samples}",
        f"--trainer.max_steps={steps + 2}",
        "--trainer.limit_val_batches=0",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_checkpointing=false",
        "--trainer.callbacks=[]",
        "--trainer.logger=false",
    ]
    cli = build_cli(args, run=False)
    rows = []

    class Timer(pl.Callback):
        # A step's wall time runs from the end of the previous step to the end of this one: it holds
        # the rollout's generation (done while Lightning fetches the batch), collation, the training
        # step and Lightning's own work.
        last_end = None

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            now = time.perf_counter()
            if self.last_end is not None:
                tokens = batch.completion_mask.sum().item()
                rows.append({**module.last_timings, "wall": now - self.last_end, "tokens": tokens})
            self.last_end = now

    cli.trainer.callbacks.append(Timer())
    cli.trainer.fit(cli.model, cli.datamodule)
    rows = rows[1:]  # with the first step (no previous end) skipped: 2 warm-up steps
    result = {key: statistics.median(r[key] for r in rows) for key in (*PHASES, "wall")}
    result["other"] = statistics.median(r["wall"] - sum(r[p] for p in PHASES) for r in rows)
    result["tokens_per_s"] = statistics.median(r["tokens"] / r["generate"] for r in rows)
    result["steps"] = len(rows)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default="hf,vllm")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=4)
    parser.add_argument("--experiment", default="drgrpo")
    options = parser.parse_args()
    results = {}
    for engine in options.engines.split(","):
        results[engine] = measure(
            engine,
            options.steps,
            options.prompts,
            options.samples,
            options.max_new_tokens,
            options.experiment,
        )
    print(
        f"\nworkload: experiments/{options.experiment}.yaml, {options.prompts} prompts x {options.samples} samples, "
        f"max_new_tokens={options.max_new_tokens}; medians over {options.steps} steps (after 2 warm-up steps)"
    )
    header = f"{'engine':8}" + "".join(f"{p:>10}" for p in (*PHASES, "other", "step")) + f"{'other %':>9}{'tok/s':>10}"
    print(header)
    for engine, r in results.items():
        cells = "".join(f"{r[p]:10.4f}" for p in (*PHASES, "other", "wall"))
        print(f"{engine:8}{cells}{100 * r['other'] / r['wall']:8.1f}%{r['tokens_per_s']:10.0f}")
    if len(results) == 2:
        hf, vllm = results["hf"], results["vllm"]
        print(
            f"rollout tokens/s HF / vLLM: {hf['tokens_per_s'] / vllm['tokens_per_s']:.2f}x; "
            f"step time vLLM / HF: {vllm['wall'] / hf['wall']:.2f}x"
        )


if __name__ == "__main__":
    main()
