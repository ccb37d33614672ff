"""W1 throughput: where a training step's time goes, against the machine's limit, old checkout vs this one.

    python benchmarks/throughput.py                                   # this checkout, one run
    git worktree add /tmp/rlkit-old 88ab265
    python benchmarks/throughput.py --old /tmp/rlkit-old --runs 3     # alternating old/new, 3 runs each

The workload ("W1", issue 9): a Qwen2 causal LM with random weights (hidden 256, 4 layers, 4 heads of 64,
MLP 512, vocabulary 17, tied embeddings: 2.63M parameters) and a character tokenizer for digits, ``+-=``
and special tokens; single-digit addition prompts ``a+b=``; 16 prompts x 8 samples per step, at most 32
new tokens, temperature 1; AdamW lr 1e-6, gradient clipping 1.0; one rollout = one optimizer step; one
thread. Each run is ``rlkit fit`` (the real Trainer and training step) in a subprocess whose ``sys.path``
starts with the checkout under test, on the same checkpoint, prompts and seeds.

Per run it prints the medians over steps 6-20 of the whole step (wall time between the ends of two
training steps, as Lightning runs them), its phases (``time/*``: generate, score, logprob, update, sync)
and the rest (``other``); rollout tokens/s (completion tokens / generate); trainer tokens/s (real prompt
and completion tokens, padding excluded, / (logprob + update)); the padding fraction of the collated
rollout; and the physical limit: the generation time plus one forward+backward over the step's real
tokens alone (packed without padding, measured here on the same rollouts), and the step's ratio to it.
With ``--old`` the runs alternate old/new and each side's figure is the median of its runs' medians.
The 1-minute load average is sampled every 2 s during the runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("generate", "score", "logprob", "update", "sync")
VOCABULARY = "0123456789+-="  # with the 4 special tokens: 17 ids
FIRST_STEP = 6  # medians over steps FIRST_STEP..--steps (1-based): the first ones warm up


#: name: (hidden, layers, heads of 64 or 32, MLP, prompts per step, samples per prompt, max new tokens)
WORKLOADS = {
    "w1": {
        "hidden": 256,
        "layers": 4,
        "heads": 4,
        "head_dim": 64,
        "mlp": 512,
        "prompts": 16,
        "samples": 8,
        "tokens": 32,
    },
    # the learning workload's shape (660k parameters, 2 x 8, 8 new tokens): a step is ~20 ms, so what
    # Lightning and rlkit spend outside the timed phases shows
    "small": {
        "hidden": 128,
        "layers": 3,
        "heads": 4,
        "head_dim": 32,
        "mlp": 400,
        "prompts": 2,
        "samples": 8,
        "tokens": 8,
    },
}


def build_checkpoint(directory: Path, workload: dict, seed: int = 0) -> Path:
    """Save a Qwen2 of the workload's shape (random weights) and its tokenizer into ``directory``.

    transformers 5.x loads any tokenizer of a ``qwen2`` checkpoint as ``Qwen2Tokenizer``, which swaps in
    byte-level pre-tokenizer and decoder whatever ``tokenizer_class`` says; for this vocabulary (digits,
    ``+-=``: characters that byte-level maps to themselves) tokens still round-trip, which is checked here
    on every prompt and answer rather than assumed.
    """
    from transformers import AutoTokenizer, GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from rlkit.embedded.model import build_tokenizer

    tokenizer = build_tokenizer(VOCABULARY)
    vocab = tokenizer.get_vocab()
    config = Qwen2Config(
        vocab_size=len(vocab),
        hidden_size=workload["hidden"],
        intermediate_size=workload["mlp"],
        num_hidden_layers=workload["layers"],
        num_attention_heads=workload["heads"],
        num_key_value_heads=workload["heads"],
        head_dim=workload["head_dim"],
        max_position_embeddings=128,
        tie_word_embeddings=True,
        pad_token_id=vocab["<pad>"],
        bos_token_id=vocab["<bos>"],
        eos_token_id=vocab["<eos>"],
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=vocab["<bos>"], eos_token_id=vocab["<eos>"], pad_token_id=vocab["<pad>"]
    )
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)

    loaded = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    for a in range(10):
        for b in range(10):
            text, answer = f"{a}+{b}=", str(a + b)
            ids = loaded(text)["input_ids"]
            expected = [vocab["<bos>"], *(vocab[c] for c in text)]
            if ids != expected or loaded.decode(ids, skip_special_tokens=True) != text:
                raise RuntimeError(f"the W1 tokenizer does not round-trip {text!r}: {ids} != {expected}")
            if loaded.decode([vocab[c] for c in answer] + [vocab["<eos>"]], skip_special_tokens=True) != answer:
                raise RuntimeError(f"the W1 tokenizer does not decode the answer {answer!r}")
    return directory


# Where a flat family option of rlkit before the typed spine (issue 15) lives since: W1 runs old checkouts too.
NESTED = {
    "checkpoint": "policy",
    "ppo_epochs": "loop",
    "minibatches": "loop",
    "micro_batch_size": "loop",
    "micro_batch_tokens": "loop",
    "pack_sequences": "loop",
    "optimizer": "optim",
    "max_grad_norm": "optim",
}


def nest_model_args(args: dict) -> dict:
    """The family options in the typed spine's layout (``policy.checkpoint``, ``loop.ppo_epochs``, ...)."""
    out: dict = {}
    for key, value in args.items():
        if key in NESTED:
            out.setdefault(NESTED[key], {})[key] = value
        else:
            out[key] = value
    return out


