"""Memory per rank of one FSDP2 training step, 1 process vs N ranks (CPU, gloo), for a real-shaped preset.

    python benchmarks/memory.py                          # qwen2-test, 1 and 2 ranks
    python benchmarks/memory.py --preset qwen2-small --ranks 1 2

For each world size every rank loads the preset (``rlkit model build``'s checkpoint), is sharded as
``rlkit.spine.sharding`` shards a policy (each decoder layer, then the root; one process: unsharded), runs one
forward/backward of a batch and an AdamW step, then a weight push gathered tensor by tensor. It prints, per
rank, the bytes this rank holds of the parameters, gradients and optimizer states (expected: 1/N of the
whole), the largest tensor the push holds whole at once, and the process's peak resident memory (which also
holds Python, torch and the activations, and so does not shrink by 1/N on a model this small).
"""

from __future__ import annotations

import argparse
import os
import resource
import socket


def _bytes(tensors) -> int:
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def _quiet() -> None:
    from transformers.utils import logging

    logging.disable_progress_bar()


def _rank(rank: int, world: int, port: int, checkpoint: str, rows: int, length: int, queue) -> None:
    import torch
    import torch.distributed as dist

    from rlkit.models import load_policy
    from rlkit.spine.sharding import full_tensors, shard_module

    torch.set_num_threads(1)
    _quiet()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = load_policy(checkpoint).train()
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        shard_module(model, init_device_mesh("cpu", (world,)), None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (rows, length), generator=torch.Generator().manual_seed(rank))
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    optimizer.step()
    largest = 0
    for _, tensor in full_tensors(model):  # what WeightSync hands the engine: one whole tensor at a time
        largest = max(largest, tensor.numel() * tensor.element_size())
    states = [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v) and v.dim()]
    queue.put(
        {
            "rank": rank,
            "parameters": _bytes(model.parameters()),
            "gradients": _bytes(p.grad for p in model.parameters() if p.grad is not None),
            "optimizer": _bytes(states),
            "push_largest": largest,
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }
    )
    dist.destroy_process_group()


def measure(world: int, checkpoint: str, rows: int, length: int) -> list[dict]:
    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = mp.get_context("spawn")
    queue = context.Queue()
    processes = [
        context.Process(target=_rank, args=(r, world, port, checkpoint, rows, length, queue)) for r in range(world)
    ]
    for p in processes:
        p.start()
    results = [queue.get() for _ in processes]
    for p in processes:
        p.join()
    return sorted(results, key=lambda r: r["rank"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen2-test")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rows", type=int, default=4, help="sequences per rank in the step")
    parser.add_argument("--length", type=int, default=64, help="tokens per sequence")
    args = parser.parse_args()
    _quiet()
    from rlkit.model_presets import preset_checkpoint

    checkpoint = str(preset_checkpoint(args.preset))
    mib = 1024**2
    print(f"{args.preset}: {args.rows} x {args.length} tokens per rank, AdamW, fp32, CPU (gloo)")
    columns = ("ranks", "rank", "params MiB", "grads MiB", "adam MiB", "push max MiB", "peak RSS MiB")
    print(" ".join(f"{c:>{max(len(c), 5)}}" for c in columns))
    base = None
    for world in args.ranks:
        for r in measure(world, checkpoint, args.rows, args.length):
            base = base or r
            share = r["parameters"] / base["parameters"]
            print(
                f"{world:>5} {r['rank']:>5} {r['parameters'] / mib:>10.2f} {r['gradients'] / mib:>9.2f} "
                f"{r['optimizer'] / mib:>8.2f} {r['push_largest'] / mib:>12.2f} {r['peak_rss'] / mib:>12.0f}"
                f"   (states {share:.2f} of one process's; expected {1 / world:.2f})"
            )


if __name__ == "__main__":
    main()
