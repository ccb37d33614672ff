"""Local models: a tiny Llama built from nothing, its warmed-up cache, and checkpoint loading.

Nothing here touches a hub: the tiny model and its character-level tokenizer are built locally and saved
with ``save_pretrained``, so ``transformers`` and vLLM load the directory like any real checkpoint; user
checkpoints are loaded with ``local_files_only=True``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from rlkit.errors import ConfigError

#: Special tokens, in id order: pad=0, bos=1, eos=2, unk=3.
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
#: One token per character. vLLM's CPU attention needs head_dim >= 32 (16 fails), hence the defaults.
CHARACTERS = "0123456789+-*/=()<>.,:;?! \nabcdefghijklmnopqrstuvwxyz"
#: Bump when the warm-up recipe changes, so older cached checkpoints are not reused.
_EMBEDDED_RECIPE = 1


def build_tokenizer(characters: str = CHARACTERS):
    """A character-level tokenizer (``tokenizers`` WordLevel over single characters) that prepends BOS.

    Ids: :data:`SPECIAL_TOKENS`, then ``characters`` in order. Any other character maps to ``<unk>``.
    Decoding concatenates tokens, so ``decode(encode(s)) == s`` for every string of known characters.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *characters))}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )


def build_tiny_checkpoint(
    directory: str | os.PathLike,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    head_dim: int = 32,
    seed: int = 0,
) -> Path:
    """Save a randomly initialised ``LlamaForCausalLM`` and the character tokenizer into ``directory``.

    Args:
        directory: where to write (created if missing): ``config.json``, ``model.safetensors``,
            ``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json``.
        hidden_size: model width.
        num_layers: number of decoder layers.
        num_heads: attention heads (no grouped-query attention); ``head_dim`` need not be
            ``hidden_size / num_heads``.
        head_dim: width of each head; vLLM on CPU needs one of 32, 64, 80, ..., 256, 512.
        seed: seed of the random initialisation (the global RNG is left untouched).

    Returns:
        The directory, as a ``Path``.
    """
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    if head_dim < 32:
        raise ValueError(f"head_dim must be >= 32 (vLLM's CPU attention rejects smaller heads), got {head_dim}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        head_dim=head_dim,
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def default_cache_dir() -> Path:
    """``$RLKIT_CACHE`` if set, else ``~/.cache/rlkit``."""
    return Path(os.environ.get("RLKIT_CACHE") or Path.home() / ".cache" / "rlkit")


def embedded_checkpoint(
    cache_dir: str | os.PathLike | None = None,
    *,
    sft_steps: int = 300,
    sft_batch_size: int = 32,
    sft_lr: float = 3e-3,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    head_dim: int = 32,
    seed: int = 0,
) -> Path:
    """The tiny model after a short supervised warm-up on :class:`~rlkit.data.arithmetic.Arithmetic`.

    Pure RL from random weights does not learn single-digit addition in 1000 steps; a short supervised
    stage (answer + EOS, cross-entropy on the answer only) brings greedy accuracy to roughly one half,
    leaving RL visible room. The result is cached in ``cache_dir / embedded-<hash of every setting>`` and
    written atomically (built in a temporary directory, then renamed), so a killed run never leaves a half
    checkpoint; later calls return the cached directory at once. Deterministic for a given ``seed``.

    Args:
        cache_dir: cache root; default ``$RLKIT_CACHE`` or ``~/.cache/rlkit``.
        sft_steps: supervised optimizer steps (0 keeps the random weights).
        sft_batch_size: questions per supervised step.
        sft_lr: AdamW learning rate of the warm-up.
        hidden_size: see :func:`build_tiny_checkpoint`.
        num_layers: see :func:`build_tiny_checkpoint`.
        num_heads: see :func:`build_tiny_checkpoint`.
        head_dim: see :func:`build_tiny_checkpoint`.
        seed: seed of the initialisation and the warm-up batches.
    """
    if sft_steps < 0:
        raise ValueError(f"sft_steps must be >= 0, got {sft_steps}")
    settings = {
        "recipe": _EMBEDDED_RECIPE,
        "sft_steps": sft_steps,
        "sft_batch_size": sft_batch_size,
        "sft_lr": sft_lr,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "head_dim": head_dim,
        "seed": seed,
    }
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / f"embedded-{key}"
    if (target / "config.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".embedded-{key}-", dir=root))
    try:
        build_tiny_checkpoint(
            staging,
            hidden_size=hidden_size,
            num_layers=num_layers,
            num_heads=num_heads,
            head_dim=head_dim,
            seed=seed,
        )
        if sft_steps:
            model = load_policy(staging)
            _warm_up(
                model,
                load_tokenizer(staging),
                steps=sft_steps,
                batch_size=sft_batch_size,
                lr=sft_lr,
                seed=seed,
            )
            model.save_pretrained(staging)
        (staging / "rlkit_embedded.json").write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")
        try:
            staging.rename(target)
        except OSError:  # another process finished first: keep its copy
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _warm_up(model, tokenizer, *, steps: int, batch_size: int, lr: float, seed: int) -> None:
    """Supervised steps on the arithmetic train split: cross-entropy of ``answer + eos`` given the prompt."""
    from rlkit.data.arithmetic import Arithmetic, supervised_batch

    source = Arithmetic(num_prompts=steps * batch_size, seed=seed, split="train")
    # Right padding under causal attention never reaches a real token: no attention mask needed.
    input_ids, labels = supervised_batch([source[i] for i in range(len(source))], tokenizer)  # [S*M, L]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    for step in range(steps):
        rows = slice(step * batch_size, (step + 1) * batch_size)
        loss = model(input_ids=input_ids[rows], labels=labels[rows]).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    model.eval()


def resolve_checkpoint(checkpoint_dir: str | os.PathLike, option: str = "--model.checkpoint") -> Path:
    """Check that ``checkpoint_dir`` is a local Hugging Face checkpoint directory; return it as a Path.

    Raises:
        FileNotFoundError: the directory or its ``config.json`` is missing.
        ValueError: the path is a file, or the directory holds no weights.
    """
    path = Path(checkpoint_dir).expanduser()
    how = (
        "pass a local Hugging Face checkpoint directory (config.json + weights, as written by "
        "save_pretrained); rlkit never downloads, so fetch hub models beforehand (e.g. `hf download`) "
        "and pass the local directory"
    )
    if not path.exists():
        raise FileNotFoundError(f"{option}: {path} does not exist; {how}")
    if not path.is_dir():
        raise ConfigError(f"{option}: {path} is a file, not a directory; {how}")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{option}: {path} has no config.json; {how}")
    weights = [*path.glob("*.safetensors"), *path.glob("*.bin"), *path.glob("*.safetensors.index.json")]
    if not weights:
        raise ConfigError(f"{option}: {path} has a config.json but no weights (*.safetensors or *.bin); {how}")
    return path


def load_policy(
    checkpoint_dir: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.float32,
    trust_remote_code: bool = False,
    option: str = "--model.checkpoint",
):
    """Load a causal LM from a local directory (never downloads), in ``dtype``, in eval mode.

    Args:
        checkpoint_dir: the checkpoint directory.
        dtype: parameter dtype.
        trust_remote_code: allow the checkpoint's own modelling code (``auto_map`` in config.json).
        option: the config key named in error messages.
    """
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    path = resolve_checkpoint(checkpoint_dir, option)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, local_files_only=True, trust_remote_code=trust_remote_code
        )
    except (OSError, RuntimeError, ValueError, SafetensorError) as error:  # a torn file, a config mismatch
        if isinstance(error, ConfigError):
            raise
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        files = ", ".join(sorted(p.name for p in [*path.glob("*.safetensors"), *path.glob("*.bin")]))
        raise ConfigError(
            f"{option}: could not load the weights in {path} ({files}): {type(error).__name__}: {reason}; a "
            "weights file may be truncated or corrupt: save or copy the checkpoint again"
        ) from error
    return model.eval()


def load_backbone(
    checkpoint_dir: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.float32,
    trust_remote_code: bool = False,
    option: str = "--model.critic.init_args.checkpoint",
):
    """Load the transformer of a local checkpoint without its LM head (``AutoModel``; never downloads).

    A causal-LM checkpoint gives its base model (the LM head's weights are left out); a directory saved
    from a base model loads as it is.
    """
    from transformers import AutoModel
    from transformers.utils import logging as hf_logging

    path = resolve_checkpoint(checkpoint_dir, option)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the LM head's weights are left out on purpose: no load report about them
    try:
        model = AutoModel.from_pretrained(path, dtype=dtype, local_files_only=True, trust_remote_code=trust_remote_code)
    finally:
        hf_logging.set_verbosity(verbosity)
    return model.eval()


def load_tokenizer(
    checkpoint_dir: str | os.PathLike, *, trust_remote_code: bool = False, option: str = "--model.checkpoint"
):
    """Load the tokenizer saved beside a checkpoint (never downloads); it must define an EOS token.

    A tokenizer without a pad token gets ``pad_token = eos_token`` (padding is always masked).
    """
    from transformers import AutoTokenizer

    path = resolve_checkpoint(checkpoint_dir, option)
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise FileNotFoundError(
            f"{option}: {path} has no tokenizer (tokenizer.json / tokenizer_config.json); save the tokenizer "
            "beside the weights with tokenizer.save_pretrained(directory)"
        )
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    if tokenizer.eos_token_id is None:
        raise ConfigError(
            f"{option}: the tokenizer in {path} defines no eos_token; set one (tokenizer.eos_token = ...) "
            "and save it again, since completions stop at EOS"
        )
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
