"""The embedded demo's tiny model: a Llama built from nothing and a character-level tokenizer.

Nothing here touches a hub: both are built locally and saved with ``save_pretrained``, so ``transformers``
and vLLM load the directory like any real checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

#: Special tokens, in id order: pad=0, bos=1, eos=2, unk=3.
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
#: One token per character. vLLM's CPU attention needs head_dim >= 32 (16 fails), hence the defaults.
CHARACTERS = "0123456789+-*/=()<>.,:;?! \nabcdefghijklmnopqrstuvwxyz"


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
