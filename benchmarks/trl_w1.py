"""W1 throughput of TRL's ``GRPOTrainer``, side by side with rlkit (``benchmarks/throughput.py``).

TRL is never a dependency of rlkit: it lives in its own virtual environment, which sees the system's torch,
transformers and lightning (and rlkit through ``PYTHONPATH``) but installs TRL, accelerate and datasets on top
without letting pip touch torch or transformers::

    python -m venv --system-site-packages /work/trl-venv
    printf 'torch==2.13.0\\ntransformers==5.19.0\\n' > /work/trl-constraints.txt
    PY=/work/trl-venv/bin/python
    $PY -m pip install -c /work/trl-constraints.txt trl==1.16.0 accelerate datasets
    $PY -c "import torch, transformers, trl; print(torch.__version__, transformers.__version__, trl.__version__)"
    # 2.13.0+cpu 5.19.0 1.16.0  (the pins are the system's own versions: change them if the system's change)

Run (from the checkout; rlkit is imported from it):

    PYTHONPATH=. /work/trl-venv/bin/python benchmarks/trl_w1.py                 # one TRL run
    PYTHONPATH=. /work/trl-venv/bin/python benchmarks/trl_w1.py --runs 3        # three
    PYTHONPATH=. /work/trl-venv/bin/python benchmarks/trl_w1.py --rlkit --runs 3   # alternating TRL / rlkit
    PYTHONPATH=. /work/trl-venv/bin/python benchmarks/trl_w1.py --rlkit --set micro_batch_tokens=1024

The workload is throughput.py's W1, built by its own code: the checkpoint from ``build_checkpoint`` (seed 0:
the weights rlkit's runs load), the prompts of the ``Arithmetic`` source of its ``fit_config`` (the same
4096 rows of ``a+b=``; TRL draws them in its own seeded order, rlkit in its own), rewarded by rlkit's own
``ExactAnswer`` on the completion decoded without special tokens, as rlkit scores it. The plain-text prompt
goes through the tokenizer as TRL does it (no chat template: W1's tokenizer has none); the ids TRL hands to
``generate`` are checked to be rlkit's (BOS + one id per character). Each run is a fresh process
(``sys.executable``, ``OMP_NUM_THREADS=1``, ``torch.set_num_threads(1)``), like throughput.py's runs.

What it measures, per run: the whole step, as throughput.py does it -- wall (``time.perf_counter``) and CPU
(``time.process_time``) between two consecutive optimizer-step ends (a ``TrainerCallback``'s
``on_step_end``), median over steps 6-20 (``FIRST_STEP``..``--steps``); the generation alone (the policy's
``generate`` call, wrapped in the run: TRL 1.16 times it in ``profiling_context`` but reports that only to
wandb/mlflow/trackio); ``other`` = median of (step - generation); and the completions' mean length from TRL's
logged ``completions/mean_length`` (EOS included). With ``--rlkit`` each run is followed by one rlkit run of
this checkout (throughput.py's ``run_once``: the real ``rlkit fit`` in a subprocess; its ``generate`` is
rlkit's ``time/generate``) and ``rlkit / TRL`` ratios of the median whole step (wall and CPU) are printed;
each side's figure is the median of its runs' medians. The 1-minute load average is sampled every 2 s.

The GRPOConfig, mapped from rlkit's W1 (``fit_config``; the mapping is checked against it at start):

* batch: ``per_device_train_batch_size=128`` (TRL counts completions, not prompts), ``num_generations=8``
  (16 prompts x 8), ``gradient_accumulation_steps=1``, ``steps_per_generation=1`` (so
  ``generation_batch_size=128``), ``num_iterations=1``: one generation of 128 completions = one optimizer
  step over them in one forward/backward, as rlkit's ``ppo_epochs=1, minibatches=1`` with no micro-batching.
  On-policy, TRL skips the separate old-log-prob forward (the update's own log-probs, detached, are the old
  ones), as rlkit does.
* loss: ``loss_type="dapo"``: the sum of the token losses over all completion tokens of the step divided by
  their count, which is rlkit's ``TokenMean`` exactly when the step is one micro-batch (TRL's ``"grpo"``
  averages each sequence first, which is rlkit's ``SeqMeanTokenMean``, not W1's); ``epsilon=0.2``,
  ``epsilon_high=0.2``, ``importance_sampling_level="token"`` (PPOClip 0.2/0.2 on the token ratio);
  ``beta=0.0`` (no KL, no reference model).
* advantage: ``scale_rewards="group"``: (r - group mean) / (group std + 1e-4), the unbiased std (GroupNorm
  uses eps 1e-6; rewards are 0/1, so this changes nothing measurable).
* generation: HF ``generate`` (``use_vllm=False``, no continuous batching), ``max_completion_length=32``,
  ``temperature=1.0``, ``top_p=1.0``, ``top_k=0`` (off), no ``min_p``, ``repetition_penalty=1.0``.
* optimizer: ``optim="adamw_torch"`` (``torch.optim.AdamW``, as rlkit; transformers' default on torch >= 2.8
  is the fused variant), ``learning_rate=1e-6``, ``weight_decay=0.0``, betas/eps torch's defaults,
  ``lr_scheduler_type="constant"`` (the Trainer's default decays linearly; rlkit W1 has no schedule),
  ``max_grad_norm=1.0``.
* machine and precision: ``use_cpu=True``, ``bf16=False`` (GRPOConfig's default turns bf16 on),
  ``gradient_checkpointing=False`` (GRPOConfig's default turns it on; rlkit W1 has it off), fp32 weights.
* no reporting or saving: ``report_to="none"``, ``save_strategy="no"``, ``disable_tqdm=True``,
  ``dataloader_num_workers=0``; ``logging_steps=1`` so the completion length is logged every step (rlkit
  W1 also computes its metrics every step).

Not the same work, by design of the two libraries: TRL generates with ``transformers``' ``generate`` on 128
rows (each prompt repeated 8 times), rlkit with its own sampling loop (one prefill per prompt, the cache
repeated 8 times, finished rows dropped); TRL's loss forward also computes the entropy of every completion
position (it always does); the sampled completions differ (different random streams and prompt orders), so
their lengths, which set the step's work, differ: compare the ``len`` column too.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("rlkit_benchmarks_throughput", ROOT / "benchmarks" / "throughput.py")
throughput = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(throughput)
build_checkpoint, WORKLOADS, LoadSampler, FIRST_STEP = (
    throughput.build_checkpoint,
    throughput.WORKLOADS,
    throughput.LoadSampler,
    throughput.FIRST_STEP,
)


def w1_settings(checkpoint: str, steps: int) -> dict:
    """The rlkit W1 settings TRL is configured from, read from throughput.py's ``fit_config``.

    Raises if W1 has changed in a way the GRPOConfig mapping below does not cover.
    """
    workload = WORKLOADS["w1"]
    config = throughput.fit_config(checkpoint, workload, steps, {})
    model, data = config["model"]["init_args"], config["data"]
    expected = {
        "class": (config["model"]["class_path"], "rlkit.algorithms.PolicyGradient"),
        "advantage": (model["advantage"], "GroupNorm"),
        "ratio": (model["ratio"], "TokenRatio"),
        "clip": (model["clip"]["class_path"], "PPOClip"),
        "aggregation": (model["aggregation"], "TokenMean"),
        "kl": (model["kl"], None),
        "ppo_epochs": (model["ppo_epochs"], 1),
        "minibatches": (model["minibatches"], 1),
        "optimizer": (model["optimizer"]["class_path"], "torch.optim.AdamW"),
        "engine": (data["engine"]["class_path"], "rlkit.engines.hf.HFEngine"),
        "rewards": ([r["class_path"] for r in data["rewards"]], ["rlkit.rewards.ExactAnswer"]),
        "prompts": (data["prompts"]["class_path"], "rlkit.embedded.arithmetic.Arithmetic"),
    }
    changed = {key: got for key, (got, want) in expected.items() if got != want}
    engine = data["engine"]["init_args"]
    if changed or set(engine) - {"max_new_tokens", "temperature"}:
        raise RuntimeError(f"throughput.py's W1 changed ({changed or engine}): update trl_w1.py's GRPOConfig mapping")
    clip = model["clip"]["init_args"]
    optimizer = model["optimizer"]["init_args"]
    return {
        "prompts": data["prompts"]["init_args"],
        "prompts_per_step": data["prompts_per_step"],
        "samples": data["samples_per_prompt"],
        "max_new_tokens": engine["max_new_tokens"],
        "temperature": engine["temperature"],
        "eps_low": clip["eps_low"],
        "eps_high": clip["eps_high"],
        "lr": optimizer["lr"],
        "weight_decay": optimizer["weight_decay"],
        "max_grad_norm": model["max_grad_norm"],
        "seed": config["seed_everything"],
    }


# ---- one TRL run, in its own process ----


def trl_worker(config_path: str, result_path: str) -> None:
    """Train W1 with GRPOTrainer for ``steps`` optimizer steps; write per-step timings to ``result_path``."""
    torch.set_num_threads(1)
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlkit.data.prompts import Prompt, encode_prompt
    from rlkit.embedded.arithmetic import Arithmetic
    from rlkit.rewards import ExactAnswer

    job = json.loads(Path(config_path).read_text())
    checkpoint, steps, workdir = job["checkpoint"], job["steps"], Path(job["workdir"])
    w1 = w1_settings(checkpoint, steps)

    source = Arithmetic(**w1["prompts"])
    rows = [source[i] for i in range(len(source))]
    dataset = Dataset.from_dict({"prompt": [r.prompt for r in rows], "answer": [r.ground_truth for r in rows]})
    exact = ExactAnswer()

    def exact_answer(prompts, completions, answer, **_):
        # rlkit's own reward on the completion text TRL decoded (skip_special_tokens=True, as rlkit decodes)
        return [
            exact(c, Prompt(prompt=p, ground_truth=a)) for p, c, a in zip(prompts, completions, answer, strict=True)
        ]

    tokenizer = AutoTokenizer.from_pretrained(checkpoint, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, local_files_only=True)

    generate_times: list[tuple[float, float]] = []
    fed_ids: list[list[int]] = []
    generate = model.generate

    def timed_generate(*args, **kwargs):
        if not fed_ids:  # the first batch's rows, left padding dropped
            ids, mask = kwargs["input_ids"].tolist(), kwargs["attention_mask"].tolist()
            fed_ids.extend(
                [t for t, m in zip(row, keep, strict=True) if m] for row, keep in zip(ids, mask, strict=True)
            )
        start, cpu = time.perf_counter(), time.process_time()
        result = generate(*args, **kwargs)
        generate_times.append((time.perf_counter() - start, time.process_time() - cpu))
        return result

    model.generate = timed_generate  # TRL calls the unwrapped model's generate: this instance on one CPU process

    ends: list[tuple[float, float]] = []
    logged: dict[int, dict] = {}
    threads: list[int] = []

    class StepTimer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            threads.append(torch.get_num_threads())

        def on_step_end(self, args, state, control, **kwargs):
            ends.append((time.perf_counter(), time.process_time()))

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                logged[state.global_step] = {k: float(v) for k, v in logs.items() if isinstance(v, int | float)}

    per_step = w1["prompts_per_step"] * w1["samples"]
    args = GRPOConfig(
        output_dir=str(workdir / "trl-output"),
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        seed=w1["seed"],
        max_steps=steps,
        # one generation of 16 prompts x 8 completions = one optimizer step over all 128, in one micro-batch
        per_device_train_batch_size=per_step,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=w1["samples"],
        num_iterations=1,
        shuffle_dataset=True,
        max_completion_length=w1["max_new_tokens"],
        temperature=w1["temperature"],
        top_p=1.0,
        top_k=0,
        min_p=None,
        repetition_penalty=1.0,
        use_vllm=False,
        use_transformers_continuous_batching=False,
        # GRPO with PPO clipping, token-mean over the step's tokens, group-std advantages, no KL
        loss_type="dapo",
        scale_rewards="group",
        importance_sampling_level="token",
        epsilon=w1["eps_low"],
        epsilon_high=w1["eps_high"],
        beta=0.0,
        mask_truncated_completions=False,
        top_entropy_quantile=1.0,
        # AdamW as rlkit builds it, constant learning rate, gradient clipping
        optim="adamw_torch",
        learning_rate=w1["lr"],
        weight_decay=w1["weight_decay"],
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=w1["max_grad_norm"],
        # no reporting, saving or evaluation
        report_to="none",
        logging_strategy="steps",
        logging_steps=1,
        log_completions=False,
        disable_tqdm=True,
        save_strategy="no",
        eval_strategy="no",
        dataloader_num_workers=0,
    )
    if (args.generation_batch_size, args.steps_per_generation) != (per_step, 1):
        raise RuntimeError(f"GRPOConfig derived {args.generation_batch_size=}, {args.steps_per_generation=}")
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=exact_answer,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepTimer()],
    )
    trainer.train()
    # what rlkit's data module feeds its engine for the same prompt texts (BOS + one id per character)
    texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in fed_ids]
    rlkit_ids = [encode_prompt(Prompt(prompt=text), tokenizer) for text in texts]
    result = {
        "ends": ends,
        "generate": generate_times,
        "logged": {str(k): v for k, v in logged.items()},
        "threads": threads,
        "fed_ids": fed_ids,
        "rlkit_ids": rlkit_ids,
        "prompts": texts,
        "known": sorted({r.prompt for r in rows}),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__},
        "rlkit": sys.modules["rlkit"].__file__,
    }
    Path(result_path).write_text(json.dumps(result))


def trl_run(checkpoint: Path, steps: int, workdir: Path) -> dict:
    """One TRL W1 run in a fresh process of this interpreter; returns what ``trl_worker`` wrote."""
    job = workdir / "trl.json"
    job.write_text(json.dumps({"checkpoint": str(checkpoint), "steps": steps, "workdir": str(workdir)}))
    result = workdir / "trl-result.json"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }
    command = [sys.executable, str(Path(__file__).resolve()), "--trl-worker", str(job), str(result)]
    done = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the TRL run failed:\n{done.stderr[-4000:]}")
    out = json.loads(result.read_text())
    if out["threads"] != [1]:
        raise RuntimeError(f"the TRL run used {out['threads']} threads, not 1")
    if out["fed_ids"] != out["rlkit_ids"] or set(out["prompts"]) - set(out["known"]):
        raise RuntimeError(f"TRL fed {out['fed_ids']} for {out['prompts']}, rlkit feeds {out['rlkit_ids']}")
    if len(out["ends"]) != steps or len(out["generate"]) != steps:
        raise RuntimeError(f"{len(out['ends'])} step ends and {len(out['generate'])} generations for {steps} steps")
    return out


# ---- per-run figures: medians over steps FIRST_STEP..steps ----


def summarise_trl(out: dict, steps: int) -> dict:
    ends, generate = out["ends"], out["generate"]
    # step k (1-based, k >= 2) runs from the end of step k - 1 to its own end; generation k is step k's
    chosen = range(FIRST_STEP, steps + 1)
    wall = [ends[k - 1][0] - ends[k - 2][0] for k in chosen]
    cpu = [ends[k - 1][1] - ends[k - 2][1] for k in chosen]
    gen = [generate[k - 1][0] for k in chosen]
    lengths = [out["logged"][str(k)]["completions/mean_length"] for k in chosen if str(k) in out["logged"]]
    return {
        "step": statistics.median(wall),
        "generate": statistics.median(gen),
        "other": statistics.median(w - g for w, g in zip(wall, gen, strict=True)),
        "step_cpu": statistics.median(cpu),
        "generate_cpu": statistics.median(generate[k - 1][1] for k in chosen),
        "completion_len": statistics.mean(lengths) if lengths else float("nan"),
    }


def summarise_rlkit(out: dict) -> dict:
    steps = out["rows"][FIRST_STEP - 2 :]  # rows[k] is step k + 2 (step 1 has no start time)
    med = lambda key: statistics.median(r[key] for r in steps)  # noqa: E731
    return {
        "step": med("wall"),
        "generate": med("generate"),
        "other": statistics.median(r["wall"] - r["generate"] for r in steps),
        "step_cpu": med("cpu"),
        "generate_cpu": med("generate_cpu"),
        "completion_len": statistics.mean(r["completion_tokens"] / r["rows"] for r in steps),
    }


COLUMNS = (
    ("step", "step s", "{:8.3f}"),
    ("generate", "gen s", "{:8.3f}"),
    ("other", "other s", "{:8.3f}"),
    ("step_cpu", "step CPU s", "{:11.3f}"),
    ("generate_cpu", "gen CPU s", "{:10.3f}"),
    ("completion_len", "len", "{:6.1f}"),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=1, help="runs per side (median of their medians)")
    parser.add_argument("--rlkit", action="store_true", help="alternate with rlkit runs of this checkout")
    throughput.add_run_options(parser, "an extra rlkit model init arg for the --rlkit runs")
    parser.add_argument("--trl-worker", nargs=2, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.trl_worker:
        trl_worker(*options.trl_worker)
        return
    torch.set_num_threads(1)
    extra = throughput.model_overrides(parser, options)
    if options.set and not options.rlkit:
        parser.error("--set applies to the rlkit runs: add --rlkit")

    with tempfile.TemporaryDirectory(prefix="trl-w1-") as tmp:
        base = Path(tmp)
        workload = WORKLOADS["w1"]
        checkpoint = build_checkpoint(base / "w1", workload)
        print(f"w1 checkpoint: {checkpoint} (seed 0, as throughput.py builds it)", flush=True)
        per_side: dict[str, list[dict]] = {"TRL": []}
        if options.rlkit:
            per_side["rlkit"] = []
        with LoadSampler() as load:
            for run in range(options.runs):
                workdir = Path(tempfile.mkdtemp(prefix=f"trl-{run}-", dir=base))
                out = trl_run(checkpoint, options.steps, workdir)
                if run == 0:
                    versions = ", ".join(f"{k} {v}" for k, v in out["versions"].items())
                    print(f"TRL side: {versions}; rlkit from {out['rlkit']}")
                    print(
                        f"prompt {out['prompts'][0]!r} -> ids {out['fed_ids'][0]} as TRL feeds generate; "
                        f"rlkit's ids for all {len(out['fed_ids'])} rows of the first batch: the same"
                    )
                summary = summarise_trl(out, options.steps)
                per_side["TRL"].append(summary)
                _print_run(run, "TRL", summary)
                if options.rlkit:
                    workdir = Path(tempfile.mkdtemp(prefix=f"rlkit-{run}-", dir=base))
                    out = throughput.run_once(ROOT, checkpoint, workload, options.steps, extra, workdir)
                    summary = summarise_rlkit(out)
                    per_side["rlkit"].append(summary)
                    _print_run(run, f"rlkit ({ROOT})", summary)

    print(
        f"\nw1, medians of steps {FIRST_STEP}-{options.steps} per run; "
        + (f"median over {options.runs} runs" if options.runs > 1 else "one run")
        + " (gen: the generate call alone; len: mean completion tokens, EOS included)"
    )
    results = {
        name: {key: statistics.median(s[key] for s in runs) for key in runs[0]} for name, runs in per_side.items()
    }
    width = max(len(name) for name in results) + 2
    print(f"{'':{width}}" + "".join(f"{title:>{len(fmt.format(0))}}" for _, title, fmt in COLUMNS))
    for name, r in results.items():
        print(f"{name:{width}}" + "".join(fmt.format(r[key]) for key, _, fmt in COLUMNS))
    if options.rlkit:
        trl_r, rl = results["TRL"], results["rlkit"]
        per_run = lambda key: {n: [round(r[key], 3) for r in runs] for n, runs in per_side.items()}  # noqa: E731
        print(
            f"rlkit / TRL whole step: wall {rl['step'] / trl_r['step']:.2f}, "
            f"CPU {rl['step_cpu'] / trl_r['step_cpu']:.2f} (per-run wall {per_run('step')}; CPU {per_run('step_cpu')})"
        )
    samples = load.samples
    print(
        f"load average (1 min) during the runs: mean {statistics.mean(samples):.2f}, "
        f"min {min(samples):.2f}, max {max(samples):.2f} on {os.cpu_count()} cores"
    )


def _print_run(run: int, name: str, s: dict) -> None:
    print(
        f"run {run + 1} {name}: step {s['step']:.3f} s (gen {s['generate']:.3f}), CPU {s['step_cpu']:.3f} s "
        f"(gen {s['generate_cpu']:.3f}), len {s['completion_len']:.1f}, load {os.getloadavg()[0]:.2f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