def fit_config(checkpoint: str, workload: dict, steps: int, model_args: dict, nested: bool = True) -> dict:
    """The ``rlkit fit`` configuration (GRPO's advantage, no KL: the work a GRPO step does)."""
    family = {
        "advantage": "GroupNorm",
        "ratio": "TokenRatio",
        "clip": {"class_path": "PPOClip", "init_args": {"eps_low": 0.2, "eps_high": 0.2}},
        "aggregation": "TokenMean",
        "kl": None,
        "checkpoint": checkpoint,
        "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 1e-6, "weight_decay": 0.0}},
        "ppo_epochs": 1,
        "minibatches": 1,
        "max_grad_norm": 1.0,
        **model_args,
    }
    return {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "devices": 1,
            "precision": "32-true",
            "max_steps": steps,
            "limit_val_batches": 0,
            "num_sanity_val_steps": 0,
            "log_every_n_steps": 1,
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "callbacks": [],
        },
        "model": {
            "class_path": "rlkit.algorithms.PolicyGradient",
            "init_args": nest_model_args(family) if nested else family,
        },
        "data": {
            "prompts": {
                "class_path": "rlkit.embedded.arithmetic.Arithmetic",
                "init_args": {"num_prompts": 4096, "max_operand": 9, "operations": "+", "split": "train"},
            },
            "engine": {
                "class_path": "rlkit.engines.hf.HFEngine",
                "init_args": {"max_new_tokens": workload["tokens"], "temperature": 1.0},
            },
            "rewards": [{"class_path": "rlkit.rewards.ExactAnswer"}],
            "prompts_per_step": workload["prompts"],
            "samples_per_prompt": workload["samples"],
            "max_prompt_length": 16,
        },
    }


# ---- one run, in a subprocess whose sys.path starts with the checkout under test ----


