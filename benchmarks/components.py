"""Figures for rlkit's components (prints, never asserts).

    python benchmarks/components.py                    # CPU
    python benchmarks/components.py --device cuda      # on a GPU machine

1. Advantages for 65,536 completions in groups of 16: ``GroupNorm`` (vectorised) against a
   verl-style Python loop (index lists per group id, then mean/std per group); median of repeats.
2. ``token_log_probs`` (chunked, custom backward) against ``log_softmax(logits).gather(ids)`` at
   V=151,936, T=4,096, forward + backward: time and peak memory. Each variant runs in a fresh child
   process; on CPU its peak is the child's ``ru_maxrss`` (tracemalloc does not see torch's
   allocations), on CUDA ``torch.cuda.max_memory_allocated``. "extra" is the peak above what the
   logits (and the ids) already hold.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch


def _median_time(fn, repeats: int, sync=lambda: None) -> float:
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def advantage_benchmark(device: str, repeats: int, num: int = 65_536, group: int = 16, length: int = 128) -> None:
    from rlkit.components.advantage import AdvantageInputs, GroupNorm

    gen = torch.Generator().manual_seed(0)
    group_ids = torch.arange(num // group).repeat_interleave(group)[torch.randperm(num, generator=gen)]  # [N]
    scores = torch.randint(0, 2, (num,), generator=gen).float()  # [N] 0/1 outcome rewards
    lengths = torch.randint(1, length + 1, (num,), generator=gen)  # [N]
    mask = (torch.arange(length) < lengths[:, None]).float()  # [N, T]
    inputs = AdvantageInputs.from_scores(scores.to(device), mask.to(device), group_ids.to(device))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    estimator = GroupNorm()
    vectorised, _ = estimator(inputs)

    def loop() -> torch.Tensor:
        # the per-sample / per-group Python loop of verl's original GRPO estimator, on the same data
        seq_scores = inputs.token_rewards.sum(-1)  # [N]
        members: dict[int, list[int]] = {}
        for i, g in enumerate(inputs.group_ids.tolist()):
            members.setdefault(g, []).append(i)
        normed = torch.empty_like(seq_scores)  # [N]
        for idx in members.values():
            idx_t = torch.tensor(idx, device=seq_scores.device)
            s = seq_scores[idx_t]
            if len(idx) > 1:
                normed[idx_t] = (s - s.mean()) / (s.std() + 1e-6)
            else:
                normed[idx_t] = s
        return normed.unsqueeze(-1) * inputs.mask  # [N, T]

    looped = loop()
    t_vec = _median_time(lambda: estimator(inputs), repeats, sync)
    t_loop = _median_time(loop, repeats, sync)
    print(
        f"[advantage] GroupNorm, N={num} completions in groups of {group} (shuffled ids), T={length}, "
        f"device={device}, torch threads={torch.get_num_threads()}"
    )
    print(f"  vectorised GroupNorm : {t_vec * 1e3:9.2f} ms (median of {repeats})")
    print(f"  Python loop per group: {t_loop * 1e3:9.2f} ms (median of {repeats})")
    print(
        f"  speed-up             : {t_loop / t_vec:9.1f}x"
        f"   (max |difference| {float((vectorised - looped).abs().max()):.2e})"
    )


def _child(variant: str, n: int, t: int, v: int, dtype: str, device: str, chunk_rows: int, repeats: int) -> None:
    """Runs in a fresh interpreter: one variant, prints one JSON line."""
    from rlkit.components.logprobs import token_log_probs

    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    gen = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(n, t, v, generator=gen, device=device, dtype=getattr(torch, dtype)).requires_grad_()
    ids = torch.randint(0, v, (n, t), generator=gen, device=device)
    weights = torch.randn(n, t, generator=gen, device=device)

    def full():
        return torch.log_softmax(logits.float(), dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)

    def chunked():
        return token_log_probs(logits, ids, chunk_rows=chunk_rows)

    fn = {"full": full, "chunked": chunked}[variant]

    def step():
        logits.grad = None
        (fn() * weights).sum().backward()

    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # bytes (Linux reports KiB)
    seconds = _median_time(step, repeats, sync)
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"variant": variant, "seconds": seconds, "base": base, "peak": peak}))


def logprob_benchmark(args) -> None:
    gib = 2**30
    logits_bytes = args.n * args.t * args.v * torch.finfo(getattr(torch, args.dtype)).bits // 8
    print(
        f"[token_log_probs] N={args.n}, T={args.t}, V={args.v}, {args.dtype} logits "
        f"({logits_bytes / gib:.2f} GiB), forward+backward, chunk_rows={args.chunk_rows}, "
        f"device={args.device}, "
        f"torch threads={torch.get_num_threads()}, median of {args.repeats}"
    )
    what = "torch.cuda.max_memory_allocated" if args.device == "cuda" else "peak RSS of a fresh process"
    results = {}
    for variant in ("chunked", "full"):
        cmd = [
            sys.executable, __file__, "--child", variant,
            "--n", str(args.n), "--t", str(args.t), "--v", str(args.v),
            "--dtype", args.dtype, "--device", args.device, "--chunk-rows", str(args.chunk_rows),
            "--repeats", str(args.repeats),
        ] + (["--threads", str(args.threads)] if args.threads else [])  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"  {variant:8s}: failed (exit {proc.returncode}): {proc.stderr.strip()[-300:]}")
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        results[variant] = r
        print(
            f"  {variant:8s}: {r['seconds']:7.2f} s   peak {r['peak'] / gib:6.2f} GiB ({what}),"
            f" extra over logits+inputs {(r['peak'] - r['base']) / gib:6.2f} GiB"
        )
    if len(results) == 2:
        c, f = results["chunked"], results["full"]
        print(
            f"  full / chunked: time {f['seconds'] / c['seconds']:.2f}x, "
            f"extra memory {(f['peak'] - f['base']) / max(c['peak'] - c['base'], 1):.2f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--n", type=int, default=1, help="rows of the log-prob benchmark (1 fits a 24 GiB CPU box)")
    parser.add_argument("--t", type=int, default=4096)
    parser.add_argument("--v", type=int, default=151_936)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--chunk-rows", type=int, default=512)
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice); 1 on a busy box")
    parser.add_argument("--skip-advantage", action="store_true")
    parser.add_argument("--skip-logprobs", action="store_true")
    parser.add_argument("--child", choices=["chunked", "full"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        _child(args.child, args.n, args.t, args.v, args.dtype, args.device, args.chunk_rows, args.repeats)
        return
    if not args.skip_advantage:
        advantage_benchmark(args.device, args.repeats)
    if not args.skip_logprobs:
        logprob_benchmark(args)


if __name__ == "__main__":
    main()
