"""Models of real shape (rlkit.model_presets, rlkit.chat_tokenizer): shapes, tokenizer, template, builds, CLI."""

import json
import os
import subprocess
import sys
import unicodedata

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

import rlkit.model_presets
from rlkit.chat_tokenizer import CONTROL_TOKENS, MARKUP_TOKENS
from rlkit.cli import main as rlkit_main
from rlkit.errors import ConfigError
from rlkit.model_presets import (
    BPE_VOCAB_SIZE,
    PRESETS,
    ModelPreset,
    build_preset_checkpoint,
    get_preset,
    preset_checkpoint,
    shared_tokenizer,
)

TEXTS = [
    "3+5+7=3+5=8,8+7=15",
    "Hello,  world!\n\n\tTabs  and  spaces   ",
    " a leading space, don't 'quote' a . b",
    "naïve café — 中文 🙂 ∑x²",
    "def f(x):\n    return x  \n",
    "<think>\nhm\n</think>\\boxed{42}<|im_end|>",
    "e\u0301",  # not NFC: the tokenizer normalises it to "é", as Qwen2's does
]


@pytest.fixture(scope="module")
def qwen2():
    return preset_checkpoint("qwen2-test")  # built once per session (tests/conftest.py's fresh cache)


def test_parameter_counts_follow_the_formula():
    """qwen2-small by hand: embeddings 2 x 8320 x 512 = 8,519,680; a layer has q and o 2 x 512 x 512 =
    524,288, k and v 2 x 512 x 128 = 131,072, biases 512 + 2 x 128 = 768, SwiGLU 3 x 512 x 2816 = 4,325,376
    and norms 2 x 512: 4,982,528; 8 layers + final norm 512: 48,380,416."""
    assert PRESETS["qwen2-small"].num_parameters(8320) == 48_380_416
    tokenizer = shared_tokenizer()
    for preset in PRESETS.values():
        config = preset.config(tokenizer)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        assert sum(p.numel() for p in model.parameters()) == preset.num_parameters(config.vocab_size), preset.name
        assert preset.head_dim == 64 and preset.num_kv_heads < preset.num_heads  # vLLM CPU attention; GQA
        if preset.name.endswith("-small"):
            assert 20e6 <= preset.num_parameters(config.vocab_size) <= 100e6


def test_checkpoint_is_shaped_like_a_qwen2_release(qwen2):
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"):
        assert (qwen2 / name).is_file()
    config = json.loads((qwen2 / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["architectures"] == ["Qwen2ForCausalLM"]
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["hidden_size"]) == (4, 2, 256)
    assert config["tie_word_embeddings"] is False and config["rope_parameters"]["rope_theta"] == 1e6
    tokenizer = AutoTokenizer.from_pretrained(qwen2, local_files_only=True)
    assert config["vocab_size"] == 8320 > len(tokenizer) == BPE_VOCAB_SIZE + 9  # rows past the tokenizer
    generation = json.loads((qwen2 / "generation_config.json").read_text())
    ids = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert generation["eos_token_id"] == ids and generation["pad_token_id"] == ids[1] == config["bos_token_id"]
    with safe_open(str(qwen2 / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("lm_head.weight").shape == f.get_tensor("model.embed_tokens.weight").shape == (8320, 256)
        assert not torch.equal(f.get_tensor("lm_head.weight"), f.get_tensor("model.embed_tokens.weight"))
        for proj, width in (("q", 256), ("k", 128), ("v", 128)):  # k, v: 2 heads of 64
            assert f.get_tensor(f"model.layers.0.self_attn.{proj}_proj.weight").shape == (width, 256)
            bias = f.get_tensor(f"model.layers.0.self_attn.{proj}_proj.bias")
            assert bias.shape == (width,) and bias.abs().min() > 0  # random, not transformers' zeros
    model = AutoModelForCausalLM.from_pretrained(qwen2, local_files_only=True)
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.dtype == torch.float32


def test_tokenizer_round_trips_through_auto_tokenizer(qwen2):
    """transformers forces Qwen2Tokenizer for model type qwen2 and rebuilds its pipeline from the vocabulary
    and merges: the trained BPE was built with that pipeline, so both tokenise alike and decode exactly."""
    tokenizer = AutoTokenizer.from_pretrained(qwen2, local_files_only=True)
    raw = Tokenizer.from_file(str(qwen2 / "tokenizer.json"))
    assert type(tokenizer).__name__ == "Qwen2Tokenizer"
    for text in TEXTS:
        ids = tokenizer(text)["input_ids"]
        assert ids == raw.encode(text).ids
        assert tokenizer.decode(ids) == unicodedata.normalize("NFC", text)
    specials = [*CONTROL_TOKENS, *MARKUP_TOKENS]
    assert tokenizer.convert_tokens_to_ids(specials) == list(range(BPE_VOCAB_SIZE, BPE_VOCAB_SIZE + 9))
    assert (tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token) == ("<|im_end|>", "<|endoftext|>", None)
    assert tokenizer("12")["input_ids"] == tokenizer("1")["input_ids"] + tokenizer("2")["input_ids"]  # digit by digit
    ids = tokenizer("<tool_call>\n{}\n</tool_call><|im_end|>")["input_ids"]
    assert ids[0] == tokenizer.convert_tokens_to_ids("<tool_call>") and len(ids) == 6  # no BOS; each one token
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<tool_call>\n{}\n</tool_call>"  # markup stays
    assert len(tokenizer("Ada sees the red apple near the river.")["input_ids"]) < 15  # words merged


def test_chat_template_writes_chatml():
    tokenizer = shared_tokenizer()
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+3?"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "And 2+4?"},
    ]
    assert tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
        "<|im_start|>assistant\n5<|im_end|>\n<|im_start|>user\nAnd 2+4?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.apply_chat_template(chat[1:2], tokenize=False) == "<|im_start|>user\nWhat is 2+3?<|im_end|>\n"


def test_chat_template_writes_tools_calls_and_responses_as_qwen2_5():
    tokenizer = shared_tokenizer()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    tools = [{"type": "function", "function": {"name": "inc", "description": "Add one.", "parameters": schema}}]
    call = {"type": "function", "function": {"name": "inc", "arguments": {"a": 2}}}
    chat = [
        {"role": "user", "content": "2+1?"},
        {"role": "assistant", "content": "", "tool_calls": [call, call]},
        {"role": "tool", "content": "3"},
        {"role": "tool", "content": "3"},
        {"role": "assistant", "content": "3"},
    ]
    tool_json = json.dumps(tools[0])
    assert tokenizer.apply_chat_template(chat, tools=tools, tokenize=False) == (
        "<|im_start|>system\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        f"{tool_json}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
        "<args-json-object>}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n2+1?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "inc", "arguments": {"a": 2}}\n</tool_call>\n'
        '<tool_call>\n{"name": "inc", "arguments": {"a": 2}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n3\n</tool_response>\n<tool_response>\n3\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n3<|im_end|>\n"
    )


def test_builds_are_deterministic_and_share_one_tokenizer(qwen2, tmp_path):
    """Same seed, same bytes (the cached build included); another seed moves the weights, not the
    tokenizer: every preset and seed speaks one vocabulary (a teacher and a student can pair up)."""
    a = build_preset_checkpoint("qwen2-test", tmp_path / "a", seed=0)
    b = build_preset_checkpoint("qwen2-test", tmp_path / "b", seed=1)
    llama = build_preset_checkpoint("llama-test", tmp_path / "llama", seed=0)
    assert (a / "model.safetensors").read_bytes() == (qwen2 / "model.safetensors").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (b / "model.safetensors").read_bytes()
    for other in (b, llama):
        assert (other / "tokenizer.json").read_bytes() == (a / "tokenizer.json").read_bytes()


def test_the_cache_builds_on_the_cpu_under_any_default_device(qwen2, tmp_path):
    """A preset checkpoint loaded in Lightning's ``configure_model`` on a GPU is built under a CUDA default device;
    a meta one stands in for it: the same bytes as the plain build."""
    with torch.device("meta"):
        built = preset_checkpoint("qwen2-test", tmp_path)
    assert (built / "model.safetensors").read_bytes() == (qwen2 / "model.safetensors").read_bytes()


def test_llama_preset_loads_with_the_same_tokenizer(tmp_path):
    directory = build_preset_checkpoint("llama-test", tmp_path / "llama")
    model = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True)
    config = model.config
    assert type(model).__name__ == "LlamaForCausalLM" and not config.attention_bias and not config.tie_word_embeddings
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 64)
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    for text in TEXTS:
        assert tokenizer(text)["input_ids"] == shared_tokenizer()(text)["input_ids"]
    assert tokenizer.eos_token == "<|im_end|>"


