"""Rollout throughput of HFEngine vs VLLMEngine on the same workload, and their weight-push times.

    OMP_NUM_THREADS=1 python benchmarks/engines.py                   # embedded checkpoint, 16 x 8, 8 tokens
    OMP_NUM_THREADS=1 python benchmarks/engines.py --random-weights  # completions run to max_new_tokens
    python benchmarks/engines.py --checkpoint /path/to/model --dtype bfloat16 --max-new-tokens 128

Prints medians (and min-max) over ``--repeats`` timed calls after one warm-up call. tokens/s counts the
completion tokens actually produced (EOS included): with the warmed tiny model most completions stop after
2-3 tokens, so also read rollouts/s. The weight push is the full state dict each time.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time

import torch


def _median_range(values: list[float]) -> str:
    return f"{statistics.median(values):9.1f} ({min(values):.1f}-{max(values):.1f})"


def bench(engine, checkpoint: str, prompts: list[list[int]], samples: int, repeats: int) -> dict[str, list[float]]:
    from rlkit.models import load_policy

    start = time.perf_counter()
    engine.start(checkpoint)
    started = time.perf_counter() - start
    engine.generate(prompts, samples, seed=0)  # warm-up: first-call allocations and kernel selection
    tokens_per_s, rollouts_per_s, call_ms = [], [], []
    for repeat in range(repeats):
        start = time.perf_counter()
        result = engine.generate(prompts, samples, seed=1 + repeat)
        elapsed = time.perf_counter() - start
        produced = sum(len(g.token_ids) for row in result for g in row)
        tokens_per_s.append(produced / elapsed)
        rollouts_per_s.append(len(prompts) * samples / elapsed)
        call_ms.append(1000 * elapsed)
    state = load_policy(checkpoint).state_dict()
    push_ms = []
    for _ in range(repeats):
        start = time.perf_counter()
        engine.update_weights(state.items())
        push_ms.append(1000 * (time.perf_counter() - start))
    engine.close()
    return {
        "tokens/s": tokens_per_s,
        "rollouts/s": rollouts_per_s,
        "generate ms": call_ms,
        "push ms": push_ms,
        "start s": [started],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", help="checkpoint directory (default: the embedded warmed tiny model)")
    parser.add_argument("--random-weights", action="store_true", help="use the random-init tiny model")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--engines", default="hf,vllm", help="comma-separated subset of hf,vllm")
    args = parser.parse_args()

    from rlkit.embedded.arithmetic import Arithmetic
    from rlkit.embedded.cache import embedded_checkpoint
    from rlkit.embedded.model import build_tiny_checkpoint
    from rlkit.models import load_tokenizer

    if args.checkpoint:
        checkpoint = args.checkpoint
    elif args.random_weights:
        scratch = tempfile.mkdtemp(prefix="rlkit-bench-")
        checkpoint = str(build_tiny_checkpoint(scratch))
    else:
        checkpoint = str(embedded_checkpoint())
    tokenizer = load_tokenizer(checkpoint)
    source = Arithmetic(num_prompts=args.prompts, seed=0)
    prompts = [tokenizer(source[i].prompt)["input_ids"] for i in range(len(source))]

    results = {}
    for name in args.engines.split(","):
        if name == "hf":
            from rlkit.engines.hf import HFEngine

            engine = HFEngine(max_new_tokens=args.max_new_tokens, dtype=args.dtype)
        elif name == "vllm":
            from rlkit.engines.vllm import VLLMEngine

            engine = VLLMEngine(max_new_tokens=args.max_new_tokens, dtype=args.dtype)
        else:
            raise SystemExit(f"--engines: unknown engine {name!r}; choose from hf, vllm")
        results[name] = bench(engine, checkpoint, prompts, args.samples, args.repeats)
    if args.random_weights and not args.checkpoint:
        shutil.rmtree(scratch, ignore_errors=True)

    print(
        f"\ncheckpoint {checkpoint}; {args.prompts} prompts x {args.samples} samples, max_new_tokens "
        f"{args.max_new_tokens}, {args.dtype}, torch threads {torch.get_num_threads()}; median (min-max) of "
        f"{args.repeats}"
    )
    print(f"{'':14}" + "".join(f"{name:>26}" for name in results))
    for metric in next(iter(results.values())):
        print(f"{metric:14}" + "".join(f"{_median_range(r[metric]):>26}" for r in results.values()))


if __name__ == "__main__":  # required: vLLM's worker processes re-import this module
    main()
