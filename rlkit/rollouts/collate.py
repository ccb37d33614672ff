"""collate: scored groups -> the typed :class:`~rlkit.data.batch.Rollout`, a pure function of its inputs."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from rlkit.data.batch import Rollout, pad_left, pad_right
from rlkit.environments.episode import Episode
from rlkit.rollouts.buffer import Group


def collate(
    groups: list[Group],
    iteration: int,
    *,
    pad_id: int,
    decode: Callable[[list[list[int]]], list[str]],
    temperature: float,
    max_new_tokens: int,
    mask_truncated: bool = False,
    timings: Mapping[str, float] = (),
    stats: Mapping[str, float] = (),
) -> Rollout:
    """Pad ``groups`` into one ``Rollout`` (``N`` = total completions): left-padded prompts, right-padded
    completions.

    Args:
        groups: the step's scored groups.
        iteration: the rollout's index in the run.
        pad_id: the pad token id.
        decode: token ids -> texts (the prompts' texts for the sample tables).
        temperature: the sampling temperature (the trainer scores log-probs at the same one).
        max_new_tokens: the response budget (``Environment.response_budget``): the completion limit of one turn, or
            of a whole episode.
        mask_truncated: overlong filtering (DAPO): completions cut at ``max_new_tokens`` take no part in the
            loss; they are still attended to and scored.
        timings: seconds spent producing the batch.
        stats: data-side counters of the step.
    """
    rows = [(g, gen) for g in groups for gen in g.generations]
    group_ids = torch.tensor([k for k, g in enumerate(groups) for _ in g.generations])  # [N]
    prompt_ids = pad_left([g.prompt_ids for g, _ in rows], pad_id)  # [N, P]
    completion_ids = pad_right([gen.token_ids for _, gen in rows], pad_id, torch.long)  # [N, T]
    completion_mask = pad_right([gen.loss_mask() for _, gen in rows], 0.0, torch.float32)  # [N, T] 0 on env tokens
    truncated = torch.tensor([not gen.finished for _, gen in rows])  # [N]
    engine_logprobs = pad_right([gen.logprobs for _, gen in rows], 0.0, torch.float32)  # [N, T]
    # the mask comes from lengths, not from `!= pad`: a prompt may contain the pad token itself
    lengths = torch.tensor([len(g.prompt_ids) for g, _ in rows])  # [N]
    P = prompt_ids.shape[1]
    prompt_mask = torch.arange(P).unsqueeze(0) >= (P - lengths).unsqueeze(1)  # [N, P]
    completion_real = pad_right([[1] * len(gen.token_ids) for _, gen in rows], 0, torch.long)  # [N, T]
    attention_mask = torch.cat([prompt_mask.long(), completion_real], dim=1)  # [N, P + T]
    if mask_truncated:  # overlong filtering: out of the loss, still attended to and scored
        completion_mask = completion_mask * (~truncated).float().unsqueeze(1)  # [N, T]
    has_baselines = all(g.baseline is not None for g in groups)
    episodes = bool(rows) and all(isinstance(gen, Episode) for _, gen in rows)
    scores = [s for g in groups for s in g.scores]
    token_rewards = turn_ids = None  # one turn: each score on its completion's last token
    if episodes:  # per-turn rewards on each turn's last model token
        token_rewards = pad_right([gen.token_rewards(s) for (_, gen), s in zip(rows, scores, strict=True)], 0.0,
                                  torch.float32)  # fmt: skip  # [N, T]
        turn_ids = pad_right([gen.turn_ids() for _, gen in rows], -1, torch.long)  # [N, T]
    started = min(g.weights_version for g in groups)  # the version the producer started the rollout with
    token_versions = None  # one version sampled every token (the rollout's weights_version)
    if bool(rows) and all(gen.versions is not None for _, gen in rows):  # partial rollouts
        token_versions = pad_right([gen.versions for _, gen in rows], 0, torch.long)  # [N, T]
    prompt_texts = decode([g.prompt_ids for g in groups])
    return Rollout(
        input_ids=torch.cat([prompt_ids, completion_ids], dim=1),
        attention_mask=attention_mask,
        completion_mask=completion_mask,
        group_ids=group_ids,
        scores=torch.tensor(scores, dtype=torch.float32),
        engine_logprobs=engine_logprobs,
        truncated=truncated,
        reward_terms={
            name: torch.tensor([s for g in groups for s in g.terms[name]], dtype=torch.float32)
            for name in groups[0].terms
        },
        baselines=torch.tensor([g.baseline for g in groups for _ in g.generations], dtype=torch.float32)
        if has_baselines
        else None,
        token_rewards=token_rewards,
        turn_ids=turn_ids,
        token_versions=token_versions,
        iteration=iteration,
        weights_version=started if token_versions is None else oldest_version(token_versions, completion_real, started),
        temperature=float(temperature),
        max_new_tokens=int(max_new_tokens),
        texts=[t for g in groups for t in g.texts],
        prompt_texts=[text for g, text in zip(groups, prompt_texts, strict=True) for _ in g.generations],
        timings=dict(timings),
        stats=dict(stats),
    )


def oldest_version(token_versions: torch.Tensor, real: torch.Tensor, started: int) -> int:
    """The oldest policy version that sampled a token (``token_versions [N, T]``, ``real [N, T]`` 1 on tokens);
    ``started`` (the version the producer started the rollout with) when there is no token."""
    sampled = token_versions[real.bool()]  # [tokens]
    return int(sampled.min()) if sampled.numel() else started
