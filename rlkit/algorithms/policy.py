"""Policy: a causal LM from a local checkpoint, scored token by token.

Every family holds one (the trained policy) and may hold frozen copies (a KL reference, a distillation
teacher). It owns what any family needs of a language model: loading without a hub, per-token
log-probs and entropy of a completion, the whole weights under FSDP, and gradient clipping.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from torch import Tensor, nn

from rlkit.components.entropy import entropy_from_logits
from rlkit.components.logprobs import gathered_log_probs, sum_squared_probs, token_log_probs, top_k_log_probs
from rlkit.data.batch import Rollout
from rlkit.errors import NonFiniteError


@dataclass
class TokenScores:
    """What one forward pass says about a batch's completion tokens, each ``[n, T]`` or ``[n, T, k]``.

    Attributes:
        logprobs: log-probs of the completion tokens at the sampling temperature (carry the gradient
            when the forward does).
        entropy: the tempered next-token distribution's entropy, when asked for.
        raw_logprobs: untempered log-probs (what engines report), when asked for; the same tensor as
            ``logprobs`` at temperature 1.
        sum_pi_squared: ``sum_v pi(v)^2`` of the tempered next-token distribution, when asked for (the
            optimal token baseline's energy).
        top_logprobs: ``[n, T, k]`` the k most likely next tokens' log-probs (no gradient), when asked for.
        top_ids: ``[n, T, k]`` their ids.
        logprobs_at_ids: ``[n, T, k]`` log-probs of given ids at each position (a teacher's top-k), when
            asked for; they carry the gradient when the forward does.
        hidden: ``[n, T, H]`` the last hidden state at the position that predicts each completion token
            (the state a value head reads), when asked for.
    """

    logprobs: Tensor
    entropy: Tensor | None = None
    raw_logprobs: Tensor | None = None
    sum_pi_squared: Tensor | None = None
    hidden: Tensor | None = None
    top_logprobs: Tensor | None = None
    top_ids: Tensor | None = None
    logprobs_at_ids: Tensor | None = None

    @classmethod
    def cat(cls, parts: list[TokenScores]) -> TokenScores:
        """The scores of consecutive micro-batches joined along rows."""
        return cls(**{f.name: _cat([getattr(p, f.name) for p in parts]) for f in fields(cls)})


def _cat(tensors: list[Tensor | None]) -> Tensor | None:
    return None if tensors[0] is None else torch.cat(tensors)


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
        hidden: bool = False,
        top_k: int = 0,
        ids: Tensor | None = None,
    ) -> TokenScores:
        """Score the completion tokens of ``batch``; see :class:`TokenScores`.

        ``top_k > 0`` adds the k most likely next tokens and their log-probs at every position; ``ids``
        (``[n, T, k]``) adds the log-probs of those tokens. Both at ``temperature``, from the same logits.
        """
        T = batch.completion_mask.shape[1]
        out = self.model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
            logits_to_keep=T + 1,
            use_cache=False,
            output_hidden_states=hidden,
        )
        logits = out.logits[:, :-1, :]  # [n, T, V]: position t predicts completion token t
        targets = batch.input_ids[:, -T:]  # [n, T]
        logprobs = token_log_probs(logits, targets, chunk_rows=self.chunk_rows, temperature=temperature)  # [n, T]
        scores = TokenScores(logprobs)
        if hidden:  # Hugging Face's last hidden state is after the final norm, what the LM head reads
            scores.hidden = out.hidden_states[-1][:, -(T + 1) : -1]  # [n, T, H]
        if raw:
            scores.raw_logprobs = (
                logprobs if temperature == 1.0 else token_log_probs(logits, targets, chunk_rows=self.chunk_rows)
            )
        if entropy:
            scaled = logits if temperature == 1.0 else logits / temperature  # [n, T, V]
            scores.entropy = entropy_from_logits(scaled, chunk_rows=self.chunk_rows)  # [n, T]
        if sum_pi_squared:
            scores.sum_pi_squared = sum_squared_probs(logits, self.chunk_rows, temperature)  # [n, T]
        if top_k:
            scores.top_logprobs, scores.top_ids = top_k_log_probs(logits, top_k, self.chunk_rows, temperature)
        if ids is not None:
            scores.logprobs_at_ids = gathered_log_probs(logits, ids, self.chunk_rows, temperature)  # [n, T, k]
        return scores

    @property
    def vocabulary_size(self) -> int:
        """Width of the LM's output (the logits' last dimension)."""
        return self.model.get_output_embeddings().weight.shape[0]

    def full_state_dict(self, trainer=None) -> dict[str, Tensor]:
        """The LM's whole weights under Hugging Face names, gathered if sharded (collective under FSDP)."""
        return full_state_dict(self.model, trainer)


def full_state_dict(module: nn.Module, trainer=None) -> dict[str, Tensor]:
    """``module``'s whole weights, gathered if sharded.

    Collective under FSDP: every rank must call it. Lightning's FSDP wraps the whole LightningModule, so
    outside forward the parameters are shard views; ``summon_full_params`` on the wrapper makes them whole
    for the copy. DTensor parameters (FSDP2) are gathered with ``full_tensor()``.
    """
    root = fsdp_root(trainer)
    if root is not None:
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(root, writeback=False):
            return {name: t.detach().clone() for name, t in module.state_dict().items()}
    state = module.state_dict()
    return {name: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach() for name, t in state.items()}


def load_policy_and_reference(module, reference: bool) -> tuple[Policy, list[Policy]]:
    """The family's policy and, if ``reference``, a frozen copy of it in a list (kept out of checkpoints).

    The module provides ``checkpoint``, ``trust_remote_code``, ``gradient_checkpointing`` and
    ``logprob_chunk_rows``.
    """
    policy = Policy.load(
        module.checkpoint,
        trust_remote_code=module.trust_remote_code,
        gradient_checkpointing=module.gradient_checkpointing,
        chunk_rows=module.logprob_chunk_rows,
    )
    return policy, [policy.frozen_copy()] if reference else []


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
    micro_batches: list[Tensor],
    frozen: dict[str, Policy] | None = None,
    own: bool = True,
    sum_pi_squared: bool = False,
    critic: nn.Module | None = None,
) -> tuple[TokenScores | None, dict[str, Tensor]]:
    """No-grad scores of every completion token before the updates, micro-batch by micro-batch.

    Returns the policy's :class:`TokenScores` (log-probs at the sampling temperature, entropy, untempered
    log-probs, and ``sum_pi_squared`` when asked), each ``[N, T]`` (None with ``own=False``: the policy's
    pass is skipped, as bypass mode does), and by name each frozen model's log-probs ``[N, T]`` (a KL
    reference, a distillation teacher) and, with a ``critic`` (``critic(micro, scores) -> [n, T]``), its
    ``"values"``.
    """
    frozen = frozen or {}
    names = ["logprobs", "entropy", "raw", "sum_pi_squared"] if own else []
    parts: dict[str, list[Tensor]] = {name: [] for name in [*names, *frozen, *(["values"] if critic else [])]}
    modules = [policy] if critic is None else [policy, critic]
    training = [module.training for module in modules]
    for module in modules:
        module.eval()
    hidden = critic is not None and critic.shares_policy  # a value head reads the policy's hidden states
    for rows in micro_batches:
        micro = rollout.select(rows)
        scores = None
        if own or hidden:
            scores = policy(
                micro, rollout.temperature, entropy=True, raw=True, sum_pi_squared=sum_pi_squared, hidden=hidden
            )
        if own:
            parts["logprobs"].append(scores.logprobs)
            parts["entropy"].append(scores.entropy)
            parts["raw"].append(scores.raw_logprobs)
            parts["sum_pi_squared"].append(scores.sum_pi_squared)
        for name, model in frozen.items():
            parts[name].append(model(micro, rollout.temperature).logprobs)
        if critic is not None:
            parts["values"].append(critic(micro, scores))
    for module, mode in zip(modules, training, strict=True):
        module.train(mode)
    joined = {name: torch.cat(values) if values and values[0] is not None else None for name, values in parts.items()}
    if not own:
        return None, joined
    scores = TokenScores(joined.pop("logprobs"), joined.pop("entropy"), joined.pop("raw"), joined.pop("sum_pi_squared"))
    return scores, joined


@torch.no_grad()
def score_in_micro_batches(
    model: Policy, rollout: Rollout, micro_batches: list[Tensor], ids: Tensor | None = None, **options
) -> TokenScores:
    """No-grad :class:`TokenScores` of every completion token of ``rollout``, micro-batch by micro-batch.

    ``options`` are :meth:`Policy.forward`'s (``entropy``, ``raw``, ``top_k``); ``ids`` ``[N, T, k]`` is
    sliced to each micro-batch's rows. Scores at the rollout's sampling temperature, in eval mode.
    """
    training = model.training
    model.eval()
    parts = [
        model(rollout.select(rows), rollout.temperature, ids=None if ids is None else ids[rows], **options)
        for rows in micro_batches
    ]
    model.train(training)
    return TokenScores.cat(parts)
