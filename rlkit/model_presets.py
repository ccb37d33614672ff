"""Models of real shape beside the embedded demo: Qwen2 and Llama layouts with a trained byte-level BPE.

A preset has what 0.5B-8B Qwen2/Llama checkpoints have, scaled down: grouped-query attention, head_dim 64,
RoPE, RMSNorm, SwiGLU, untied input and output embeddings, a vocabulary padded past the tokenizer's length,
Qwen2's q/k/v biases, a ChatML tokenizer (:mod:`rlkit.chat_tokenizer`) and a generation config with two EOS
ids. Weights are random (seeded); the directory is written with ``save_pretrained`` and loads like a
downloaded checkpoint in transformers and vLLM. Nothing is downloaded.

    rlkit model list
    rlkit model build --preset qwen2-small /tmp/qwen2-small
"""

from __future__ import annotations

import argparse
import copy
import functools
import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from rlkit.errors import ConfigError

#: The embedding rows are a multiple of this (Qwen2.5: 151,665 tokens, 151,936 rows); the rows past the
#: tokenizer's length get random weights like the others, as unused rows do in real checkpoints.
VOCAB_MULTIPLE = 128
#: BPE tokens (bytes and merges) of the tokenizer every preset shares; the special tokens come after.
BPE_VOCAB_SIZE = 8192
#: transformers initialises q/k/v biases to zero; a small random bias instead makes a loader that drops
#: them visible in the log-probs.
BIAS_STD = 0.02
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ModelPreset:
    """One model shape.

    Attributes:
        name: the preset's name (``rlkit model build --preset NAME``).
        architecture: ``"qwen2"`` (q/k/v biases, RoPE theta 1e6) or ``"llama"`` (no biases, theta 5e5).
        hidden_size: model width; with ``qwen2`` it is ``num_heads * head_dim`` (Qwen2 derives head_dim).
        intermediate_size: SwiGLU width.
        num_layers: decoder layers.
        num_heads: query heads.
        num_kv_heads: key/value heads (grouped-query attention: ``num_heads`` is a multiple of it).
        head_dim: width of each head; vLLM's CPU attention needs 32, 64, 80, ..., 256 or 512.
        max_position_embeddings: longest context of the config (vLLM's default ``max_model_len``).
        rope_theta: RoPE base.
        summary: one line for ``rlkit model list``.
    """

    name: str
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float
    summary: str

    def __post_init__(self) -> None:
        if self.architecture not in ("qwen2", "llama"):
            raise ValueError(f"{self.name}: architecture must be 'qwen2' or 'llama', got {self.architecture!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.name}: num_heads ({self.num_heads}) must be a multiple of num_kv_heads")
        if self.architecture == "qwen2" and self.hidden_size != self.num_heads * self.head_dim:
            raise ValueError(f"{self.name}: Qwen2 derives head_dim as hidden_size / num_heads; make them agree")

    def config(self, tokenizer, dtype: str = "float32"):
        """The transformers config of this shape for ``tokenizer`` (its ids of BOS and EOS)."""
        from transformers import LlamaConfig, Qwen2Config

        shape = {
            "vocab_size": padded_vocab_size(len(tokenizer)),
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "rms_norm_eps": 1e-6 if self.architecture == "qwen2" else 1e-5,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            # Qwen2.5-Instruct's config.json: BOS is <|endoftext|>, EOS the end of a turn
            "bos_token_id": tokenizer.pad_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "dtype": dtype,
        }
        if self.architecture == "qwen2":
            return Qwen2Config(**shape, use_sliding_window=False)
        return LlamaConfig(**shape, head_dim=self.head_dim, attention_bias=False, mlp_bias=False)

    def num_parameters(self, vocab_rows: int) -> int:
        """Parameter count: two ``[vocab_rows, hidden]`` embeddings (untied), then per layer the attention
        (q and o ``hidden x heads*head_dim``, k and v ``hidden x kv_heads*head_dim``, Qwen2's q/k/v biases),
        the SwiGLU (three ``hidden x intermediate``) and two RMSNorm weights; then the final norm."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = 2 * h * q + 2 * h * kv + ((q + 2 * kv) if self.architecture == "qwen2" else 0)
        layer = attention + 3 * h * self.intermediate_size + 2 * h
        return 2 * vocab_rows * h + self.num_layers * layer + h


_QWEN2 = {"architecture": "qwen2", "head_dim": 64, "max_position_embeddings": 32768, "rope_theta": 1e6}
_LLAMA = {"architecture": "llama", "head_dim": 64, "max_position_embeddings": 8192, "rope_theta": 5e5}
PRESETS = {
    preset.name: preset
    for preset in (
        ModelPreset(
            name="qwen2-small",
            hidden_size=512,
            intermediate_size=2816,
            num_layers=8,
            num_heads=8,
            num_kv_heads=2,
            summary="Qwen2.5's layout scaled down: benchmarks, trying real-model settings",
            **_QWEN2,
        ),
        ModelPreset(
            name="qwen2-test",
            hidden_size=256,
            intermediate_size=1408,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            summary="qwen2-small's family, small enough for tests (engines, packing, export)",
            **_QWEN2,
        ),
        ModelPreset(
            name="llama-small",
            hidden_size=512,
            intermediate_size=1792,
            num_layers=8,
            num_heads=8,
            num_kv_heads=2,
            summary="Llama 3's layout scaled down (no biases, RoPE theta 5e5)",
            **_LLAMA,
        ),
        ModelPreset(
            name="llama-test",
            hidden_size=256,
            intermediate_size=896,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            summary="llama-small's family, small enough for tests",
            **_LLAMA,
        ),
    )
}


def padded_vocab_size(num_tokens: int) -> int:
    """Embedding rows for a tokenizer of ``num_tokens``: rounded up to :data:`VOCAB_MULTIPLE`."""
    return -(-num_tokens // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


@functools.cache
def _trained_tokenizer():
    from rlkit.chat_tokenizer import train_chat_tokenizer

    return train_chat_tokenizer(BPE_VOCAB_SIZE)


def shared_tokenizer():
    """The tokenizer of every preset (:func:`~rlkit.chat_tokenizer.train_chat_tokenizer`, seed 0), trained
    once per process (a few seconds); each call returns a copy of its own."""
    return copy.deepcopy(_trained_tokenizer())


def get_preset(name: str) -> ModelPreset:
    """The preset called ``name``; an unknown name lists the known ones."""
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)} (rlkit model list)")
    return PRESETS[name]


def build_preset_checkpoint(
    preset: str | ModelPreset, directory: str | os.PathLike, *, seed: int = 0, dtype: str = "float32"
) -> Path:
    """Write a randomly initialised checkpoint of ``preset`` and its tokenizer into ``directory``.

    Writes ``config.json``, ``generation_config.json`` (EOS ids ``<|im_end|>`` and ``<|endoftext|>``, pad
    ``<|endoftext|>``), ``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json`` and
    ``chat_template.jinja``. Deterministic for a given ``seed`` (the global RNG is left untouched).

    Args:
        preset: a preset name (see :data:`PRESETS`) or a :class:`ModelPreset`.
        directory: where to write (created if missing).
        seed: seed of the weights (every preset and seed shares one tokenizer: a teacher and a student
            built here speak the same vocabulary).
        dtype: ``"float32"`` or ``"bfloat16"``: the dtype the weights are saved in.

    Returns:
        The directory, as a ``Path``.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    preset = get_preset(preset) if isinstance(preset, str) else preset
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = shared_tokenizer()
    tokenizer.model_max_length = preset.max_position_embeddings
    config = preset.config(tokenizer, dtype)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith("_proj.bias"):
                    parameter.normal_(0.0, BIAS_STD)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=[tokenizer.eos_token_id, tokenizer.pad_token_id],
        pad_token_id=tokenizer.pad_token_id,
    )
    model.to(DTYPES[dtype]).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


