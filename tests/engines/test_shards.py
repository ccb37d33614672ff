"""write_shards: a stream of tensors as a Hugging Face sharded safetensors checkpoint, one bucket at a time."""

import json

import pytest
import torch
from safetensors.torch import load_file

from rlkit.engines.shards import INDEX_NAME, write_shards


def stream(sizes):
    """Tensors of ``sizes`` fp32 elements (4 bytes each), the last one a view sharing the first's storage."""
    generator = torch.Generator().manual_seed(0)
    tensors = [(f"t{i}", torch.randn(n, generator=generator)) for i, n in enumerate(sizes)]
    return [*tensors, ("tied", tensors[0][1])]


def read_back(directory):
    index = json.loads((directory / INDEX_NAME).read_text())
    loaded = {}
    for file in sorted(set(index["weight_map"].values())):
        part = load_file(directory / file)
        assert all(index["weight_map"][name] == file for name in part)  # the index names each tensor's file
        loaded.update(part)
    return index, loaded


def test_buckets_become_consecutive_shards_with_an_index(tmp_path):
    tensors = stream([10, 10, 30, 5, 5])  # 40, 40, 120, 20, 20 and 40 (tied) bytes
    written = write_shards(tensors, tmp_path, torch.float32, bucket_bytes=80)
    # 80-byte buckets in arrival order: t0+t1 | t2 (larger than a bucket: alone) | t3+t4+tied
    assert [f.name for f in written.files] == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    assert written.largest_bucket_bytes == 120 and written.names == [name for name, _ in tensors]
    index, loaded = read_back(tmp_path)
    assert index["metadata"]["total_size"] == 4 * (10 + 10 + 30 + 5 + 5 + 10)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([INDEX_NAME, *(f.name for f in written.files)])
    for name, tensor in tensors:
        torch.testing.assert_close(loaded[name], tensor, atol=0, rtol=0)


def test_one_large_bucket_is_one_shard_and_a_new_write_replaces_the_old(tmp_path):
    write_shards(stream([10, 10, 30]), tmp_path, torch.float32, bucket_bytes=16)  # 4 shards
    written = write_shards(stream([10, 10]), tmp_path, torch.bfloat16, bucket_bytes=2**20)
    assert [f.name for f in written.files] == ["model-00001-of-00001.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([INDEX_NAME, written.files[0].name])
    _, loaded = read_back(tmp_path)
    assert set(loaded) == {"t0", "t1", "tied"} and loaded["t0"].dtype == torch.bfloat16
    assert written.largest_bucket_bytes == 2 * (10 + 10 + 10)


def test_an_empty_stream_writes_nothing(tmp_path):
    write_shards(stream([4]), tmp_path, torch.float32, bucket_bytes=64)
    written = write_shards([], tmp_path, torch.float32, bucket_bytes=64)
    assert written.names == [] and written.files == [] and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("bucket_bytes", [1, 64, 2**20])
def test_a_write_holds_at_most_one_bucket_or_one_tensor(tmp_path, bucket_bytes):
    sizes = [7, 33, 2, 2, 50, 1]
    written = write_shards(stream(sizes), tmp_path, torch.float32, bucket_bytes=bucket_bytes)
    assert written.largest_bucket_bytes <= max(bucket_bytes, 4 * max(sizes))
    assert len(read_back(tmp_path)[1]) == len(sizes) + 1
