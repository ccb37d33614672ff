"""The typed rollout batch that flows from the data side to the algorithm."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from rlkit.data.packing import trim_padding


@dataclass
class Rollout:
    """One step's scored completions, ``N = B * G`` rows.

    Layout: ``input_ids`` is each left-padded prompt (``P`` columns) followed by its right-padded
    completion (``T`` columns). Position ids count from each prompt's first real token, as an engine
    that sees no padding does.

    Attributes:
        input_ids: ``[N, P + T]`` prompt then completion token ids.
        attention_mask: ``[N, P + T]`` 1 on real tokens.
        completion_mask: ``[N, T]`` float, 1 on completion tokens that enter the loss.
        group_ids: ``[N]`` int64, the prompt each row answers (rows of a group need not be adjacent).
        scores: ``[N]`` float, the weighted total reward.
        reward_terms: each reward function's ``[N]`` scores, by name.
        engine_logprobs: ``[N, T]`` the engine's log-probs of the sampled tokens (0 on padding).
        truncated: ``[N]`` bool, completions cut at the length limit.
        baselines: ``[N]`` reward of each prompt's greedy completion (ReMax), else None.
        token_rewards: ``[N, T]`` multi-turn episodes: each environment turn reward on its model turn's last
            token and the rest of the score (the rewards' outcome) on the episode's last model token, so a
            row sums to its score; None: each score sits on its completion's last token.
        turn_ids: ``[N, T]`` int64 multi-turn episodes: the model turn (0, 1, ...) of each model token, -1 on
            environment tokens and padding; None: every completion is one turn.
        token_versions: ``[N, T]`` int64 partial rollouts (``data.partial_rollouts``): the policy version that
            sampled each completion token (0 on padding); the weights may change during a generation, so a row
            may span versions. None: every token of the rollout was sampled by ``weights_version``.
        iteration: the rollout's index in the run (0, 1, ...).
        weights_version: how many weight pushes the engine had received when it generated this batch; with
            ``token_versions``, the oldest version that sampled a token of it (the lag check is then conservative).
        temperature: the sampling temperature; the trainer scores log-probs at the same temperature.
        max_new_tokens: the response budget, the constant ``L`` of ``SeqMeanTokenSumNorm``: the completion
            length limit of one turn; of an episode, ``Environment.response_budget`` (its token budget, or
            ``max_turns`` times the per-turn limit).
        texts: decoded completions, for the sample tables (an episode's environment turns inside ``⟦ ⟧``).
        prompt_texts: decoded prompts, one per row.
        timings: seconds spent producing the batch (``generate``, ``score``).
        stats: data-side counters of the step, logged as they are (``reward/errors``).
    """

    input_ids: Tensor
    attention_mask: Tensor
    completion_mask: Tensor
    group_ids: Tensor
    scores: Tensor
    engine_logprobs: Tensor
    truncated: Tensor
    reward_terms: dict[str, Tensor] = field(default_factory=dict)
    baselines: Tensor | None = None
    token_rewards: Tensor | None = None
    turn_ids: Tensor | None = None
    token_versions: Tensor | None = None
    iteration: int = 0
    weights_version: int = 0
    temperature: float = 1.0
    max_new_tokens: int = 0
    texts: list[str] = field(default_factory=list)
    prompt_texts: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    stats: dict[str, float] = field(default_factory=dict)

    @property
    def position_ids(self) -> Tensor:
        """``[N, P + T]`` positions counted from each row's first real token."""
        return (self.attention_mask.long().cumsum(-1) - 1).clamp(min=0)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def staleness(self, version: int) -> Tensor:
        """Policy versions between ``version`` (the trainer's) and what sampled each completion token (``[tokens]``,
        with ``token_versions``) or else each row (``[N]``: one version sampled the rollout)."""
        if self.token_versions is None:
            return torch.full((len(self),), float(version - self.weights_version))  # [N]
        real = self.attention_mask[:, -self.token_versions.shape[1] :].bool()  # [N, T] completion tokens
        return (version - self.token_versions[real]).float()  # [tokens]

    def partial_fraction(self) -> float:
        """The share of rows whose completion tokens were sampled by more than one policy version (0 without
        ``token_versions``)."""
        if self.token_versions is None or not len(self):
            return 0.0
        real = self.attention_mask[:, -self.token_versions.shape[1] :].bool()  # [N, T]
        newest = self.token_versions.masked_fill(~real, torch.iinfo(torch.long).min).max(-1).values  # [N]
        oldest = self.token_versions.masked_fill(~real, torch.iinfo(torch.long).max).min(-1).values  # [N]
        return float(((newest > oldest) & real.any(-1)).float().mean())

    def select(self, rows: Tensor) -> Rollout:
        """The rollout restricted to ``rows`` (an index tensor), padding kept."""
        return Rollout(
            input_ids=self.input_ids[rows],
            attention_mask=self.attention_mask[rows],
            completion_mask=self.completion_mask[rows],
            group_ids=self.group_ids[rows],
            scores=self.scores[rows],
            engine_logprobs=self.engine_logprobs[rows],
            truncated=self.truncated[rows],
            reward_terms={k: v[rows] for k, v in self.reward_terms.items()},
            baselines=None if self.baselines is None else self.baselines[rows],
            token_rewards=None if self.token_rewards is None else self.token_rewards[rows],
            turn_ids=None if self.turn_ids is None else self.turn_ids[rows],
            token_versions=None if self.token_versions is None else self.token_versions[rows],
            iteration=self.iteration,
            weights_version=self.weights_version,
            temperature=self.temperature,
            max_new_tokens=self.max_new_tokens,
            texts=[self.texts[i] for i in rows.tolist()] if self.texts else [],
            prompt_texts=[self.prompt_texts[i] for i in rows.tolist()] if self.prompt_texts else [],
        )


def trim_rollout(rollout: Rollout) -> Rollout:
    """``rollout`` cut to its own longest prompt and completion (every real token kept).

    A micro-batch of short completions then costs its own length, not the whole rollout's; positions
    count from each row's first real token, so the log-probs do not change.
    """
    columns, t = trim_padding(rollout.attention_mask, rollout.completion_mask.shape[1])
    if columns.start == 0 and t == rollout.completion_mask.shape[1]:
        return rollout
    return replace(
        rollout,
        input_ids=rollout.input_ids[:, columns],
        attention_mask=rollout.attention_mask[:, columns],
        completion_mask=rollout.completion_mask[:, :t],
        engine_logprobs=rollout.engine_logprobs[:, :t],
        token_rewards=None if rollout.token_rewards is None else rollout.token_rewards[:, :t],
        turn_ids=None if rollout.turn_ids is None else rollout.turn_ids[:, :t],
        token_versions=None if rollout.token_versions is None else rollout.token_versions[:, :t],
    )


def pad_right(rows: list[list[int]] | list[list[float]], value, dtype: torch.dtype) -> Tensor:
    """``[len(rows), max_len]`` tensor of ``rows`` padded on the right with ``value``."""
    width = max(max((len(r) for r in rows), default=0), 1)
    return torch.tensor([list(r) + [value] * (width - len(r)) for r in rows], dtype=dtype)


def pad_left(rows: list[list[int]], value: int) -> Tensor:
    """``[len(rows), max_len]`` int64 tensor of ``rows`` padded on the left with ``value``."""
    width = max(len(r) for r in rows)
    return torch.tensor([[value] * (width - len(r)) + list(r) for r in rows], dtype=torch.long)
