"""Write a stream of named tensors as a Hugging Face sharded safetensors checkpoint, one bucket in memory.

The layout is the one ``save_pretrained`` writes for a large model and vLLM's loader reads
(``DefaultModelLoader._prepare_weights``: every ``*.safetensors`` of the folder, filtered by
``model.safetensors.index.json`` when present, a listed file that is missing being an error):
``model-00001-of-0000n.safetensors`` ... and an index whose ``weight_map`` names each tensor's file. The number
of shards is known only when the stream ends, so each bucket is written under a name the loader does not glob
(``*.part``) and renamed once the stream ends, then the index is written.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True)
class ShardedWrite:
    """What :func:`write_shards` wrote: the tensor names in order, the shard files, the largest bucket's bytes."""

    names: list[str]
    files: list[Path]
    largest_bucket_bytes: int


def clear_shards(directory: Path) -> None:
    """Remove a previous write's shards, unfinished parts and index from ``directory``."""
    for pattern in ("*.safetensors", "*.safetensors.part", INDEX_NAME):
        for file in directory.glob(pattern):
            file.unlink()


def write_shards(
    named_tensors: Iterable[tuple[str, Tensor]], directory: Path, dtype: torch.dtype, bucket_bytes: int
) -> ShardedWrite:
    """Write ``named_tensors`` into ``directory`` as consecutive shards of at most ``bucket_bytes`` each (a
    tensor larger than that is a shard of its own), each tensor cast to ``dtype`` on the CPU as it arrives.

    Only the bucket being filled is held: it is written and freed before the next tensor is copied, so with an
    iterator that gathers one tensor at a time (:func:`rlkit.spine.sharding.full_tensors`) the extra memory is
    about one bucket plus one tensor. A previous write's files are removed first. Writes nothing (and returns
    no names) for an empty stream.
    """
    from safetensors.torch import save_file

    clear_shards(directory)
    names: list[str] = []
    parts: list[tuple[Path, list[str]]] = []
    bucket: dict[str, Tensor] = {}
    held = largest = total_bytes = 0

    def flush() -> None:
        nonlocal bucket, held, largest, total_bytes
        part = directory / f"model-{len(parts) + 1:05d}.safetensors.part"
        save_file(bucket, str(part))
        parts.append((part, list(bucket)))
        largest, total_bytes = max(largest, held), total_bytes + held
        bucket, held = {}, 0

    for name, tensor in named_tensors:
        # an own contiguous CPU copy: safetensors refuses tensors that share storage (tied weights)
        copy = tensor.detach().to(device="cpu", dtype=dtype, copy=True).contiguous()
        size = copy.numel() * copy.element_size()
        if bucket and held + size > bucket_bytes:
            flush()
        bucket[name] = copy
        held += size
        names.append(name)
    if bucket:
        flush()
    total = len(parts)
    files, weight_map = [], {}
    for k, (part, members) in enumerate(parts, start=1):
        file = directory / f"model-{k:05d}-of-{total:05d}.safetensors"
        part.rename(file)
        files.append(file)
        weight_map.update(dict.fromkeys(members, file.name))
    if files:
        index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}  # tensor bytes, as HF writes
        (directory / INDEX_NAME).write_text(json.dumps(index, indent=2), encoding="utf-8")
    return ShardedWrite(names, files, largest)
