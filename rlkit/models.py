"""Loading local checkpoints: a policy, a backbone, a tokenizer, from a directory or a model source.

Nothing here touches a hub: user checkpoints are loaded with ``local_files_only=True``. A config names a
checkpoint directory, or a :class:`ModelSource` that builds one on demand (the embedded demo's
``rlkit.embedded.EmbeddedModel``); loading never imports what builds it.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from pathlib import Path

import torch

from rlkit.errors import ConfigError


class ModelSource(ABC):
    """A checkpoint directory made on demand (built locally and cached), named in a config where a path
    would be: ``checkpoint: {class_path: rlkit.embedded.EmbeddedModel}`` instead of ``checkpoint: DIR``."""

    @abstractmethod
    def directory(self) -> Path:
        """The checkpoint directory, built first if need be."""

    def describe(self) -> str:
        """A short name for run settings (TensorBoard's HPARAMS tab)."""
        return type(self).__name__


def checkpoint_directory(checkpoint: ModelSource | str | os.PathLike | None, option: str) -> Path:
    """The directory ``checkpoint`` names (a model source builds it); None is a config error naming ``option``."""
    if checkpoint is None:
        raise ConfigError(
            f"{option} is not set: name a local Hugging Face checkpoint directory (--{option}=DIR), or rlkit's "
            "embedded demo model ({class_path: rlkit.embedded.EmbeddedModel}, as configs/tasks/embedded.yaml does)"
        )
    if isinstance(checkpoint, str) and not Path(checkpoint).exists():
        named = _model_source_named(checkpoint)
        if named is not None:  # --model.policy.checkpoint=EmbeddedModel: a class name, not a path
            checkpoint = named()
    if isinstance(checkpoint, ModelSource):
        return Path(checkpoint.directory())
    return Path(checkpoint)


def _model_source_named(name: str) -> type[ModelSource] | None:
    """The model source class called ``name`` (its short name or import path), among those imported."""
    found, pending = [], [ModelSource]
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if name in (cls.__name__, f"{cls.__module__}.{cls.__name__}") and cls is not ModelSource:
            found.append(cls)
    return found[0] if len(found) == 1 else None


def describe_checkpoint(checkpoint: ModelSource | str | os.PathLike | None) -> str:
    """How run settings name ``checkpoint``: a model source's short name, or the path."""
    if isinstance(checkpoint, ModelSource):
        return checkpoint.describe()
    return "none" if checkpoint is None else str(checkpoint)


def default_cache_dir() -> Path:
    """``$RLKIT_CACHE`` if set, else ``~/.cache/rlkit``."""
    return Path(os.environ.get("RLKIT_CACHE") or Path.home() / ".cache" / "rlkit")


def resolve_checkpoint(checkpoint_dir: str | os.PathLike, option: str = "--model.policy.checkpoint") -> Path:
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
    option: str = "--model.policy.checkpoint",
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
    checkpoint_dir: str | os.PathLike, *, trust_remote_code: bool = False, option: str = "--model.policy.checkpoint"
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
