"""RolloutDataModule: prompts -> engine -> rewards -> replay buffer -> typed rollout batches."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from typing import Literal

import lightning.pytorch as pl
import torch

from rlkit.data.batch import Rollout, pad_left, pad_right
from rlkit.data.buffer import GenerationRoundsExceeded, Group, GroupFilter, ReplayBuffer
from rlkit.data.prompts import Prompt, PromptSource, encode_prompt
from rlkit.engines.base import RolloutEngine
from rlkit.errors import ConfigError
from rlkit.rewards.base import RewardFunction
from rlkit.rewards.coverage import RewardCoverage
from rlkit.rewards.scoring import RewardScorer
from rlkit.seeding import run_seed

# Salt of the prompt order of extra generation rounds (dynamic sampling), apart from the epoch orders.
_EXTRA_ROUNDS = 0xD5A9


def _stream_seed(seed: int, *parts: int) -> int:
    """A 63-bit seed derived from ``seed`` and ``parts`` (e.g. iteration, epoch): one stream per use."""
    value = seed & 0x7FFFFFFFFFFFFFFF
    for part in parts:
        value = (value * 1_000_003 + part + 0x9E3779B9) & 0x7FFFFFFFFFFFFFFF
    return value


class _Stream:
    """A sized iterable over one epoch's rollouts, generated lazily.

    Having a length matters: Lightning prefetches one batch from an iterable without ``__len__``,
    which would generate rollout ``k`` before update ``k-1`` has been applied.
    """

    def __init__(self, length: int, make: callable, position: callable) -> None:
        self._length = length
        self._make = make
        self._position = position

    def __len__(self) -> int:
        return self._length

    def __iter__(self) -> Iterator:
        # After a resume the epoch continues where the checkpoint left it.
        for _ in range(self._position(), self._length):
            yield self._make()

    # Lightning asks a dataloader for these to know it can resume mid-epoch. The position itself is
    # the datamodule's checkpointed iteration counter, so there is nothing more to keep here.
    def state_dict(self) -> dict:
        return {"position": self._position()}

    def load_state_dict(self, state_dict: dict) -> None:
        pass


class RolloutDataModule(pl.LightningDataModule):
    """Streams rollouts: ``prompts_per_step`` prompts, ``samples_per_prompt`` completions each.

    Each rollout is generated when the trainer asks for it, with the weights of the latest update
    (zero policy lag). An epoch is one pass over the prompt source in an order drawn from
    ``(seed, epoch)``; generation seeds come from ``(seed, iteration, prompt position)``, so a resumed
    run draws the same prompts and samples as an uninterrupted one.

    Dynamic sampling (DAPO): with a ``group_filter`` the buffer keeps only the groups it accepts, and
    further generation rounds, each on ``prompts_per_step`` prompts drawn from
    ``(seed, iteration, round)``, run until ``prompts_per_step`` groups are kept (the surplus of the last
    round is discarded, as in verl), at most ``max_generation_rounds``. A round's samples are seeded by
    ``(seed, iteration, prompt position, round)``, so resuming stays exact. Logged: ``buffer/rounds``,
    ``buffer/groups_kept`` (passed the filter, surplus included) and ``buffer/groups_dropped``.

    Args:
        prompts: training prompts (e.g. ``rlkit.data.arithmetic.Arithmetic`` or ``PromptFile``).
        engine: the generation engine (``HFEngine`` or ``VLLMEngine``).
        rewards: reward functions; the total is their weighted sum.
        reward_weights: one weight per reward function (default all 1).
        reward_timeout_s: the longest one reward function may take on one completion, in seconds.
        reward_workers: processes that score completions in parallel; 0 scores in the training
            process. Use workers for slow or untrusted rewards (code execution, math-verify on long
            answers): a call that overruns there is killed, in-process only interrupted.
        reward_on_error: a reward call that raises, hangs or returns a non-number: ``"raise"`` stops
            the run naming the function and prompt; ``"zero"`` scores it 0 and counts it in
            ``reward/errors``.
        reward_none_patience: a reward function that returns None (does not apply) for every completion of
            this many rollouts in a row stops the run naming it (0: never); each function's share is logged
            as ``reward/<name>/applied_fraction``.
        prompts_per_step: prompts (groups) per rollout, ``B``.
        samples_per_prompt: completions per prompt, ``G``.
        max_prompt_length: prompts with more tokens are an error (or skipped, see ``long_prompts``).
        long_prompts: ``"error"`` stops with a message naming the prompt; ``"skip"`` drops every such
            prompt once, before the first step (the count is said and logged as ``data/skipped_prompts``).
        chat_template: apply the tokenizer's chat template: None = for chat-message prompts only.
        val_prompts: held-out prompts scored with greedy decoding during validation.
        val_batch_size: prompts per validation batch.
        buffer_capacity: the most groups the replay buffer holds.
        group_filter: dynamic sampling: train only on the groups it keeps (``DropConstantGroups``, DAPO)
            and generate more until a step is full; None trains on every group.
        max_generation_rounds: with a ``group_filter``, the most generation rounds for one step; a
            step still short of groups then stops the run with an error saying what to change.
        mask_truncated: overlong filtering (DAPO): completions cut at ``max_new_tokens`` take no part in
            the loss (their loss mask is 0); their rewards still count in their group's advantages.
        seed: the seed of every random stream on the data side (None: the run's ``seed_everything``).
    """

    def __init__(
        self,
        prompts: PromptSource,
        engine: RolloutEngine,
        rewards: list[RewardFunction],
        reward_weights: list[float] | None = None,
        reward_timeout_s: float = 10.0,
        reward_workers: int = 0,
        reward_on_error: Literal["raise", "zero"] = "raise",
        reward_none_patience: int = 20,
        prompts_per_step: int = 16,
        samples_per_prompt: int = 8,
        max_prompt_length: int = 512,
        long_prompts: Literal["error", "skip"] = "error",
        chat_template: bool | None = None,
        val_prompts: PromptSource | None = None,
        val_batch_size: int = 64,
        buffer_capacity: int = 4096,
        group_filter: GroupFilter | None = None,
        max_generation_rounds: int = 10,
        mask_truncated: bool = False,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        if prompts_per_step < 1:
            raise ConfigError(f"data.prompts_per_step must be >= 1, got {prompts_per_step}")
        if samples_per_prompt < 1:
            raise ConfigError(f"data.samples_per_prompt must be >= 1, got {samples_per_prompt}")
        if len(prompts) < prompts_per_step:
            raise ConfigError(
                f"data.prompts holds {len(prompts)} prompts, fewer than data.prompts_per_step="
                f"{prompts_per_step}: lower prompts_per_step or add prompts"
            )
        if not rewards:
            raise ConfigError("data.rewards is empty: name at least one reward function")
        # with dynamic sampling a step may hold up to one round more than it needs
        needed = prompts_per_step if group_filter is None else 2 * prompts_per_step - 1
        if needed > buffer_capacity:
            raise ConfigError(
                f"data.buffer_capacity={buffer_capacity} cannot hold one step's {needed} groups: "
                "raise data.buffer_capacity"
            )
        self.prompts = prompts
        self.engine = engine
        self.scorer = RewardScorer(
            rewards, reward_weights, timeout_s=reward_timeout_s, workers=reward_workers, on_error=reward_on_error
        )
        # a ground truth a reward cannot read is found now, not mid-run
        self.scorer.check_prompts(prompts, "data.prompts")
        if val_prompts is not None:
            self.scorer.check_prompts(val_prompts, "data.val_prompts")
        kinds = {name: type(fn).__name__ for name, fn in zip(self.scorer.names, self.scorer.functions, strict=True)}
        self.coverage = RewardCoverage(self.scorer.names, stop_after=reward_none_patience, kinds=kinds)
        self.prompts_per_step = prompts_per_step
        self.samples_per_prompt = samples_per_prompt
        self.max_prompt_length = max_prompt_length
        self.long_prompts = long_prompts
        self.chat_template = chat_template
        self.val_prompts = val_prompts
        self.val_batch_size = val_batch_size
        if max_generation_rounds < 1:
            raise ConfigError(f"data.max_generation_rounds must be >= 1, got {max_generation_rounds}")
        if group_filter is not None and group_filter.metric not in ("score", "length", *self.scorer.names):
            raise ConfigError(
                f"data.group_filter reads the metric {group_filter.metric!r}, which is neither 'score', 'length' "
                f"nor a reward function's name {self.scorer.names}: set its metric to one of those"
            )
        self.max_generation_rounds = max_generation_rounds
        self.mask_truncated = mask_truncated
        self.seed = run_seed(seed)
        self.buffer = ReplayBuffer(buffer_capacity, group_filter)
        self.iteration = 0  # rollouts produced so far (checkpointed)
        self.weights_version = 0  # weight pushes the engine has received (not checkpointed)
        self.greedy_baselines = False  # also decode one greedy completion per prompt (ReMax's baseline)
        self.tokenizer = None
        self._engine_dir: str | None = None
        self._kept: list[int] | None = None  # with long_prompts=skip: the prompts that fit
        self.reward_errors = 0  # reward calls scored 0 (reward_on_error=zero) in the current rollout
        self.reward_rejected = 0  # completions a reward scored 0 unread (out of its bounds) in it
        self.last_stats: dict[str, float] = {}

    # ---- engine lifecycle (driven by rlkit.algorithms.sync.WeightSync, the only caller) ----

    def attach(
        self, checkpoint_dir: str, tokenizer, trust_remote_code: bool = False, greedy_baselines: bool = False
    ) -> None:
        """Start the engine on ``checkpoint_dir`` (once) and use ``tokenizer`` for prompts.

        ``greedy_baselines``: also decode one greedy completion per prompt and score it (``Rollout.baselines``).
        """
        self.tokenizer = tokenizer
        self.greedy_baselines = greedy_baselines
        if self.long_prompts == "skip" and self._kept is None:
            self._kept = self._drop_long_prompts()
        if self._engine_dir is None:
            self.engine.start(checkpoint_dir, trust_remote_code=trust_remote_code)
            self._engine_dir = checkpoint_dir

    def push_weights(self, named_tensors) -> float:
        """Send the policy's weights to the engine; returns the seconds it took."""
        start = time.perf_counter()
        self.engine.update_weights(named_tensors)
        self.weights_version += 1
        return time.perf_counter() - start

    def teardown(self, stage: str) -> None:
        self.scorer.close()
        if self._engine_dir is not None:
            self.engine.close()
            self._engine_dir = None

    # ---- checkpointed state ----

    def state_dict(self) -> dict:
        return {"iteration": self.iteration}

    def load_state_dict(self, state_dict: dict) -> None:
        self.iteration = int(state_dict["iteration"])

    # ---- training stream ----

    def _drop_long_prompts(self) -> list[int]:
        """Indices of the prompts within ``max_prompt_length``; the others are counted, said and logged once.

        Filtering up front (as verl's ``filter_overlong_prompts``) keeps every step full and every rank's
        row count equal, which skipping inside a step would not.
        """
        kept = [
            i
            for i in range(len(self.prompts))
            if len(encode_prompt(self.prompts[i], self.tokenizer, self.chat_template)) <= self.max_prompt_length
        ]
        skipped = len(self.prompts) - len(kept)
        if len(kept) < self.prompts_per_step:
            raise ConfigError(
                f"only {len(kept)} of {len(self.prompts)} prompts fit data.max_prompt_length={self.max_prompt_length}, "
                f"fewer than data.prompts_per_step={self.prompts_per_step}: raise data.max_prompt_length"
            )
        trainer = self.trainer
        if skipped and (trainer is None or trainer.is_global_zero):
            print(
                f"rlkit: {skipped} of {len(self.prompts)} prompts are longer than data.max_prompt_length="
                f"{self.max_prompt_length} tokens and are skipped (data.long_prompts=skip)",
                file=sys.stderr,
            )
        if trainer is not None and trainer.logger is not None:
            trainer.logger.log_metrics({"data/skipped_prompts": float(skipped)}, step=0)
        return kept

    @property
    def steps_per_epoch(self) -> int:
        available = len(self.prompts) if self._kept is None else len(self._kept)
        return available // self.prompts_per_step

    def train_dataloader(self) -> _Stream:
        return _Stream(self.steps_per_epoch, self.next_rollout, lambda: self.iteration % self.steps_per_epoch)

    def _prompt_indices(self, iteration: int) -> list[int]:
        epoch, position = divmod(iteration, self.steps_per_epoch)
        generator = torch.Generator().manual_seed(_stream_seed(self.seed, epoch))
        available = len(self.prompts) if self._kept is None else len(self._kept)
        order = torch.randperm(available, generator=generator)  # [available]
        start = position * self.prompts_per_step
        chosen = order[start : start + self.prompts_per_step].tolist()
        return chosen if self._kept is None else [self._kept[i] for i in chosen]

    def _encode(self, indices: list[int]) -> tuple[list[Prompt], list[list[int]]]:
        """The prompts at ``indices`` and their token ids."""
        if self.tokenizer is None:
            raise RuntimeError("RolloutDataModule used before attach(): the algorithm module starts the engine")
        prompts, ids = [], []
        for index in indices:
            prompt = self.prompts[index]
            tokens = encode_prompt(prompt, self.tokenizer, self.chat_template)
            if len(tokens) > self.max_prompt_length:
                raise ConfigError(
                    f"prompt #{index} has {len(tokens)} tokens, more than data.max_prompt_length="
                    f"{self.max_prompt_length}: raise data.max_prompt_length, shorten the prompt, or set "
                    "data.long_prompts=skip to drop such prompts"
                )
            prompts.append(prompt)
            ids.append(tokens)
        return prompts, ids

    def _rank(self) -> tuple[int, int]:
        """``(rank, world_size)`` of data parallelism (``(0, 1)`` outside a Trainer)."""
        trainer = self.trainer
        return (0, 1) if trainer is None else (trainer.global_rank, trainer.world_size)

    def setup(self, stage: str) -> None:
        _, world_size = self._rank()
        if self.prompts_per_step % world_size:
            raise ConfigError(
                f"data.prompts_per_step={self.prompts_per_step} does not split over {world_size} data-parallel "
                f"ranks: make it a multiple of {world_size}"
            )

    def _score(self, prompts: list[Prompt], generations: list[list]) -> tuple[list, dict, list[str]]:
        flat = [g for row in generations for g in row]
        texts = self.tokenizer.batch_decode([g.token_ids for g in flat], skip_special_tokens=True)
        repeated = [p for p, row in zip(prompts, generations, strict=True) for _ in row]
        scored = self.scorer.score_batch(texts, repeated, [len(g.token_ids) for g in flat])
        self.reward_errors += scored.errors
        self.reward_rejected += sum(scored.rejected.values())
        return scored.total.tolist(), {k: v.tolist() for k, v in scored.terms.items()}, texts

    def _round_prompt_indices(self, iteration: int, round_: int) -> list[int]:
        """The prompts of generation round ``round_`` of rollout ``iteration``: round 0 follows the epoch
        order; later rounds (dynamic sampling) draw ``prompts_per_step`` prompts from ``(seed, iteration, round)``."""
        if round_ == 0:
            return self._prompt_indices(iteration)
        available = list(range(len(self.prompts))) if self._kept is None else self._kept
        generator = torch.Generator().manual_seed(_stream_seed(self.seed, _EXTRA_ROUNDS, iteration, round_))
        order = torch.randperm(len(available), generator=generator)[: self.prompts_per_step]  # [B]
        return [available[i] for i in order.tolist()]

    def generate_groups(self, iteration: int, round_: int = 0) -> list[Group]:
        """Generate and score this rank's groups of round ``round_`` of rollout ``iteration`` (timings in
        ``self.last_timings``)."""
        rank, world_size = self._rank()
        self.reward_errors = self.reward_rejected = 0
        step_prompts = self._round_prompt_indices(iteration, round_)
        # Each rank takes every world_size-th prompt of the step; a prompt's samples are seeded by its
        # position in the step, so a data-parallel run samples exactly what one process samples.
        positions = list(range(rank, len(step_prompts), world_size))
        prompts, ids = self._encode([step_prompts[p] for p in positions])
        # round 0 keeps the seeds a run without dynamic sampling has
        seeds = [_stream_seed(self.seed, iteration, p, *([round_] if round_ else [])) for p in positions]
        start = time.perf_counter()
        generations = self.engine.generate(ids, n=self.samples_per_prompt, seed=seeds)
        baselines = None
        if self.greedy_baselines:
            greedy = self.engine.generate(ids, n=1, seed=seeds, greedy=True)
        generated = time.perf_counter()
        scores, terms, texts = self._score(prompts, generations)
        if self.greedy_baselines:
            baselines, _, _ = self._score(prompts, greedy)
        self.last_timings = {"generate": generated - start, "score": time.perf_counter() - generated}
        G = self.samples_per_prompt
        return [
            Group(
                prompt=prompt,
                prompt_ids=prompt_ids,
                generations=gens,
                scores=scores[i * G : (i + 1) * G],
                terms={k: v[i * G : (i + 1) * G] for k, v in terms.items()},
                texts=texts[i * G : (i + 1) * G],
                baseline=None if baselines is None else baselines[i],
                iteration=iteration,
                weights_version=self.weights_version,
            )
            for i, (prompt, prompt_ids, gens) in enumerate(zip(prompts, ids, generations, strict=True))
        ]

    def next_rollout(self) -> Rollout:
        """Generate, score, buffer (filtered) and collate the next rollout."""
        iteration = self.iteration
        _, world_size = self._rank()
        wanted = self.prompts_per_step // world_size  # this rank's share of the step's groups
        timings, errors, rejected, generated, kept = {"generate": 0.0, "score": 0.0}, 0, 0, 0, 0
        for round_ in range(self.max_generation_rounds):
            groups = self.generate_groups(iteration, round_)
            generated += len(groups)
            kept += self.buffer.put(groups)
            errors += self.reward_errors
            rejected += self.reward_rejected
            timings = {name: timings[name] + seconds for name, seconds in self.last_timings.items()}
            if len(self.buffer) >= wanted:
                break
        else:
            held = len(self.buffer)
            self.buffer.clear()
            raise GenerationRoundsExceeded(
                f"dynamic sampling: after data.max_generation_rounds={self.max_generation_rounds} generation rounds "
                f"of rollout {iteration}, {held} of the {wanted} groups a step needs passed data.group_filter "
                f"({type(self.buffer.group_filter).__name__} on {self.buffer.group_filter.metric!r}); "
                f"{generated - kept} groups were dropped. The prompts are too easy or too hard for the policy: raise "
                "data.max_generation_rounds or data.samples_per_prompt, use other prompts, or set "
                "data.group_filter=null"
            )
        groups = self.buffer.take(wanted)  # on-policy: drain every step
        self.buffer.clear()  # the last round's surplus is not trained on (it would be stale next step)
        self.last_timings = timings
        self.last_stats = {"reward/errors": float(errors), "reward/rejected": float(rejected)}
        # raises once a function has applied to nothing for data.reward_none_patience rollouts
        self.last_stats.update(
            self.coverage.update({k: [s for g in groups for s in g.terms[k]] for k in groups[0].terms})
        )
        if self.buffer.group_filter is not None:
            self.last_stats.update(
                {
                    "buffer/rounds": float(round_ + 1),
                    "buffer/groups_kept": float(kept),
                    "buffer/groups_dropped": float(generated - kept),
                }
            )
        self.iteration += 1
        return self.collate(groups, iteration)

    def collate(self, groups: list[Group], iteration: int) -> Rollout:
        """Pad the groups into one ``Rollout`` (``N`` = total completions)."""
        pad = self.tokenizer.pad_token_id  # load_tokenizer always sets one
        rows = [(g, gen) for g in groups for gen in g.generations]
        group_ids = torch.tensor([k for k, g in enumerate(groups) for _ in g.generations])  # [N]
        prompt_ids = pad_left([g.prompt_ids for g, _ in rows], pad)  # [N, P]
        completion_ids = pad_right([gen.token_ids for _, gen in rows], pad, torch.long)  # [N, T]
        completion_mask = pad_right([[1.0] * len(gen.token_ids) for _, gen in rows], 0.0, torch.float32)
        truncated = torch.tensor([not gen.finished for _, gen in rows])  # [N]
        engine_logprobs = pad_right([gen.logprobs for _, gen in rows], 0.0, torch.float32)  # [N, T]
        # the mask comes from lengths, not from `!= pad`: a prompt may contain the pad token itself
        lengths = torch.tensor([len(g.prompt_ids) for g, _ in rows])  # [N]
        P = prompt_ids.shape[1]
        prompt_mask = torch.arange(P).unsqueeze(0) >= (P - lengths).unsqueeze(1)  # [N, P]
        attention_mask = torch.cat([prompt_mask.long(), completion_mask.long()], dim=1)  # [N, P + T]
        if self.mask_truncated:  # overlong filtering: out of the loss, still attended to and scored
            completion_mask = completion_mask * (~truncated).float().unsqueeze(1)  # [N, T]
        has_baselines = all(g.baseline is not None for g in groups)
        prompt_texts = self.tokenizer.batch_decode([g.prompt_ids for g in groups], skip_special_tokens=True)
        return Rollout(
            input_ids=torch.cat([prompt_ids, completion_ids], dim=1),
            attention_mask=attention_mask,
            completion_mask=completion_mask,
            group_ids=group_ids,
            scores=torch.tensor([s for g in groups for s in g.scores], dtype=torch.float32),
            engine_logprobs=engine_logprobs,
            truncated=truncated,
            reward_terms={
                name: torch.tensor([s for g in groups for s in g.terms[name]], dtype=torch.float32)
                for name in groups[0].terms
            },
            baselines=torch.tensor([g.baseline for g in groups for _ in g.generations], dtype=torch.float32)
            if has_baselines
            else None,
            iteration=iteration,
            weights_version=min(g.weights_version for g in groups),
            temperature=float(self.engine.temperature),
            max_new_tokens=int(self.engine.max_new_tokens),
            texts=[t for g in groups for t in g.texts],
            prompt_texts=[text for g, text in zip(groups, prompt_texts, strict=True) for _ in g.generations],
            timings=dict(self.last_timings),
            stats=dict(self.last_stats),
        )

    # ---- validation: greedy decoding on held-out prompts ----

    def val_dataloader(self):
        if self.val_prompts is None:
            return []
        size = self.val_batch_size
        rank, world_size = self._rank()
        # every rank gets the same number of batches (metric reduction is collective), each its share
        batches = [
            list(range(i, min(i + size, len(self.val_prompts))))[rank::world_size]
            for i in range(0, len(self.val_prompts), size)
        ]
        return _LazyList(batches, self.evaluate)

    def evaluate(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """Greedy completions of held-out prompts, scored: ``{"scores": [n], "<reward name>": [n], ...}``."""
        prompts = [self.val_prompts[i] for i in indices]
        if not prompts:
            return {"scores": torch.zeros(0)}
        ids = [encode_prompt(p, self.tokenizer, self.chat_template) for p in prompts]
        generations = self.engine.generate(ids, n=1, seed=0, greedy=True)
        scores, terms, texts = self._score(prompts, generations)
        out = {"scores": torch.tensor(scores, dtype=torch.float32)}
        if len(terms) > 1:  # with one reward function its value is the score
            out.update({name: torch.tensor(v, dtype=torch.float32) for name, v in terms.items()})
        out["length"] = torch.tensor([float(len(g[0].token_ids)) for g in generations])
        out["texts"] = texts
        out["prompts"] = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        return out

    def hparams_for_logging(self) -> dict[str, object]:
        """The data-side settings that tell two runs apart (TensorBoard's HPARAMS tab)."""
        return {
            "task": type(self.prompts).__name__,
            "rewards": ",".join(type(fn).__name__ for fn in self.scorer.functions),
            "prompts_per_step": self.prompts_per_step,
            "samples_per_prompt": self.samples_per_prompt,
            "temperature": float(self.engine.temperature),
            "max_new_tokens": int(self.engine.max_new_tokens),
            "engine": type(self.engine).__name__,
            "data_seed": self.seed,
            "group_filter": "none"
            if self.buffer.group_filter is None
            else f"{type(self.buffer.group_filter).__name__}({self.buffer.group_filter.metric})",
            "mask_truncated": self.mask_truncated,
        }


class _LazyList:
    """A sized iterable that calls ``make(item)`` for each item when iterated (validation batches)."""

    def __init__(self, items: list, make: callable) -> None:
        self._items = items
        self._make = make

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator:
        for item in self._items:
            yield self._make(item)
