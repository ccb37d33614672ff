"""Value models of the actor-critic family: ``V(s_t)`` for every completion token.

The value of completion token ``t`` is that of the state before it, read at the position that predicts the
token (verl's critic keeps its outputs ``[:, -T-1:-1]``), so ``V`` at the first completion token is the
value of the prompt. Two kinds, chosen by ``class_path``: :class:`SeparateCritic` (a model of its own, as
verl and InstructGPT) and :class:`ValueHead` (a head on the policy's last hidden state, a shared backbone).
Both heads start at zero (``V = 0`` everywhere; deterministic, no random draw).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import ClassVar

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from rlkit.algorithms.shaping import sum_over_ranks
from rlkit.data.batch import Rollout
from rlkit.errors import ConfigError
from rlkit.spine.metrics import StepMetrics
from rlkit.spine.policy import Policy, TokenScores

#: the value head's weights in an exported critic directory (``weight [1, H]``, ``bias [1]``)
VALUE_HEAD = "value_head.safetensors"


class Critic(nn.Module, ABC):
    """Base of value models. ``shares_policy``: whether it reads the policy's hidden states (then the policy's
    forward returns them) or runs a backbone of its own."""

    shares_policy: ClassVar[bool] = False

    @abstractmethod
    def configure(self, policy: Policy, trust_remote_code: bool = False) -> None:
        """Create the weights (from ``configure_model``; a second call does nothing)."""

    @abstractmethod
    def forward(self, batch: Rollout, scores: TokenScores) -> Tensor:
        """``[n, T]`` values of ``batch``'s completion tokens (``scores``: the policy's forward on it)."""

    @abstractmethod
    def save(self, directory: Path, state: dict[str, Tensor], tokenizer) -> None:
        """Write the critic's whole ``state`` (its gathered state dict) into ``directory``."""


def _zero_head(hidden_size: int, like: nn.Parameter) -> nn.Linear:
    head = nn.Linear(hidden_size, 1).to(device=like.device, dtype=like.dtype)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    return head


def _head_state(state: dict[str, Tensor]) -> dict[str, Tensor]:
    return {name.removeprefix("head."): t.contiguous() for name, t in state.items() if name.startswith("head.")}


class SeparateCritic(Critic):
    """A value model of its own: a local checkpoint's transformer and a linear head (Ouyang et al. 2022; verl).

    Trained by its own optimizer (``critic_optimizer`` of the family); the policy's loss never reaches it.
    Exported as a base-model checkpoint (``save_pretrained``) plus ``value_head.safetensors``; pointing
    ``checkpoint`` at such a directory continues from it.

    Args:
        checkpoint: a local Hugging Face directory sharing the policy's tokenizer: a causal LM (its LM head
            is dropped and a zero value head added) or a critic exported by rlkit. None: the policy's
            checkpoint.
        gradient_checkpointing: trade compute for memory in the critic's forward.
    """

    def __init__(self, checkpoint: str | None = None, gradient_checkpointing: bool = False) -> None:
        super().__init__()
        self.checkpoint = checkpoint
        self.gradient_checkpointing = gradient_checkpointing
        self.backbone: nn.Module | None = None
        self.head: nn.Linear | None = None

    def configure(self, policy: Policy, trust_remote_code: bool = False) -> None:
        if self.backbone is not None:
            return
        from rlkit.models import load_backbone

        directory = policy.checkpoint_dir if self.checkpoint is None else Path(self.checkpoint)
        backbone = load_backbone(directory, trust_remote_code=trust_remote_code).train()
        rows = backbone.get_input_embeddings().num_embeddings
        if rows < len(policy.tokenizer):
            raise ConfigError(
                f"model.critic.init_args.checkpoint {directory} embeds {rows} "
                f"tokens, fewer than the policy's tokenizer ({len(policy.tokenizer)}): the critic reads the "
                "policy's token ids, so it needs a checkpoint with the same tokenizer"
            )
        if self.gradient_checkpointing:
            backbone.gradient_checkpointing_enable()
        self.backbone = backbone
        self.head = _zero_head(backbone.config.hidden_size, next(backbone.parameters()))
        if (directory / VALUE_HEAD).is_file():
            self.head.load_state_dict(load_file(directory / VALUE_HEAD))

    def forward(self, batch: Rollout, scores: TokenScores) -> Tensor:
        T = batch.completion_mask.shape[1]
        out = self.backbone(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
            use_cache=False,
        )
        hidden = out.last_hidden_state[:, -(T + 1) : -1]  # [n, T, H]: the state before each completion token
        return self.head(hidden).squeeze(-1)  # [n, T]

    def save(self, directory: Path, state: dict[str, Tensor], tokenizer) -> None:
        backbone = {name.removeprefix("backbone."): t for name, t in state.items() if name.startswith("backbone.")}
        self.backbone.save_pretrained(directory, state_dict=backbone, safe_serialization=True)
        save_file(_head_state(state), directory / VALUE_HEAD)
        tokenizer.save_pretrained(directory)