def worker(config_path: str, result_path: str) -> None:
    """Run ``rlkit fit`` on W1 and write each step's timings and its rollout's layout to ``result_path``.

    Works with any rlkit version that logs ``time/<phase>`` (or ``time/<phase>_s``) to
    ``trainer.callback_metrics``; a version whose weight push lives in a callback exposing ``last_push_s``
    (``WeightSync``) has its sync time read there.
    """
    torch.set_num_threads(1)
    import lightning.pytorch as pl

    import rlkit
    from rlkit.cli import build_cli

    rows, batches = [], []
    generate_cpu = []

    class StepTimer(pl.Callback):
        # A step runs from the end of the previous training step to the end of this one: the rollout's
        # generation (done while Lightning fetches the batch), collation, the training step, the weight
        # push and Lightning's own work. This callback runs after the module's own (WeightSync's push).
        last_end = last_cpu = None

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            now, cpu = time.perf_counter(), time.process_time()
            times = {}
            for key, value in trainer.callback_metrics.items():
                if key.startswith("time/"):
                    times[key[5:].removesuffix("_s")] = float(value)
            pushes = [cb.last_push_s for cb in trainer.callbacks if hasattr(cb, "last_push_s")]
            if pushes:
                times["sync"] = pushes[0]
            if self.last_end is not None:
                mask = batch.attention_mask
                rows.append(
                    {
                        **times,
                        "wall": now - self.last_end,
                        "cpu": cpu - self.last_cpu,
                        "generate_cpu": generate_cpu[-1],
                        "completion_tokens": float(batch.completion_mask.sum()),
                        "rows": len(batch.completion_mask),
                        "real_tokens": float(mask.sum()),
                        "positions": float(mask.numel()),
                        "padding_trained": float(trainer.callback_metrics.get("perf/padding_fraction", float("nan"))),
                    }
                )
                batches.append((batch.input_ids.clone(), batch.attention_mask.clone()))
            # the callback's own copies are not charged to the next step
            self.last_end, self.last_cpu = time.perf_counter(), time.process_time()

    cli = build_cli([f"--config={config_path}"], run=False)
    engine = cli.datamodule.engine
    generate = engine.generate

    def timed_generate(*args, **kwargs):
        start = time.process_time()
        result = generate(*args, **kwargs)
        generate_cpu.append(time.process_time() - start)
        return result

    engine.generate = timed_generate
    own_callbacks = cli.model.configure_callbacks
    cli.model.configure_callbacks = lambda: [*own_callbacks(), StepTimer()]  # after the module's callbacks
    cli.trainer.fit(cli.model, cli.datamodule)
    torch.save({"rows": rows, "batches": batches, "rlkit": rlkit.__file__}, result_path)


def run_once(repo: Path, checkpoint: Path, workload: dict, steps: int, model_args: dict, workdir: Path) -> dict:
    """One W1 run of the checkout ``repo`` in a fresh process; returns its per-step rows and rollouts."""
    config = workdir / "w1.json"  # JSON is YAML
    nested = (repo / "rlkit" / "spine" / "settings.py").exists()  # the typed spine's option layout
    config.write_text(json.dumps(fit_config(str(checkpoint), workload, steps, model_args, nested)))
    result = workdir / "result.pt"
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", str(config), str(result)]
    done = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the run of {repo} failed:\n{done.stderr[-4000:]}")
    out = torch.load(result, weights_only=False)
    if Path(out["rlkit"]).resolve().parents[1] != repo.resolve():
        raise RuntimeError(f"the run imported rlkit from {out['rlkit']}, not from {repo}")
    return out


# ---- the physical limit: one forward+backward over the real tokens alone ----


def packed_forward_backward_seconds(
    checkpoint: Path, batches: list, row_tokens: int = 256
) -> list[tuple[float, float]]:
    """``(wall, CPU)`` seconds of one forward+backward of the policy over each rollout's real tokens alone.

    The tokens are packed without padding (:func:`rlkit.data.packing.pack_sequences`, exact attention);
    the loss is the sum of the real tokens' log-probs: the work of a policy-gradient update without the
    optimizer step (AdamW on 2.6M parameters adds a few ms).
    """
    from rlkit.components.logprobs import token_log_probs
    from rlkit.data.packing import pack_sequences
    from rlkit.models import load_policy

    model = load_policy(checkpoint).train()
    seconds = []
    for input_ids, attention_mask in batches:
        start, cpu = time.perf_counter(), time.process_time()
        packing = pack_sequences(input_ids, attention_mask, row_tokens)
        logits = model(input_ids=packing.input_ids, position_ids=packing.position_ids, use_cache=False).logits
        logprobs = packing.to_padded(token_log_probs(logits[:, :-1], packing.input_ids[:, 1:]))  # [N, S]
        logprobs.sum().backward()
        seconds.append((time.perf_counter() - start, time.process_time() - cpu))
        model.zero_grad(set_to_none=True)
    return seconds


