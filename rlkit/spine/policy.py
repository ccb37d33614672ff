"""Policy: a causal LM from a local checkpoint, scored token by token.

Every family holds one (the trained policy) and may hold frozen copies (a KL reference, a distillation
teacher). It owns what any family needs of a language model: loading without a hub, per-token
log-probs and entropy of a completion, the whole weights under FSDP, and gradient clipping.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch
from torch import Tensor, nn

from rlkit.components.entropy import entropy_from_logits
from rlkit.components.logprobs import gathered_log_probs, sum_squared_probs, token_log_probs, top_k_log_probs
from rlkit.data.batch import Rollout
from rlkit.data.packing import pack_completions
from rlkit.errors import ConfigError, NonFiniteError
from rlkit.models import ModelSource
from rlkit.spine.settings import PolicySettings


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
    def join(cls, parts: list[tuple[Tensor, TokenScores]], rows: int, width: int) -> TokenScores:
        """Micro-batches' scores placed back at their rows (``(row indices, scores)`` pairs, any order) of
        a ``[rows, width]`` rollout; a micro-batch cut to fewer completion columns leaves zeros after them."""

        def place(name: str) -> Tensor | None:
            if getattr(parts[0][1], name) is None:
                return None
            return place_rows([(indices, getattr(scores, name)) for indices, scores in parts], rows, width)

        return cls(**{f.name: place(f.name) for f in fields(cls)})


def place_rows(parts: list[tuple[Tensor, Tensor]], rows: int, width: int) -> Tensor:
    """``(row indices, [n, t, ...] values)`` of micro-batches placed at their rows of a ``[rows, width, ...]``
    tensor, zeros after a micro-batch's ``t`` columns (a micro-batch cut to its own longest completion)."""
    first = parts[0][1]
    out = first.new_zeros((rows, width, *first.shape[2:]))  # [N, T] or [N, T, k]
    for indices, value in parts:  # [n], [n, t] or [n, t, k]
        out[indices, : value.shape[1]] = value
    return out


