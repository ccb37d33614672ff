"""vLLM's own tensor parallelism for the engine: ``VLLMEngine(tensor_parallel_size=...)`` reaches vLLM, and a
size vLLM cannot use (more GPUs than are visible, heads it cannot split) is refused in one line before it
starts. Pure checks: no GPU and no vLLM needed."""

from __future__ import annotations

import json
import shutil
import sys
import types

import pytest

from rlkit.engines import vllm as vllm_engine
from rlkit.engines.vllm import VLLMEngine, check_tensor_parallel
from rlkit.errors import ConfigError

#: Qwen2.5-0.5B's attention: 14 query heads, 2 key/value heads (grouped-query attention)
QWEN_05B = {"num_attention_heads": 14, "num_key_value_heads": 2}


@pytest.mark.parametrize("size", [1, 2, 14])  # 7 splits the 14 query heads, not the 2 key/value heads
def test_sizes_that_split_the_heads_pass(size):
    check_tensor_parallel(size, QWEN_05B, visible_gpus=16)


@pytest.mark.parametrize(
    "size, config, gpus, words",
    [
        (4, QWEN_05B, 8, r"=4 cannot split the model's 14 attention heads and 2 key/value heads.*one of 1, 2, 14"),
        # 8 query heads split over 4, but 6 key/value heads neither divide by 4 nor divide 4
        (4, {"num_attention_heads": 24, "num_key_value_heads": 6}, 8, r"one of 1, 2, 3, 6, 12, 24"),
        (4, QWEN_05B, 2, r"=4 needs 4 GPUs but 2 are visible: set it to 2 or fewer"),
        (2, {"text_config": {"num_attention_heads": 3}}, None, r"3 attention heads and 3 key/value.*one of 1, 3"),
    ],
)
def test_sizes_vllm_cannot_use_are_named_with_the_fix(size, config, gpus, words):
    with pytest.raises(ConfigError, match=words) as error:
        check_tensor_parallel(size, config, gpus)
    assert "\n" not in str(error.value) and "data.engine.init_args.tensor_parallel_size" in str(error.value)


def test_cpu_has_no_gpu_limit():
    check_tensor_parallel(2, {"num_attention_heads": 2}, visible_gpus=None)  # vLLM's CPU workers are processes


def test_a_size_below_one_is_refused():
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        VLLMEngine(tensor_parallel_size=0)


def test_the_size_reaches_vllm_after_the_check(tmp_path, monkeypatch):
    """A stand-in for vllm records what ``start`` passes to ``vllm.LLM``; an unsplittable size never gets there."""
    checkpoint = tmp_path / "two-heads"  # only what start reads before vLLM: the config (no tokenizer loaded)
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"num_attention_heads": 2, "num_key_value_heads": 2}))
    monkeypatch.setattr("rlkit.models.load_tokenizer", lambda *args, **kwargs: None)
    calls = []
    fake = types.ModuleType("vllm")
    fake.LLM = lambda **kwargs: calls.append(kwargs)
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = types.SimpleNamespace(
        is_cpu=lambda: True, is_sleep_mode_available=lambda: False, device_name="cpu"
    )
    logger = types.ModuleType("vllm.logger")  # what start reads of vLLM's logging (a minimal dictConfig)
    logger.DEFAULT_LOGGING_CONFIG = {
        "version": 1,
        "formatters": {"vllm": {}},
        "handlers": {"vllm": {"class": "logging.NullHandler", "level": "INFO"}},
        "loggers": {"vllm": {"level": "INFO"}},
    }
    config = types.ModuleType("vllm.config")
    config.LoggingConfig = lambda **kwargs: kwargs
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    monkeypatch.setitem(sys.modules, "vllm.logger", logger)
    monkeypatch.setitem(sys.modules, "vllm.config", config)
    monkeypatch.setattr(vllm_engine, "_import_vllm", lambda: fake)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)  # as on CPU: no GPU count applies

    for size in (2, 1):
        engine = VLLMEngine(tensor_parallel_size=size)
        engine.start(str(checkpoint))
        shutil.rmtree(engine._weights_dir)  # the push folder start made (close would shut the stand-in down)
        assert calls[-1]["tensor_parallel_size"] == size
    with pytest.raises(ConfigError, match="heads"):
        VLLMEngine(tensor_parallel_size=3).start(str(checkpoint))
    assert len(calls) == 2