def summarise(run: dict, limit_fb: list[tuple[float, float]]) -> dict:
    rows = run["rows"]
    steps = rows[FIRST_STEP - 2 :]  # rows[k] is step k + 2 (step 1 has no start time)
    fb = limit_fb[FIRST_STEP - 2 :]
    med = lambda key: statistics.median(r.get(key, 0.0) for r in steps)  # noqa: E731
    out = {phase: med(phase) for phase in PHASES}
    out["step"] = med("wall")
    out["other"] = statistics.median(r["wall"] - sum(r.get(p, 0.0) for p in PHASES) for r in steps)
    out["step_cpu"] = med("cpu")
    out["generate_cpu"] = med("generate_cpu")
    out["rollout_tok_s"] = statistics.median(r["completion_tokens"] / r["generate"] for r in steps)
    out["trainer_tok_s"] = statistics.median(r["real_tokens"] / (r["logprob"] + r["update"]) for r in steps)
    out["padding"] = statistics.median(1 - r["real_tokens"] / r["positions"] for r in steps)
    out["padding_trained"] = statistics.median(r["padding_trained"] for r in steps)
    out["completion_len"] = statistics.mean(r["completion_tokens"] / r["rows"] for r in steps)
    out["forward_backward"] = statistics.median(wall for wall, _ in fb)
    out["forward_backward_cpu"] = statistics.median(cpu for _, cpu in fb)
    out["limit"] = out["generate"] + out["forward_backward"]
    out["vs_limit"] = out["step"] / out["limit"]
    out["limit_cpu"] = out["generate_cpu"] + out["forward_backward_cpu"]
    out["vs_limit_cpu"] = out["step_cpu"] / out["limit_cpu"]
    out["steps"] = len(steps)
    return out


WALL = (
    ("step", "step s", "{:8.3f}"),
    ("generate", "gen", "{:7.3f}"),
    ("score", "score", "{:6.3f}"),
    ("logprob", "logprob", "{:8.3f}"),
    ("update", "update", "{:7.3f}"),
    ("sync", "sync", "{:6.3f}"),
    ("other", "other", "{:6.3f}"),
    ("limit", "limit s", "{:8.3f}"),
    ("vs_limit", "x limit", "{:8.2f}"),
)
CPU = (
    ("step_cpu", "step CPU s", "{:11.3f}"),
    ("generate_cpu", "gen CPU", "{:8.3f}"),
    ("limit_cpu", "limit CPU", "{:10.3f}"),
    ("vs_limit_cpu", "x limit", "{:8.2f}"),
    ("rollout_tok_s", "roll tok/s", "{:11.0f}"),
    ("trainer_tok_s", "train tok/s", "{:12.0f}"),
    ("padding", "pad", "{:5.2f}"),
    ("completion_len", "len", "{:5.1f}"),
)


def table(results: dict[str, dict], columns) -> str:
    head = f"{'':10}" + "".join(f"{title:>{len(fmt.format(0))}}" for _, title, fmt in columns)
    lines = [head]
    for name, r in results.items():
        lines.append(f"{name:10}" + "".join(fmt.format(r[key]) for key, _, fmt in columns))
    return "\n".join(lines)


class LoadSampler:
    """Samples the 1-minute load average every ``period`` seconds in a thread."""

    def __init__(self, period: float = 2.0) -> None:
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period,), daemon=True)

    def _run(self, period: float) -> None:
        while not self._stop.is_set():
            self.samples.append(os.getloadavg()[0])
            self._stop.wait(period)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def add_run_options(parser: argparse.ArgumentParser, set_help: str) -> None:
    """``--steps`` and ``--set KEY=JSON`` (repeatable), shared with ``trl_w1.py``."""
    parser.add_argument("--steps", type=int, default=20, help=f"optimizer steps per run (> {FIRST_STEP})")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help=f"{set_help}, e.g. --set micro_batch_tokens=1024",
    )