class ValueHead(Critic):
    """A linear value head on the policy's last hidden state: one backbone for actor and critic.

    The head has its own optimizer (``critic_optimizer``); the value loss, weighted by the family's
    ``value_coef``, also reaches the shared backbone through the policy's optimizer. Exported as
    ``value_head.safetensors`` (the backbone is the exported policy).

    Args:
        checkpoint: a directory holding a ``value_head.safetensors`` to start from (e.g. an earlier export's
            ``critic/``); None: a zero head.
    """

    shares_policy = True

    def __init__(self, checkpoint: str | None = None) -> None:
        super().__init__()
        self.checkpoint = checkpoint
        self.head: nn.Linear | None = None

    def configure(self, policy: Policy, trust_remote_code: bool = False) -> None:
        if self.head is not None:
            return
        self.head = _zero_head(policy.model.config.hidden_size, next(policy.parameters()))
        if self.checkpoint is not None:
            path = Path(self.checkpoint) / VALUE_HEAD
            if not path.is_file():
                raise FileNotFoundError(f"model.critic.init_args.checkpoint: {path} does not exist")
            self.head.load_state_dict(load_file(path))

    def forward(self, batch: Rollout, scores: TokenScores) -> Tensor:
        if scores.hidden is None:
            raise RuntimeError("ValueHead needs the policy's hidden states: call the policy with hidden=True")
        return self.head(scores.hidden).squeeze(-1)  # [n, T]

    def save(self, directory: Path, state: dict[str, Tensor], tokenizer) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        save_file(_head_state(state), directory / VALUE_HEAD)


@torch.no_grad()
def value_metrics(metrics: StepMetrics, values: Tensor, returns: Tensor, mask: Tensor) -> None:
    """``value/mean``, ``value/returns_mean`` and ``value/explained_variance`` of a rollout's values before the
    updates, over the valid tokens of every rank.

    Explained variance ``1 - Var(R - V) / Var(R)`` (verl's ``critic/vf_explained_var``): 1 for a perfect
    critic, 0 for one no better than the mean return, negative for a worse one.
    """
    valid = mask.bool()  # [N, T]
    v, r = values[valid].double(), returns[valid].double()  # [tokens], [tokens]
    d = r - v  # [tokens]
    sums = sum_over_ranks(torch.stack([v.new_tensor(float(len(v))), r.sum(), (r * r).sum(), d.sum(), (d * d).sum()]))
    n = sums[0].clamp(min=1)
    var_returns = sums[2] / n - (sums[1] / n) ** 2
    var_error = sums[4] / n - (sums[3] / n) ** 2
    if valid.any():
        metrics.update("value/mean", v.mean(), len(v))
        metrics.update("value/returns_mean", r.mean(), len(r))
    metrics.update("value/explained_variance", 1.0 - var_error / (var_returns + 1e-8))