class Policy(nn.Module):
    """A Hugging Face causal LM and its tokenizer, loaded from a local directory.

    Args:
        model: the causal LM (``AutoModelForCausalLM``).
        tokenizer: its tokenizer (defines EOS and pad).
        checkpoint_dir: the directory both were loaded from (the engine starts from it).
        chunk_rows: positions of ``[rows, V]`` logits processed at once for log-probs and entropy.
        pack: run each forward on the batch's real tokens packed into one row (no padding, see
            :func:`~rlkit.data.packing.pack_completions`); the first packed forward checks that the
            model's attention keeps packed sequences apart.
    """

    def __init__(
        self, model: nn.Module, tokenizer, checkpoint_dir: Path, chunk_rows: int = 4096, pack: bool = False
    ) -> None:
        super().__init__()
        self.model = model
        self.tokenizer = tokenizer
        self.checkpoint_dir = Path(checkpoint_dir)
        self.chunk_rows = chunk_rows
        self.pack = pack
        self._packing_checked = False

    @classmethod
    def load(
        cls,
        checkpoint: ModelSource | str | None,
        *,
        trust_remote_code: bool = False,
        gradient_checkpointing: bool = False,
        chunk_rows: int = 4096,
        pack: bool = False,
        attn_implementation: str | None = None,
        option: str = "model.policy.checkpoint",
    ) -> Policy:
        """Load ``checkpoint`` (a local HF directory, or a model source that builds one).

        ``attn_implementation`` (``sdpa``, ``eager``, ``flash_attention_2``, ...; None: transformers'
        choice) is set on the loaded model; one that cannot be used here is a config error. ``option`` is the
        config key named in errors.
        """
        from rlkit.models import checkpoint_directory, load_policy, load_tokenizer

        directory = checkpoint_directory(checkpoint, option)
        tokenizer = load_tokenizer(directory, trust_remote_code=trust_remote_code, option=f"--{option}")
        model = load_policy(directory, trust_remote_code=trust_remote_code, option=f"--{option}").train()
        if attn_implementation is not None:
            try:
                model.set_attn_implementation(attn_implementation)
            except (ImportError, ValueError) as error:
                reason = str(error).strip().splitlines()[0]
                raise ConfigError(
                    f"model.policy.attn_implementation={attn_implementation}: {reason} Choose sdpa or eager, or "
                    "null for transformers' default."
                ) from error
        if gradient_checkpointing:
            model.gradient_checkpointing_enable()
        return cls(model, tokenizer, directory, chunk_rows, pack)

    @classmethod
    def from_settings(cls, settings: PolicySettings, pack: bool = False) -> Policy:
        """The policy ``settings`` describe (``pack``: the update loop packs its forwards)."""
        return cls.load(
            settings.checkpoint,
            trust_remote_code=settings.trust_remote_code,
            gradient_checkpointing=settings.gradient_checkpointing,
            chunk_rows=settings.logprob_chunk_rows,
            pack=pack,
            attn_implementation=settings.attn_implementation,
        )

    @property
    def attn_implementation(self) -> str | None:
        """The attention implementation the LM runs with (``sdpa``, ``eager``, ``flash_attention_2``, ...)."""
        return getattr(self.model.config, "_attn_implementation", None)

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
        entropy_grad: bool = True,
    ) -> TokenScores:
        """Score the completion tokens of ``batch``; see :class:`TokenScores`.

        ``top_k > 0`` adds the k most likely next tokens and their log-probs at every position; ``ids``
        (``[n, T, k]``) adds the log-probs of those tokens. Both at ``temperature``, from the same logits.
        With ``entropy_grad=False`` the entropy is a metric only: computed without autograd (no
        ``[n, T, V]`` kept for backward).
        """
        T = batch.completion_mask.shape[1]
        run = self._packed_forward if self.pack else self._padded_forward
        logits, last_hidden = run(batch, hidden)  # [n, T, V], [n, T, H] or None
        targets = batch.input_ids[:, -T:]  # [n, T]
        logprobs = token_log_probs(logits, targets, chunk_rows=self.chunk_rows, temperature=temperature)  # [n, T]
        scores = TokenScores(logprobs, hidden=last_hidden)
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
        if top_k:
            scores.top_logprobs, scores.top_ids = top_k_log_probs(logits, top_k, self.chunk_rows, temperature)
        if ids is not None:
            scores.logprobs_at_ids = gathered_log_probs(logits, ids, self.chunk_rows, temperature)  # [n, T, k]
        return scores

    def _padded_forward(self, batch: Rollout, hidden: bool) -> tuple[Tensor, Tensor | None]:
        """The forward on ``batch`` as laid out (padding included); the LM head runs on the completion
        columns only. Returns ``[n, T, V]`` logits and, if asked, ``[n, T, H]`` last hidden states."""
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
        # Hugging Face's last hidden state is after the final norm, what the LM head reads
        last_hidden = out.hidden_states[-1][:, -(T + 1) : -1] if hidden else None  # [n, T, H]
        return logits, last_hidden

    def _packed_forward(self, batch: Rollout, hidden: bool) -> tuple[Tensor, Tensor | None]:
        """The forward on ``batch``'s real tokens packed in one row; the LM head runs only where a
        completion token is predicted. Returns ``[n, T, V]`` logits (zeros on padding) and, if asked,
        ``[n, T, H]`` last hidden states. The first call checks the packing first."""
        if not self._packing_checked:
            self._check_packing(batch)
        T = batch.completion_mask.shape[1]
        packed = pack_completions(batch.input_ids, batch.attention_mask, T)
        out = self.model(
            input_ids=packed.input_ids,
            position_ids=packed.position_ids,
            logits_to_keep=packed.predictors,
            use_cache=False,
            output_hidden_states=hidden,
        )
        logits = packed.to_completions(out.logits[0])  # [n, T, V]
        last_hidden = packed.to_completions(out.hidden_states[-1][0, packed.predictors]) if hidden else None
        return logits, last_hidden

    @torch.no_grad()
    def _check_packing(self, batch: Rollout) -> None:
        """Score two rows of ``batch`` packed and padded, and require the same log-probs.

        transformers keeps packed sequences apart only through the position ids; an attention
        implementation that ignores them (a checkpoint's own modelling code, an old version) would let
        each sequence attend to the ones before it, silently. The rows are the batch's first two (its
        first twice if it has one), so every call runs the same two extra forwards: under FSDP, where each
        forward is collective, all ranks check at their first packed forward together.
        """
        self._packing_checked = True  # the packed forward below must not check again
        n, T = len(batch), batch.completion_mask.shape[1]
        two = batch.select(torch.tensor([0, min(1, n - 1)], device=batch.input_ids.device))
        packed_logits, _ = self._packed_forward(two, hidden=False)  # [2, T, V]
        padded_logits, _ = self._padded_forward(two, hidden=False)  # [2, T, V]
        targets = two.input_ids[:, -T:]  # [2, T]
        padded = token_log_probs(padded_logits.float(), targets)  # [2, T]
        packed = token_log_probs(packed_logits.float(), targets)  # [2, T]
        real = two.attention_mask[:, -T:].bool()  # [2, T]
        gap = (padded - packed)[real].abs().max().item() if bool(real.any()) else 0.0
        tolerance = 1e-3 if packed_logits.dtype == torch.float32 else 5e-2
        if not gap <= tolerance:
            self._packing_checked = False
            raise ConfigError(
                f"packed and padded log-probs of the same tokens differ by {gap:.3g} (more than {tolerance:g}): "
                f"this model's attention ({getattr(self.model.config, '_attn_implementation', '?')}) does not keep "
                "packed sequences apart by their position ids. Set model.loop.pack_sequences=false."
            )

    @property
    def vocabulary_size(self) -> int:
        """Width of the LM's output (the logits' last dimension)."""
        return self.model.get_output_embeddings().weight.shape[0]

    def full_state_dict(self, trainer=None) -> dict[str, Tensor]:
        """The LM's whole weights under Hugging Face names, gathered if sharded (collective under FSDP)."""
        return full_state_dict(self.model, trainer)