def test_cache_builds_once_per_key(tmp_path, monkeypatch):
    first = preset_checkpoint("qwen2-test", tmp_path, seed=2)
    monkeypatch.setattr(rlkit.model_presets, "build_preset_checkpoint", lambda *a, **k: pytest.fail("rebuilt"))
    assert preset_checkpoint("qwen2-test", tmp_path, seed=2) == first
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no staging directory left behind
    with pytest.raises(pytest.fail.Exception, match="rebuilt"):
        preset_checkpoint("qwen2-test", tmp_path, seed=3)  # another key builds anew


def test_cli_lists_and_builds(qwen2, tmp_path, capsys):
    rlkit_main(["model", "list"])
    listed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in listed] == list(PRESETS)
    assert "48.4M" in listed[0] and "8 query / 2 kv heads of 64" in listed[0]
    out = tmp_path / "model"
    # a new process (the console script's path) writes the same bytes: the BPE training is deterministic too
    command = [sys.executable, "-m", "rlkit.cli", "model", "build", "--preset", "qwen2-test", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr
    assert f"wrote qwen2-test (6.8M parameters) to {out}" in done.stdout
    for name in ("model.safetensors", "tokenizer.json", "config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (qwen2 / name).read_bytes(), name
    with pytest.raises(SystemExit) as stop:
        rlkit_main(["model", "build", "--preset", "qwen2-test", str(out)])
    assert stop.value.code == 2 and "--overwrite" in capsys.readouterr().err
    rlkit_main(["model", "build", "--preset", "qwen2-test", str(out), "--overwrite", "--seed", "1"])
    assert (out / "model.safetensors").read_bytes() != (qwen2 / "model.safetensors").read_bytes()
    with pytest.raises(SystemExit) as stop:
        rlkit_main(["model", "build", "--preset", "qwen9", str(out)])
    assert stop.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_invalid_presets_say_what_to_fix():
    with pytest.raises(ConfigError, match="qwen2-small, qwen2-test"):
        get_preset("qwen3")
    shape = dict(hidden_size=256, intermediate_size=512, num_layers=1, num_heads=4, head_dim=64)
    shape |= dict(max_position_embeddings=64, rope_theta=1e4, summary="")
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ModelPreset("x", "qwen2", num_kv_heads=3, **shape)
    with pytest.raises(ValueError, match="hidden_size / num_heads"):
        ModelPreset("x", "qwen2", num_kv_heads=2, **{**shape, "head_dim": 32})
    with pytest.raises(ValueError, match="architecture"):
        ModelPreset("x", "gpt2", num_kv_heads=2, **shape)
