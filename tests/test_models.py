"""The local tiny model: checkpoint round trip, warm-up cache, and clear errors for bad directories."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import rlkit
import rlkit.embedded
import rlkit.embedded.cache
import rlkit.models
from rlkit.embedded.cache import embedded_checkpoint
from rlkit.embedded.model import CHARACTERS, build_tiny_checkpoint
from rlkit.models import load_policy, load_tokenizer, resolve_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


def test_checkpoint_loads_with_plain_transformers(tiny):
    model = AutoModelForCausalLM.from_pretrained(tiny, local_files_only=True)
    config = model.config
    assert config.model_type == "llama"
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.head_dim) == (
        64,
        2,
        2,
        32,
    )
    assert model.dtype == torch.float32
    logits = model(torch.tensor([[1, 5, 6]])).logits  # [1, 3, V]
    assert logits.shape == (1, 3, len(CHARACTERS) + 4)


def test_tokenizer_round_trips_exactly(tiny):
    tokenizer = AutoTokenizer.from_pretrained(tiny, local_files_only=True)
    ids = tokenizer("3+5=8")["input_ids"]
    # BOS then one token per character.
    assert ids[0] == tokenizer.bos_token_id and len(ids) == 6
    assert tokenizer.decode(ids, skip_special_tokens=True) == "3+5=8"
    for text in ["3+5=8", " 12 * 3 = 36 ", "what is 7-9? -2"]:
        plain = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert len(plain) == len(text)
        assert tokenizer.decode(plain) == text
    # Special tokens are distinct and skipped when decoding a completion.
    specials = {
        tokenizer.pad_token_id,
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.unk_token_id,
    }
    assert len(specials) == 4
    completion = tokenizer("8", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert tokenizer.decode(completion, skip_special_tokens=True) == "8"
    assert tokenizer("§", add_special_tokens=False)["input_ids"] == [tokenizer.unk_token_id]


def test_generation_config_names_eos(tiny):
    config = json.loads((tiny / "generation_config.json").read_text())
    assert config["eos_token_id"] == load_tokenizer(tiny).eos_token_id


def test_seed_decides_the_initialisation(tmp_path):
    a = load_file(build_tiny_checkpoint(tmp_path / "a", seed=1) / "model.safetensors")
    b = load_file(build_tiny_checkpoint(tmp_path / "b", seed=1) / "model.safetensors")
    c = load_file(build_tiny_checkpoint(tmp_path / "c", seed=2) / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight"
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a[name], c[name])


def test_small_head_dim_is_refused(tmp_path):
    with pytest.raises(ValueError, match="head_dim"):
        build_tiny_checkpoint(tmp_path, head_dim=16)


def test_embedded_checkpoint_is_cached_deterministic_and_keyed_by_settings_and_code(tmp_path, monkeypatch):
    quick = {"max_sft_steps": 3, "check_every": 3, "target_accuracy": 0.0}  # stop at the first check
    first = embedded_checkpoint(tmp_path / "one", **quick)
    again = embedded_checkpoint(tmp_path / "two", **quick)
    other = embedded_checkpoint(tmp_path / "one", **{**quick, "max_sft_steps": 4})
    assert first.name == again.name != other.name
    a, b = load_file(first / "model.safetensors"), load_file(again / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    record = json.loads((first / "rlkit_embedded.json").read_text())
    assert record["settings"]["max_sft_steps"] == 3 and record["warm_up"]["steps"] == 3
    # A second call returns the cached directory without building anything.
    monkeypatch.setattr(rlkit.embedded.cache, "build_tiny_checkpoint", None)
    assert embedded_checkpoint(tmp_path / "one", **quick) == first
    # Only finished checkpoints in the cache: no staging directories left behind.
    assert sorted(p.name for p in (tmp_path / "one").iterdir()) == sorted([first.name, other.name])
    # Other warm-up code (or other library versions) means another checkpoint, not the old one.
    monkeypatch.undo()
    monkeypatch.setattr(rlkit.embedded.cache, "_warm_up_code_digest", lambda: "edited")
    edited = embedded_checkpoint(tmp_path / "one", **quick)
    assert edited.name not in (first.name, other.name)
    assert json.loads((edited / "rlkit_embedded.json").read_text())["code_sha256"] == "edited"


def test_cache_key_covers_the_warm_up_code_and_the_task():
    """The key hashes every file of the embedded package and every rlkit module they import (found from
    their imports, no list kept by hand), and nothing else: model loading and the demo are apart."""
    files = {str(p.relative_to(Path(rlkit.__file__).parent)) for p in rlkit.embedded.cache._code_files()}
    embedded = {f"embedded/{p.name}" for p in Path(rlkit.embedded.__file__).parent.glob("*.py")}
    assert embedded <= files
    assert {"models.py", "data/splits.py", "data/prompts.py", "errors.py"} <= files  # imported by the package
    assert not any(name.startswith(("spine/", "algorithms/", "rollouts/")) for name in files)
    assert len(rlkit.embedded.cache._warm_up_code_digest()) == 64


def test_model_loading_does_not_import_the_demo():
    """rlkit.models, the spine and the families load checkpoints without the embedded demo."""
    code = (
        "import sys, rlkit.models, rlkit.spine, rlkit.algorithms; "
        "print(sorted(m for m in sys.modules if m.startswith('rlkit.embedded')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_embedded_checkpoint_default_cache_is_rlkit_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RLKIT_CACHE", str(tmp_path))
    assert embedded_checkpoint(max_sft_steps=1, check_every=1, target_accuracy=0.0).parent == tmp_path


def test_killed_warm_up_leaves_no_checkpoint(tmp_path, monkeypatch):
    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    quick = {"max_sft_steps": 2, "check_every": 2, "target_accuracy": 0.0}
    monkeypatch.setattr(rlkit.embedded.cache, "_warm_up", crash)
    with pytest.raises(KeyboardInterrupt):
        embedded_checkpoint(tmp_path, **quick)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    assert (embedded_checkpoint(tmp_path, **quick) / "config.json").is_file()


def test_missing_directory_says_what_and_how(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"--model.policy.checkpoint: .*nowhere does not exist; pass a local"):
        load_policy(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=r"--teacher: .*nowhere does not exist"):
        load_tokenizer(tmp_path / "nowhere", option="--teacher")


def test_directory_without_config_or_weights(tmp_path, tiny):
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        resolve_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text((tiny / "config.json").read_text())
    with pytest.raises(ValueError, match="no weights"):
        resolve_checkpoint(tmp_path)
    (tmp_path / "model.safetensors").write_bytes((tiny / "model.safetensors").read_bytes())
    with pytest.raises(FileNotFoundError, match="no tokenizer"):
        load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="is a file"):
        resolve_checkpoint(tmp_path / "config.json")


def test_load_policy_dtype(tiny):
    model = load_policy(tiny, dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16 and not model.training


def test_the_embedded_checkpoint_does_not_depend_on_the_default_dtype(tmp_path):
    """Lightning's 64-true precision makes float64 the default while a model loads: the first run of a
    session may build the cache then, and must build what a float32 run builds."""
    quick = {"max_sft_steps": 3, "check_every": 3, "target_accuracy": 0.0}
    plain = embedded_checkpoint(tmp_path / "fp32", **quick)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        under_float64 = embedded_checkpoint(tmp_path / "fp64", **quick)
    finally:
        torch.set_default_dtype(previous)
    a, b = load_file(plain / "model.safetensors"), load_file(under_float64 / "model.safetensors")
    assert all(a[k].dtype == torch.float32 and torch.equal(a[k], b[k]) for k in a)