#: The files whose code decides what a preset checkpoint holds: part of the cache key.
_BUILD_CODE = ("model_presets.py", "chat_tokenizer.py")


def preset_checkpoint(
    name: str, cache_dir: str | os.PathLike | None = None, *, seed: int = 0, dtype: str = "float32"
) -> Path:
    """The checkpoint of preset ``name``, built once and cached in ``cache_dir / preset-<name>-<key>``.

    The key hashes the preset, ``seed``, ``dtype``, the builder's code and the torch / transformers /
    tokenizers versions. Built in a temporary directory and renamed, so a killed build leaves nothing half
    written; later calls return the cached directory at once.

    Args:
        name: a preset name (see :data:`PRESETS`).
        cache_dir: cache root; default ``$RLKIT_CACHE`` or ``~/.cache/rlkit``.
        seed: see :func:`build_preset_checkpoint`.
        dtype: see :func:`build_preset_checkpoint`.
    """
    import tokenizers
    import transformers

    from rlkit.models import default_cache_dir

    preset = get_preset(name)
    versions = f"torch {torch.__version__} transformers {transformers.__version__} tokenizers {tokenizers.__version__}"
    settings = json.dumps(
        {"preset": asdict(preset), "seed": seed, "dtype": dtype, "versions": versions}, sort_keys=True
    )
    digest = hashlib.sha256(settings.encode())
    package = Path(__file__).resolve().parent
    for file in _BUILD_CODE:
        digest.update(file.encode() + b"\0" + (package / file).read_bytes())
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / f"preset-{name}-{digest.hexdigest()[:16]}"
    if (target / "config.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".preset-{name}-", dir=root))
    try:
        with torch.device("cpu"):  # not under a caller's default device (Lightning's configure_model on a GPU)
            build_preset_checkpoint(preset, staging, seed=seed, dtype=dtype)
        try:
            staging.rename(target)
        except OSError:  # another process finished first: keep its copy
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def describe(preset: ModelPreset) -> str:
    """One line: name, size and shape."""
    from rlkit.chat_tokenizer import CONTROL_TOKENS, MARKUP_TOKENS

    rows = padded_vocab_size(BPE_VOCAB_SIZE + len(CONTROL_TOKENS) + len(MARKUP_TOKENS))  # the shared tokenizer
    size = preset.num_parameters(rows) / 1e6
    return (
        f"{preset.name:12} {size:5.1f}M  {preset.architecture}, {preset.num_layers} layers, hidden "
        f"{preset.hidden_size}, {preset.num_heads} query / {preset.num_kv_heads} kv heads of {preset.head_dim}, "
        f"SwiGLU {preset.intermediate_size}, vocab {rows}: {preset.summary}"
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rlkit model",
        description="Build a randomly initialised checkpoint of real shape (Qwen2 / Llama layouts, a ChatML "
        "byte-level BPE tokenizer) that loads like a downloaded one; nothing is downloaded.",
        epilog="presets:\n" + "\n".join("  " + describe(p) for p in PRESETS.values()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = p.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="list the presets")
    build = commands.add_parser("build", help="write a preset's checkpoint into a directory")
    build.add_argument("--preset", required=True, choices=list(PRESETS), help="the model shape")
    build.add_argument("output", type=Path, metavar="OUT_DIR", help="directory to write (must be empty or new)")
    build.add_argument(
        "--seed", type=int, default=0, help="seed of the weights (default 0; the tokenizer is the same for every seed)"
    )
    build.add_argument("--dtype", choices=list(DTYPES), default="float32", help="saved weights' dtype")
    build.add_argument("--overwrite", action="store_true", help="replace what OUT_DIR holds")
    return p


def main(argv: list[str]) -> None:
    """``rlkit model ...``"""
    from transformers.utils import logging as transformers_logging

    args = parser().parse_args(argv)
    transformers_logging.disable_progress_bar()  # "Writing model shards" for a single file
    if args.command == "list":
        for preset in PRESETS.values():
            print(describe(preset))
        return
    output: Path = args.output
    if output.exists() and not output.is_dir():
        raise ConfigError(f"{output} is a file; pass a directory to write the checkpoint into")
    if output.is_dir() and any(output.iterdir()):
        if not args.overwrite:
            raise ConfigError(f"{output} is not empty; pass another directory, or --overwrite to replace it")
        shutil.rmtree(output)
    start = time.perf_counter()
    build_preset_checkpoint(args.preset, output, seed=args.seed, dtype=args.dtype)
    preset = PRESETS[args.preset]
    config = json.loads((output / "config.json").read_text())
    count = preset.num_parameters(config["vocab_size"])
    print(
        f"rlkit model: wrote {args.preset} ({count / 1e6:.1f}M parameters) to {output} in "
        f"{time.perf_counter() - start:.1f} s; load it with --model.policy.checkpoint={output}"
    )
