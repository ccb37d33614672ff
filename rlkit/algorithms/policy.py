"""Policy: a causal LM from a local checkpoint, scored token by token.

Every family holds one (the trained policy) and may hold frozen copies (a KL reference, a distillation
teacher). It owns what any family needs of a language model: loading without a hub, per-token
log-probs and entropy of a completion, the whole weights under FSDP, and gradient clipping.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from rlkit.components.entropy import entropy_from_logits
from rlkit.components.logprobs import sum_squared_probs, token_log_probs
from rlkit.data.batch import Rollout
from rlkit.errors import NonFiniteError


@dataclass
class TokenScores:
    """What one forward pass says about a batch's completion tokens, each ``[n, T]``.

    Attributes:
        logprobs: log-probs of the completion tokens at the sampling temperature (carry the gradient
            when the forward does).
        entropy: the tempered next-token distribution's entropy, when asked for.
        raw_logprobs: untempered log-probs (what engines report), when asked for; the same tensor as
            ``logprobs`` at temperature 1.
        sum_pi_squared: ``sum_v pi(v)^2`` of the tempered next-token distribution, when asked for (the
            optimal token baseline's energy).
    """

    logprobs: Tensor
    entropy: Tensor | None = None
    raw_logprobs: Tensor | None = None
    sum_pi_squared: Tensor | None = None


class Policy(nn.Module):
    """A Hugging Face causal LM and its tokenizer, loaded from a local directory.

    Args:
        model: the causal LM (``AutoModelForCausalLM``).
        tokenizer: its tokenizer (defines EOS and pad).
        checkpoint_dir: the directory both were loaded from (the engine starts from it).
        chunk_rows: positions of ``[rows, V]`` logits processed at once for log-probs and entropy.
    """

    def __init__(self, model: nn.Module, tokenizer, checkpoint_dir: Path, chunk_rows: int = 4096) -> None:
        super().__init__()
        self.model = model
        self.tokenizer = tokenizer
        self.checkpoint_dir = Path(checkpoint_dir)
        self.chunk_rows = chunk_rows

    @classmethod
    def load(
        cls,
        checkpoint: str | None,
        *,
        trust_remote_code: bool = False,
        gradient_checkpointing: bool = False,
        chunk_rows: int = 4096,
    ) -> Policy:
        """Load ``checkpoint`` (a local HF directory; None: rlkit's embedded model, built and cached)."""
        from rlkit.models import embedded_checkpoint, load_policy, load_tokenizer

        directory = embedded_checkpoint() if checkpoint is None else Path(checkpoint)
        tokenizer = load_tokenizer(directory, trust_remote_code=trust_remote_code)
        model = load_policy(directory, trust_remote_code=trust_remote_code).train()
        if gradient_checkpointing:
            model.gradient_checkpointing_enable()
        return cls(model, tokenizer, directory, chunk_rows)

    def frozen_copy(self) -> Policy:
        """A copy in eval mode without gradients (a KL reference)."""
        return copy.deepcopy(self).eval().requires_grad_(False)

    def forward(
        self,
        batch: Rollout,
        temperature: float,
        entropy: bool = False,
        raw: bool = False,
        sum_pi_squared: bool = False,
        entropy_grad: bool = True,
    ) -> TokenScores:
        """Score the completion tokens of ``batch``; see :class:`TokenScores`. With ``entropy_grad=False``
        the entropy is a metric only: computed without autograd (no ``[n, T, V]`` kept for backward)."""
        T = batch.completion_mask.shape[1]
        out = self.model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
            logits_to_keep=T + 1,
            use_cache=False,
        )
        logits = out.logits[:, :-1, :]  # [n, T, V]: position t predicts completion token t
        targets = batch.input_ids[:, -T:]  # [n, T]
        logprobs = token_log_probs(logits, targets, chunk_rows=self.chunk_rows, temperature=temperature)  # [n, T]
        scores = TokenScores(logprobs)
        if raw:
            scores.raw_logprobs = (
                logprobs if temperature == 1.0 else token_log_probs(logits, targets, chunk_rows=self.chunk_rows)
            )
        if entropy:
            with torch.set_grad_enabled(torch.is_grad_enabled() and entropy_grad):
                scaled = logits if temperature == 1.0 else logits / temperature  # [n, T, V]
                scores.entropy = entropy_from_logits(scaled, chunk_rows=self.chunk_rows)  # [n, T]
        if sum_pi_squared:
            scores.sum_pi_squared = sum_squared_probs(logits, self.chunk_rows, temperature)  # [n, T]
        return scores

    def full_state_dict(self, trainer=None) -> dict[str, Tensor]:
        """The LM's whole weights under Hugging Face names, gathered if sharded.

        Collective under FSDP: every rank must call it. Lightning's FSDP wraps the whole
        LightningModule, so outside forward the parameters are shard views; ``summon_full_params`` on
        the wrapper makes them whole for the copy. DTensor parameters (FSDP2) are gathered with
        ``full_tensor()``.
        """
        root = fsdp_root(trainer)
        if root is not None:
            from torch.distributed.fsdp import FullyShardedDataParallel

            with FullyShardedDataParallel.summon_full_params(root, writeback=False):
                return {name: t.detach().clone() for name, t in self.model.state_dict().items()}
        state = self.model.state_dict()
        return {name: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach() for name, t in state.items()}


def fsdp_root(trainer):
    """The FSDP1 wrapper Lightning put around the LightningModule, if any."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    wrapper = getattr(trainer.strategy, "model", None) if trainer is not None else None
    return wrapper if isinstance(wrapper, FullyShardedDataParallel) else None


def clip_gradients(parameters, max_norm: float | None, trainer=None, what: str = "model.max_grad_norm") -> Tensor:
    """Clip the gradient norm of ``parameters`` to ``max_norm`` (None: only measure); return the norm.

    Under FSDP the norm is over all shards (the wrapper's own ``clip_grad_norm_``). A non-finite norm
    stops the run: stepping would write NaN into the weights.
    """
    root = fsdp_root(trainer)
    parameters = list(parameters)
    if root is not None:
        norm = root.clip_grad_norm_(max_norm if max_norm is not None else math.inf)
    elif max_norm is not None:
        norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None])
    if not torch.isfinite(norm):
        raise NonFiniteError(
            f"the gradient norm is {norm.item()}: lower the learning rate or set {what}; "
            "resume from the last checkpoint with --ckpt_path=last."
        )
    return norm


@torch.no_grad()
def score_rollout(
    policy: Policy,
    rollout: Rollout,
    micro_batches: Iterable[tuple[Tensor, Rollout]],
    frozen: dict[str, Policy] | None = None,
    own: bool = True,
    sum_pi_squared: bool = False,
) -> tuple[TokenScores | None, dict[str, Tensor]]:
    """No-grad scores of every completion token before the updates, micro-batch by micro-batch.

    ``micro_batches`` yields each micro-batch's row indices and its rows of ``rollout`` (possibly cut
    to fewer completion columns, see :meth:`~rlkit.algorithms.loop.UpdateLoop.micro_rollouts`).
    Returns the policy's :class:`TokenScores` (log-probs at the sampling temperature, entropy, untempered
    log-probs, and ``sum_pi_squared`` when asked), each ``[N, T]`` (None with ``own=False``: the policy's
    pass is skipped), and each frozen model's log-probs ``[N, T]`` by name (a KL reference, a distillation
    teacher).
    """
    frozen = frozen or {}
    names = ["logprobs", "entropy", "raw", *(["sum_pi_squared"] if sum_pi_squared else [])] if own else []
    out = {name: torch.zeros_like(rollout.completion_mask, dtype=torch.float32) for name in [*names, *frozen]}
    training = policy.training
    policy.eval()
    for rows, micro in micro_batches:
        t = micro.completion_mask.shape[1]
        if own:
            scores = policy(micro, rollout.temperature, entropy=True, raw=True, sum_pi_squared=sum_pi_squared)
            out["logprobs"][rows, :t] = scores.logprobs
            out["entropy"][rows, :t] = scores.entropy
            out["raw"][rows, :t] = scores.raw_logprobs
            if sum_pi_squared:
                out["sum_pi_squared"][rows, :t] = scores.sum_pi_squared
        for name, model in frozen.items():
            out[name][rows, :t] = model(micro, rollout.temperature).logprobs
    policy.train(training)
    if not own:
        return None, out
    scores = TokenScores(out.pop("logprobs"), out.pop("entropy"), out.pop("raw"), out.pop("sum_pi_squared", None))
    return scores, out
