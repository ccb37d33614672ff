"""KVSession: HFEngine continuing multi-turn rows from their KV cache instead of prefilling them again."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import DynamicCache

from rlkit.engines.base import Generation, RolloutEngine
from rlkit.errors import ConfigError


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """``rows`` left-padded to one width: ``(input_ids [B, P], attention mask [B, P])``."""
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # [B, P]
    mask = torch.zeros((len(rows), width), dtype=torch.long)  # [B, P]
    for i, r in enumerate(rows):
        input_ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r) :] = 1
    return input_ids, mask


@dataclass
class _Row:
    """A row the previous call returned: its tokens (context and generation) and the KV of their first
    ``kv[0][0].shape[1]`` tokens (the last generated token is not cached when decoding stopped at it)."""

    tokens: list[int]
    kv: list[tuple[Tensor, Tensor]]  # per layer (keys, values) [H, L, D]


class KVSession:
    """``HFEngine.generate`` that keeps each returned row's KV cache until its next call.

    A context that starts with a row of the previous call (its prompt and generation: an episode's next turn
    appends an observation) is continued from that row's cache: only its new tokens (the last generated one if
    it was not fed back, and the observation) are run through the model, at the positions that follow the
    row's, as vLLM's prefix caching skips a cached prefix. Other contexts are prefilled whole. Rows not
    continued are freed at each call, so the session holds one batch's cache. The tokens and log-probs are
    those of :meth:`HFEngine.generate` on the whole contexts: the same inputs at the same positions and the
    same per-sample uniforms, computed in other shapes (different padding), so log-probs agree to rounding
    and a token differs only where a uniform falls within rounding of a CDF boundary.

    Needs full attention (a sliding-window layer's cache drops old columns). A weight push during a session
    drops the cache (it was computed by the old weights): the next call prefills its contexts whole.
    """

    def __init__(self, engine: RolloutEngine) -> None:  # an HFEngine (its _prefill and _decode); hf imports this module
        self.engine = engine
        self._rows: dict[tuple[int, ...], _Row] = {}
        self._version = engine.weights_version  # the weights that computed the rows' cache
        self.reused_tokens = 0  #: context tokens taken from the cache rather than prefilled, over the session

    def __enter__(self) -> KVSession:
        return self

    def __exit__(self, *exc) -> None:
        self._rows = {}

    def _lookup(self, context: list[int]) -> _Row | None:
        """The longest row of the previous call that ``context`` starts with."""
        for length in sorted({len(key) for key in self._rows}, reverse=True):
            if length <= len(context) and (row := self._rows.get(tuple(context[:length]))) is not None:
                return row
        return None

    @torch.inference_mode()
    def generate(
        self, prompts: list[list[int]], n: int, seed: int | Sequence[int], greedy: bool = False
    ) -> list[list[Generation]]:
        if self.engine.weights_version != self._version:  # new weights: the cache is stale, prefill again
            self._rows, self._version = {}, self.engine.weights_version
        return self.engine._generate(
            prompts, n, seed, greedy, self._prefill, keep=functools.partial(self._keep, prompts)
        )

    def _prefill(self, prompts: list[list[int]], samples: int):
        """The first forward: cached rows continued (:meth:`_continue`), the others prefilled whole."""
        found = [self._lookup(p) for p in prompts]
        if any(found):
            prefilled = self._continue(prompts, found, samples)
        else:
            prefilled = self.engine._prefill_contexts(prompts, samples)
        cache = prefilled[0]
        if not isinstance(cache, DynamicCache) or any(getattr(layer, "is_sliding", False) for layer in cache.layers):
            raise ConfigError(
                f"HFEngine(reuse_kv_cache=True) needs a model with full attention in every layer and a DynamicCache "
                f"(this one has a {type(cache).__name__} or sliding-window layers, whose cache drops old tokens): "
                "set reuse_kv_cache: false"
            )
        return prefilled

    def _keep(self, prompts: list[list[int]], generations: list[Generation], kv) -> None:
        """Each returned row's tokens and KV cache, for the next call (the previous call's are dropped)."""
        samples = len(generations) // len(prompts)  # [N] rows: each prompt's samples in turn
        self._rows = {}
        for r, g in enumerate(generations):
            tokens = prompts[r // samples] + g.token_ids
            self._rows[tuple(tokens)] = _Row(tokens, kv[r])

    def _continue(self, prompts: list[list[int]], found: list[_Row | None], n: int):
        """Prefill only what each context adds to its cached row (all of it without one): the cached columns
        left-padded to one width, then the new tokens left-padded to one width, at positions that continue
        each row. Returns what :meth:`HFEngine._prefill` returns."""
        engine = self.engine
        # at least one token is fed, for the next token's logits
        cached = [
            0 if row is None else min(row.kv[0][0].shape[1], len(p) - 1) for p, row in zip(prompts, found, strict=True)
        ]
        self.reused_tokens += sum(cached)
        past = max(cached)
        like = next(row for row in found if row is not None).kv  # per layer (keys, values) [H, L, D]
        layers = [
            tuple(
                torch.stack(
                    [
                        _right_align(None if row is None else row.kv[layer][part], c, past, like[layer][part])
                        for row, c in zip(found, cached, strict=True)
                    ]
                )  # [B, H, C, D]
                for part in (0, 1)
            )
            for layer in range(len(like))
        ]
        past_mask = torch.zeros((len(prompts), past), dtype=torch.long)  # [B, C]
        for i, c in enumerate(cached):
            past_mask[i, past - c :] = 1
        input_ids, new_mask = left_pad([p[c:] for p, c in zip(prompts, cached, strict=True)], engine.pad_id)
        positions = torch.tensor(cached)[:, None] + (new_mask.cumsum(dim=1) - 1).clamp(min=0)  # [B, P]
        mask = torch.cat([past_mask, new_mask], dim=1)  # [B, C + P]
        return engine._prefill(input_ids, mask, positions, n, DynamicCache(ddp_cache_data=layers))


def _right_align(x: Tensor | None, columns: int, width: int, like: Tensor) -> Tensor:
    """The first ``columns`` of a cached ``x [H, L, D]`` right-aligned in ``width`` zero columns (masked out)."""
    out = like.new_zeros((like.shape[0], width, like.shape[2]))  # [H, C, D]
    if columns:
        out[:, width - columns :] = x[:, :columns]
    return out