def model_overrides(parser: argparse.ArgumentParser, options: argparse.Namespace) -> dict:
    """Check ``--steps`` and return the ``--set`` model init args, values parsed as JSON."""
    if options.steps <= FIRST_STEP:
        parser.error(f"--steps must be > {FIRST_STEP}: the figures are medians of steps {FIRST_STEP}-STEPS")
    return {key: json.loads(value) for key, value in (item.split("=", 1) for item in options.set)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", type=Path, help="another rlkit checkout to run side by side, alternating")
    parser.add_argument("--runs", type=int, default=1, help="runs per checkout (median of their medians)")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="w1")
    add_run_options(parser, "an extra model init arg for THIS checkout's runs only")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.worker:
        worker(*options.worker)
        return
    torch.set_num_threads(1)
    extra = model_overrides(parser, options)
    sides = [("old", options.old.resolve(), {})] if options.old else []
    sides.append(("new", ROOT, extra))

    base = Path(tempfile.mkdtemp(prefix="rlkit-w1-"))
    workload = WORKLOADS[options.workload]
    checkpoint = build_checkpoint(base / options.workload, workload)
    print(f"{options.workload} checkpoint: {checkpoint} ({sum(p.numel() for p in _params(checkpoint)):,} parameters)")
    per_side: dict[str, list[dict]] = {name: [] for name, _, _ in sides}
    with LoadSampler() as load:
        for run in range(options.runs):
            for name, repo, model_args in sides:
                workdir = Path(tempfile.mkdtemp(prefix=f"{name}-{run}-", dir=base))
                out = run_once(repo, checkpoint, workload, options.steps, model_args, workdir)
                summary = summarise(out, packed_forward_backward_seconds(checkpoint, out["batches"]))
                per_side[name].append(summary)
                print(
                    f"run {run + 1} {name} ({repo}): step {summary['step']:.3f} s, CPU {summary['step_cpu']:.3f} s, "
                    f"load {os.getloadavg()[0]:.2f}",
                    flush=True,
                )
    print(
        f"\n{options.workload}, medians of steps {FIRST_STEP}-{options.steps} per run; "
        + ("median over runs" if options.runs > 1 else "one run")
    )
    results = {
        name: {key: statistics.median(s[key] for s in runs) for key in runs[0]} for name, runs in per_side.items()
    }
    print("wall clock (time/* phases as rlkit logs them; tokens/s from these):")
    print(table(results, WALL))
    print("CPU time of the run's process (robust to other processes sharing the cores):")
    print(table(results, CPU))
    new = results["new"]
    if new["padding_trained"] == new["padding_trained"]:
        print(f"new: padding fraction of the positions the update computes: {new['padding_trained']:.2f}")
    print(
        "limit = generation + one forward+backward over the real tokens alone (packed, no padding): "
        + ", ".join(f"{name} {r['generate']:.3f} + {r['forward_backward']:.3f} s" for name, r in results.items())
    )
    if options.old:
        old = results["old"]
        per_run = lambda key: {n: [round(r[key], 3) for r in runs] for n, runs in per_side.items()}  # noqa: E731
        print(
            f"new / old whole step: wall {new['step'] / old['step']:.2f}, CPU {new['step_cpu'] / old['step_cpu']:.2f} "
            f"(per-run wall {per_run('step')}; CPU {per_run('step_cpu')})"
        )
    samples = load.samples
    print(
        f"load average (1 min) during the runs: mean {statistics.mean(samples):.2f}, "
        f"min {min(samples):.2f}, max {max(samples):.2f} on {os.cpu_count()} cores"
    )


def _params(checkpoint: Path):
    from rlkit.models import load_policy

    return load_policy(checkpoint).parameters()


if __name__ == "__main__":
    main()
