"""The settings every family shares, written and documented once.

Each is a nested option group of every family: ``--model.policy.checkpoint=DIR``,
``--model.loop.minibatches=4``, ``--model.optim.optimizer.init_args.lr=3e-4`` (in a config file:
``model: {init_args: {loop: {minibatches: 4}}}``). A family's own signature holds its loss's components.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable

from rlkit.errors import ConfigError
from rlkit.models import ModelSource


@dataclass(frozen=True)
class PolicySettings:
    """The policy: where it comes from and how its forward runs (a KL reference and a teacher run the same way).

    Args:
        checkpoint: a local Hugging Face checkpoint directory (config.json + weights + tokenizer), or a model
            source that builds one, e.g. ``{class_path: rlkit.embedded.EmbeddedModel}`` (rlkit's embedded
            demo model, warmed up and cached). Required.
        attn_implementation: the attention (``sdpa``, ``eager``, ``flash_attention_2``, ...; None:
            transformers' default); ``flash_attention_2`` with ``loop.pack_sequences`` skips padding and
            cross-sequence attention entirely.
        gradient_checkpointing: trade compute for memory in the policy's forward.
        logprob_chunk_rows: positions of ``[rows, V]`` logits processed at once for log-probs, entropy and
            top-k.
        trust_remote_code: allow a checkpoint's own Python code (off: only built-in architectures).
    """

    checkpoint: str | ModelSource | None = None
    attn_implementation: str | None = None
    gradient_checkpointing: bool = False
    logprob_chunk_rows: int = 4096
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        if self.logprob_chunk_rows < 1:
            raise ConfigError(f"model.policy.logprob_chunk_rows must be >= 1, got {self.logprob_chunk_rows}")


@dataclass(frozen=True)
class LoopSettings:
    """The update loop: one rollout gives ``ppo_epochs x minibatches`` optimizer steps, each accumulated over
    micro-batches that change memory and speed only, never the maths.

    Args:
        ppo_epochs: passes over each rollout.
        minibatches: optimizer steps per pass (the rollout's rows shuffled, then split into this many).
        micro_batch_size: at most this many rows per forward/backward (None: no row limit).
        micro_batch_tokens: at most this many tokens per forward/backward, padding included (verl's
            ``use_dynamic_bsz``): rows sorted by length, each micro-batch cut to its own longest row, so
            little is spent on padding (None: no token limit; both None: the whole mini-batch at once).
        pack_sequences: run the policy's forwards (and frozen models') on each micro-batch's real tokens
            packed into one row, no padding (verl's ``use_remove_padding``); ``micro_batch_tokens`` then
            counts real tokens. Exact (checked against a padded forward on first use); speed only.
        keep_groups: shuffle, split and micro-batch whole groups (all completions of one prompt; a pair of a
            pairwise loss) instead of rows, so a group's rows always share a mini-batch and a micro-batch.
        seed: the seed of the mini-batch shuffles (None: the run's ``seed_everything``).
    """

    ppo_epochs: int = 1
    minibatches: int = 1
    micro_batch_size: int | None = None
    micro_batch_tokens: int | None = 1024
    pack_sequences: bool = False
    keep_groups: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        for key, value, least in (
            ("ppo_epochs", self.ppo_epochs, 1),
            ("minibatches", self.minibatches, 1),
            ("micro_batch_size", self.micro_batch_size, 1),
            ("micro_batch_tokens", self.micro_batch_tokens, 1),
        ):
            if value is not None and value < least:
                null = " or null" if key.startswith("micro") else ""
                raise ConfigError(f"model.loop.{key} must be >= {least}{null}, got {value}")


@dataclass(frozen=True)
class Optimization:
    """An optimizer, its schedule and its gradient clipping (the policy's; an actor-critic family has a
    second one for its critic).

    Args:
        optimizer: the optimizer (None: AdamW, lr 1e-6, no weight decay; configs set their own).
        lr_scheduler: optional schedule, stepped once per optimizer step; ``rlkit.schedules.LinearDecay``
            ends with the run (``trainer.max_steps``).
        max_grad_norm: clip the gradient norm (over all shards and ranks) to this (None: no clipping).
    """

    optimizer: OptimizerCallable | None = None
    lr_scheduler: LRSchedulerCallable | None = None
    max_grad_norm: float | None = 1.0

    def check(self, key: str) -> Optimization:
        """Raise a config error naming ``key`` (e.g. ``model.optim``) for a setting out of range."""
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ConfigError(f"{key}.max_grad_norm must be > 0 or null (no clipping), got {self.max_grad_norm}")
        return self