def full_state_dict(module: nn.Module, trainer=None) -> dict[str, Tensor]:
    """``module``'s whole weights, gathered if sharded (FSDP2: collective, every rank must call it).

    ``trainer`` is accepted for callers that name it; the parameters themselves say whether they are sharded.
    For a weight push that holds one whole tensor at a time use :func:`~rlkit.spine.sharding.full_tensors`.
    """
    from rlkit.spine.sharding import full_tensors

    return dict(full_tensors(module))


def clip_gradients(parameters, max_norm: float | None, trainer=None, what: str = "model.optim.max_grad_norm") -> Tensor:
    """Clip the gradient norm of ``parameters`` to ``max_norm`` (None: only measure); return the norm.

    Under FSDP2 the gradients are DTensor shards: their norm is reduced over all ranks (``full_tensor`` of
    the partial norms), so every rank clips by the same whole-model norm. A non-finite norm stops the run
    on every rank: stepping would write NaN into the weights.
    """
    parameters = [p for p in parameters if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in parameters])
    if hasattr(norm, "full_tensor"):  # a DTensor: the partial norms of this rank's shards
        norm = norm.full_tensor()
    if max_norm is not None:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)
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
    critic: nn.Module | None = None,
) -> tuple[TokenScores | None, dict[str, Tensor]]:
    """No-grad scores of every completion token before the updates, micro-batch by micro-batch.

    ``micro_batches`` yields each micro-batch's row indices and its rows of ``rollout`` (possibly cut
    to fewer completion columns, see :meth:`~rlkit.spine.loop.UpdateLoop.micro_rollouts`).
    Returns the policy's :class:`TokenScores` (log-probs at the sampling temperature, entropy, untempered
    log-probs, and ``sum_pi_squared`` when asked), each ``[N, T]`` (None with ``own=False``: the policy's
    pass is skipped, as bypass mode does), and by name each frozen model's log-probs ``[N, T]`` (a KL
    reference, a distillation teacher) and, with a ``critic`` (``critic(micro, scores) -> [n, T]``), its
    ``"values"``. Positions after a micro-batch's own longest completion hold zeros (all masked).
    """
    frozen = frozen or {}
    parts: list[tuple[Tensor, TokenScores]] = []
    frozen_parts: dict[str, list[tuple[Tensor, Tensor]]] = {name: [] for name in frozen}
    values: list[tuple[Tensor, Tensor]] = []
    modules = [policy] if critic is None else [policy, critic]
    training = [module.training for module in modules]
    for module in modules:
        module.eval()
    hidden = critic is not None and critic.shares_policy  # a value head reads the policy's hidden states
    for rows, micro in micro_batches:
        scores = None
        if own or hidden:
            scores = policy(
                micro, rollout.temperature, entropy=True, raw=True, sum_pi_squared=sum_pi_squared, hidden=hidden
            )
        if own:
            parts.append((rows, replace(scores, hidden=None)))
        for name, model in frozen.items():
            frozen_parts[name].append((rows, model(micro, rollout.temperature).logprobs))
        if critic is not None:
            values.append((rows, critic(micro, scores)))  # [n, t]
    for module, mode in zip(modules, training, strict=True):
        module.train(mode)
    N, T = rollout.completion_mask.shape
    others = {name: place_rows(p, N, T) for name, p in frozen_parts.items()}
    if critic is not None:
        others["values"] = place_rows(values, N, T)
    return (TokenScores.join(parts, N, T) if own else None), others


@torch.no_grad()
def score_in_micro_batches(
    model: Policy,
    rollout: Rollout,
    micro_batches: Iterable[tuple[Tensor, Rollout]],
    ids: Tensor | None = None,
    **options,
) -> TokenScores:
    """No-grad :class:`TokenScores` of every completion token of ``rollout``, micro-batch by micro-batch.

    ``micro_batches`` yields ``(row indices, rows)`` as :meth:`~rlkit.spine.loop.UpdateLoop.micro_rollouts`
    does. ``options`` are :meth:`Policy.forward`'s (``entropy``, ``raw``, ``top_k``); ``ids`` ``[N, T, k]``
    is cut to each micro-batch's rows and columns. Scores at the rollout's sampling temperature, in eval mode.
    """
    training = model.training
    model.eval()
    parts = []
    for rows, micro in micro_batches:
        micro_ids = None if ids is None else ids[rows, : micro.completion_mask.shape[1]]  # [n, t, k]
        parts.append((rows, model(micro, rollout.temperature, ids=micro_ids, **options)))
    model.train(training)
    return TokenScores.join(parts, *rollout.completion_mask.shape)
