"""RolloutDataModule: prompts -> engine -> rewards -> replay buffer -> typed rollout batches."""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable, Iterator
from typing import Literal

from rlkit.data.batch import Rollout
from rlkit.data.prompts import Prompt, PromptSource, encode_prompt
from rlkit.engines.base import RolloutEngine
from rlkit.environments.base import Environment, SingleTurn
from rlkit.errors import ConfigError
from rlkit.rewards.base import RewardFunction
from rlkit.rewards.coverage import RewardCoverage
from rlkit.rewards.scoring import RewardScorer
from rlkit.rollouts.ahead import AheadProducer, gather_from_ranks, rollout_from_state
from rlkit.rollouts.buffer import GroupFilter, ReplayBuffer
from rlkit.rollouts.collate import collate
from rlkit.rollouts.data_check import (
    DataLimits,
    count_problem,
    encoding_problem,
    prompt_lengths,
    prompt_problems,
    raise_problems,
    val_interval_problem,
)
from rlkit.rollouts.heldout import HeldOutSet, choose_held_out
from rlkit.rollouts.process import ProducerProcess, PromptEncoder
from rlkit.rollouts.producer import GroupProducer, ProducedStep
from rlkit.rollouts.schedule import PromptSchedule
from rlkit.rollouts.source import EngineRequest, HeldOutBatch, RolloutSource, StepShape
from rlkit.seeding import run_seed


class RolloutDataModule(RolloutSource):
    """Streams rollouts: ``prompts_per_step`` prompts, ``samples_per_prompt`` completions each.

    A thin Lightning shell over the rollout pipeline: a :class:`~rlkit.rollouts.schedule.PromptSchedule`
    (prompt order, seeds, the resume counter), a :class:`~rlkit.rollouts.producer.GroupProducer` (engine,
    rewards, filter), :func:`~rlkit.rollouts.collate.collate` and the held-out set. Each rollout is
    generated when the trainer asks for it, with the weights of the latest update (zero policy lag), or with
    ``max_staleness >= 1`` ahead of it in a thread (:class:`~rlkit.rollouts.ahead.AheadProducer`). An
    epoch is one pass over the prompt source in an order drawn from ``(seed, epoch)``; generation seeds come
    from ``(seed, iteration, prompt position)``, so a resumed run draws the same prompts and samples as an
    uninterrupted one.

    Dynamic sampling (DAPO): with a ``group_filter`` the buffer keeps only the groups it accepts, and
    further generation rounds, each on ``prompts_per_step`` prompts drawn from
    ``(seed, iteration, round)``, run until ``prompts_per_step`` groups are kept (the surplus of the last
    round is discarded, as in verl), at most ``max_generation_rounds``. A round's samples are seeded by
    ``(seed, iteration, prompt position, round)``, so resuming stays exact. Logged: ``buffer/rounds``,
    ``buffer/groups_kept`` (passed the filter, surplus included) and ``buffer/groups_dropped``.

    Args:
        prompts: training prompts (e.g. ``PromptFile``, or the embedded ``rlkit.embedded.AdditionChain``).
        engine: the generation engine (``HFEngine`` or ``VLLMEngine``).
        rewards: reward functions; the total is their weighted sum.
        reward_weights: one weight per reward function (default all 1).
        reward_timeout_s: the longest one reward function may take on one completion, in seconds.
        reward_workers: processes that score completions in parallel; 0 scores in the training
            process. Use workers for slow or untrusted rewards (code execution, math-verify on long
            answers): a call that overruns there is killed, in-process only interrupted. With
            ``max_staleness >= 1`` and workers, the producer thread scores its rollouts itself (with workers of
            its own) and can run ``max_staleness`` rollouts ahead; with 0 it hands its scoring to the trainer's
            thread (``SIGALRM`` works only there), so it is never more than one rollout ahead.
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
        val_prompts: held-out prompts scored with greedy decoding during validation. The embedded demo's
            (inherited from ``configs/tasks/embedded.yaml``) is not used beside prompts of another source:
            the run says it has no held-out set, or splits ``prompts`` with ``val_fraction``.
        val_fraction: hold out this share of ``prompts`` (by a fixed hash of each prompt's text, so no seed
            moves a prompt across) as the held-out set; None holds out nothing.
        val_batch_size: prompts per validation batch.
        buffer_capacity: the most groups the replay buffer holds.
        group_filter: dynamic sampling: train only on the groups it keeps (``DropConstantGroups``, DAPO)
            and generate more until a step is full; None trains on every group.
        max_generation_rounds: with a ``group_filter``, the most generation rounds for one step; a
            step still short of groups then stops the run with an error saying what to change.
        mask_truncated: overlong filtering (DAPO): completions cut at ``max_new_tokens`` take no part in
            the loss (their loss mask is 0); their rewards still count in their group's advantages.
        seed: the seed of every random stream on the data side (None: the run's ``seed_everything``).
        max_staleness: policy versions generation runs ahead of training (the fixed pipeline schedule of
            :mod:`rlkit.rollouts.ahead`): rollout ``k`` is sampled by the weights after update ``k - 1 - s``,
            in a thread while the trainer updates (``HFEngine``: with its own engine copy; ``VLLMEngine``: the
            one engine, whose model runs in vLLM's own process). 0 (the default) generates each rollout when
            the trainer asks, with the latest weights.
        async_schedule: with ``max_staleness >= 1``, ``fixed`` (rollout ``k`` always by the weights after
            update ``k - 1 - s``: deterministic, resumes exactly) or ``free`` (the newest weights within the
            bound as the producer starts a rollout: never waits for a version, reproducible only up to
            timing; see :mod:`rlkit.rollouts.ahead`).
        producer_threads: with ``max_staleness >= 1``, torch's intra-op threads in the producer thread
            (None: torch's default; the trainer's thread keeps its own count), or in its process.
        async_producer: with ``max_staleness >= 1``, where the producer generates and scores: ``thread`` (a
            thread of the training process, with its own engine copy) or ``process`` (a spawned process with
            its own engine copy, tokenizer and reward scorer; weights cross through shared memory; no shared
            GIL with the trainer; see :mod:`rlkit.rollouts.process`). Both give the same rollouts. ``VLLMEngine``
            takes ``thread`` only (its model already runs in a process of its own).
        producer_timeout_s: with ``max_staleness >= 1``, the longest the trainer waits for a rollout with no
            sign of the producer thread (a hung engine) before the run stops with a ``ProducerError`` saying
            what the thread was doing (None: wait forever). The thread is abandoned; the last checkpoint resumes.
        partial_rollouts: with ``async_schedule: free`` (thread producer), a generation in flight when the trainer
            pushes new weights continues on them (verl's partial rollout, PipelineRL's in-flight updates): every
            ``partial_chunk_tokens`` sampled tokens the producer's engine loads the newest pushed version, if
            newer, and prefills the rows still decoding again under it. Each token records the version that
            sampled it (``Rollout.token_versions``) and its log-prob is that version's; ``async/staleness_*``
            count per token, ``async/partial_fraction`` the rows sampled by more than one version. False: a
            generation finishes on the weights it started with.
        partial_chunk_tokens: with ``partial_rollouts``, sampled tokens between two looks for newer weights.
        environment: what answers each model turn (``class_path``/``init_args``, see
            :mod:`rlkit.environments`): ``SingleTurn`` (None, the default) ends after one turn, exactly as
            before; ``ToolEnvironment`` runs tool calls. A multi-turn episode is one row whose environment
            tokens are out of the loss; its reward is ``rewards`` on the last model turn. With
            ``max_staleness >= 1`` the producer plays its episodes with its own copy of the environment
            (``copy.deepcopy`` in the thread, pickled into the process), validation with this one.
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
        val_fraction: float | None = None,
        val_batch_size: int = 64,
        buffer_capacity: int = 4096,
        group_filter: GroupFilter | None = None,
        max_generation_rounds: int = 10,
        mask_truncated: bool = False,
        seed: int | None = None,
        max_staleness: int = 0,
        async_schedule: Literal["fixed", "free"] = "fixed",
        producer_threads: int | None = None,
        async_producer: Literal["thread", "process"] = "thread",
        producer_timeout_s: float | None = 600.0,
        partial_rollouts: bool = False,
        partial_chunk_tokens: int = 8,
        environment: Environment | None = None,
    ) -> None:
        super().__init__()
        if prompts_per_step < 1:
            raise ConfigError(f"data.prompts_per_step must be >= 1, got {prompts_per_step}")
        if samples_per_prompt < 1:
            raise ConfigError(f"data.samples_per_prompt must be >= 1, got {samples_per_prompt}")
        #: the data's own name (before a held-out split), for hparams
        self.task = type(prompts).__name__
        prompts, val_prompts, self.held_out_note = choose_held_out(prompts, val_prompts, val_fraction)
        if not rewards:
            raise ConfigError("data.rewards is empty: name at least one reward function")
        # with dynamic sampling a step may hold up to one round more than it needs
        needed = prompts_per_step if group_filter is None else 2 * prompts_per_step - 1
        if needed > buffer_capacity:
            raise ConfigError(
                f"data.buffer_capacity={buffer_capacity} cannot hold one step's {needed} groups: "
                "raise data.buffer_capacity"
            )
        if max_generation_rounds < 1:
            raise ConfigError(f"data.max_generation_rounds must be >= 1, got {max_generation_rounds}")
        if max_staleness < 0:
            raise ConfigError(f"data.max_staleness must be >= 0 (0: no run-ahead), got {max_staleness}")
        if async_schedule not in ("fixed", "free"):
            raise ConfigError(f"data.async_schedule must be fixed or free, got {async_schedule!r}")
        if async_schedule == "free" and not max_staleness:
            raise ConfigError(
                "data.async_schedule=free runs generation ahead within data.max_staleness, which is 0: set "
                "data.max_staleness to 1 or more"
            )
        if async_producer not in ("thread", "process"):
            raise ConfigError(f"data.async_producer must be thread or process, got {async_producer!r}")
        if async_producer == "process" and not max_staleness:
            raise ConfigError(
                "data.async_producer=process runs the producer ahead of training in its own process, and "
                "data.max_staleness is 0 (no run-ahead): set data.max_staleness to 1 or more"
            )
        if partial_rollouts and async_schedule != "free":
            raise ConfigError(
                "data.partial_rollouts=true changes the weights of a generation in flight, which only the "
                f"free-running schedule does (data.async_schedule={async_schedule}): set data.async_schedule=free "
                "with data.max_staleness >= 1, or data.partial_rollouts=false"
            )
        if partial_rollouts and async_producer == "process":
            raise ConfigError(
                "data.partial_rollouts=true runs in the producer thread only (its engine copy loads the weights "
                "between chunks), not in data.async_producer=process: set data.async_producer=thread"
            )
        if partial_chunk_tokens < 1:
            raise ConfigError(f"data.partial_chunk_tokens must be >= 1, got {partial_chunk_tokens}")
        if partial_rollouts and not hasattr(engine, "between_chunks"):  # HFEngine's hook between chunks
            raise ConfigError(
                f"data.partial_rollouts=true loads newer weights between chunks of HFEngine's decoding, which "
                f"{type(engine).__name__} does not do: use rlkit.engines.hf.HFEngine or data.partial_rollouts=false"
            )
        if max_staleness and engine.run_ahead is None:
            raise ConfigError(
                f"data.max_staleness={max_staleness} runs the engine ahead of training in a producer thread, which "
                f"{type(engine).__name__} does not support yet: use rlkit.engines.hf.HFEngine, "
                "rlkit.engines.vllm.VLLMEngine or data.max_staleness=0"
            )
        if max_staleness and async_producer == "process" and engine.run_ahead == "shared":
            raise ConfigError(
                f"data.async_producer=process copies the engine into a producer process, and {type(engine).__name__} "
                "already generates in processes of its own (the producer thread drives it without a copy): set "
                "data.async_producer=thread"
            )
        environment = SingleTurn() if environment is None else environment
        if partial_rollouts and not environment.single_turn:
            raise ConfigError(
                "data.partial_rollouts=true records each token's policy version, which multi-turn episodes "
                f"(data.environment={type(environment).__name__}) do not carry across their turns yet: set "
                "data.partial_rollouts=false"
            )
        chat = chat_template or (chat_template is None and len(prompts) > 0 and isinstance(prompts[0].prompt, list))
        if environment.tool_schemas() and not chat:
            raise ConfigError(
                f"data.environment={type(environment).__name__} offers tools, which only the chat template shows "
                "the model, and these prompts are encoded without it: set data.chat_template=true"
            )
        if producer_threads is not None and producer_threads < 1:
            raise ConfigError(f"data.producer_threads must be >= 1 or null, got {producer_threads}")
        if producer_timeout_s is not None and not producer_timeout_s > 0:
            raise ConfigError(
                f"data.producer_timeout_s must be > 0 seconds or null (wait forever), got {producer_timeout_s}"
            )
        self.prompts = prompts
        self.engine = engine
        self.environment = environment
        self.scorer = RewardScorer(
            rewards, reward_weights, timeout_s=reward_timeout_s, workers=reward_workers, on_error=reward_on_error
        )
        # a ground truth a reward cannot read is found now, not mid-run
        self.scorer.check_prompts(prompts, "data.prompts")
        if val_prompts is not None:
            self.scorer.check_prompts(val_prompts, "data.val_prompts")
        kinds = {name: type(fn).__name__ for name, fn in zip(self.scorer.names, self.scorer.functions, strict=True)}
        self.coverage = RewardCoverage(self.scorer.names, stop_after=reward_none_patience, kinds=kinds)
        if group_filter is not None and group_filter.metric not in ("score", "length", *self.scorer.names):
            raise ConfigError(
                f"data.group_filter reads the metric {group_filter.metric!r}, which is neither 'score', 'length' "
                f"nor a reward function's name {self.scorer.names}: set its metric to one of those"
            )
        self.prompts_per_step = prompts_per_step
        self.samples_per_prompt = samples_per_prompt
        self.max_prompt_length = max_prompt_length
        self.long_prompts = long_prompts
        self.chat_template = chat_template
        self.max_generation_rounds = max_generation_rounds
        self.mask_truncated = mask_truncated
        self.seed = run_seed(seed)
        self.schedule = PromptSchedule(prompts, prompts_per_step, self.seed)
        self.held_out = HeldOutSet(val_prompts, val_batch_size) if val_prompts is not None else None
        self.buffer = ReplayBuffer(buffer_capacity, group_filter)
        self.producer: GroupProducer | None = None  # made by attach(), once the tokenizer is known
        self.tokenizer = None  # the policy's, given by attach()
        self._version = 0  # weight pushes the engine has received (checkpointed only with max_staleness)
        self._engine_dir: str | None = None
        self.max_staleness = max_staleness
        self.async_schedule = async_schedule
        self.producer_threads = producer_threads
        self.async_producer = async_producer
        self.producer_timeout_s = producer_timeout_s
        self.partial_chunk_tokens = partial_chunk_tokens if partial_rollouts else None
        self.ahead: AheadProducer | None = None  # with max_staleness >= 1, made by attach()
        self._restored: dict | None = None  # the ahead producer's part of a checkpoint being resumed

    # ---- the seam (driven by rlkit.spine.sync.WeightSync, the only caller) ----

    def attach(self, request: EngineRequest) -> None:
        """Start the engine on the policy's checkpoint (once), filter long prompts (once, with
        ``long_prompts=skip``), and make the producer."""
        self.tokenizer = request.tokenizer
        if self._engine_dir is None:
            self._check_data()  # every problem in one message, before the engine's start-up
        if self._engine_dir is None:
            self.engine.start(request.checkpoint_dir, trust_remote_code=request.trust_remote_code)
            self._engine_dir = request.checkpoint_dir
        self.producer = GroupProducer(
            self.schedule,
            self.engine,
            self.scorer,
            request.tokenizer,
            self._encode,
            self.samples_per_prompt,
            self.buffer,
            self.max_generation_rounds,
            greedy_baselines=request.greedy_baselines,
            coverage=self.coverage,
            environment=self.environment,
        )
        if self.max_staleness and self.ahead is None:
            restored = self._restored or {"ahead": [], "weights_version": 1}
            rollouts = {r.iteration: r for r in map(rollout_from_state, restored["ahead"])}
            in_process = self.async_producer == "process"
            self.ahead = AheadProducer(
                self.producer,
                self._collate,
                self._encode,
                self.max_staleness,
                *self._rank(),
                threads=None if in_process else self.producer_threads,
                first=self.schedule.iteration + len(rollouts),
                restored=rollouts,
                floor=int(restored["weights_version"]),
                free_running=self.async_schedule == "free",
                backend=self._producer_process if in_process else None,
                timeout_s=self.producer_timeout_s,
                partial_chunk_tokens=self.partial_chunk_tokens,
            )

    def push_weights(self, named_tensors) -> None:
        if self.ahead is not None:  # the thread's engine loads it at its version boundary
            self._version = self.ahead.push(named_tensors)
            return
        self.engine.update_weights(named_tensors)
        self._version += 1

    @property
    def weights_version(self) -> int:
        return self._version

    def step_shape(self) -> StepShape:
        return StepShape(self.prompts_per_step, self.samples_per_prompt)

    def teardown(self, stage: str) -> None:
        if self.ahead is not None:
            self.ahead.close()
            self.ahead = None
        self.scorer.close()
        if self._engine_dir is not None:
            self.engine.close()
            self._engine_dir = None

    # ---- checkpointed state ----

    def on_exception(self, exception: BaseException) -> None:
        if self.ahead is not None:  # no producer thread outlives a failed run
            self.ahead.close()

    def state_dict(self) -> dict:
        """The schedule's counter; with ``max_staleness >= 1`` also the ahead producer's part. Lightning writes
        rank 0's state only, and each rank's rollouts generated ahead hold its own share of the prompts, so on
        several ranks every rank's are gathered into ``ahead_by_rank`` (a collective: Lightning calls this
        on every rank), and each rank takes its own back on resume."""
        state = {**self.schedule.state_dict(), "source": self._source()}
        if self.ahead is not None:
            state.update(self.ahead.state_dict(self.schedule.iteration))
            if self._rank()[1] > 1:
                state["ahead_by_rank"] = gather_from_ranks(state["ahead"])
                state["ahead"] = state["ahead_by_rank"][0]  # the same state on every rank
        return state

    def _source(self) -> dict[str, object]:
        """What the checkpointed schedule position means: the prompts (their kind, number, and a digest of the
        first and last prompt texts and ground truths: never ``meta``, whose objects may print differently in
        another process), how many prompts a step takes and samples, the data seed and the environment. The same
        position over another source would go on with a schedule that was never planned, silently."""
        n = len(self.prompts)
        ends = repr([(self.prompts[i].prompt, self.prompts[i].ground_truth) for i in sorted({0, n - 1})] if n else [])
        return {
            "data.prompts": f"{self.task}, {n} prompts, ends {hashlib.sha256(ends.encode()).hexdigest()[:10]}",
            "data.prompts_per_step": self.prompts_per_step,
            "data.samples_per_prompt": self.samples_per_prompt,
            "data.seed": self.seed,
            "data.environment": type(self.environment).__name__,
        }

    def _check_source(self, saved: dict[str, object] | None) -> None:
        """Refuse a resume over another data source (checkpoints before this check hold none: not checked).
        ``rlkit validate --ckpt_path`` may score a checkpoint on any data: only a fit is checked."""
        if saved is None or (self.trainer is not None and self.trainer.state.fn == "validate"):
            return
        now = self._source()
        differ = [
            f"{key} {saved[key]} there, {now[key]} here" for key in now if key in saved and saved[key] != now[key]
        ]
        if differ:
            raise ConfigError(
                f"the checkpoint was written with other data ({'; '.join(differ)}): its schedule position means "
                "other prompts here. Resume with the run's own data settings (its config.yaml; data.seed follows "
                "--seed_everything), or start a new run from its weights (--model.policy.checkpoint=<run>/hf_export)"
            )

    def load_state_dict(self, state_dict: dict) -> None:
        self._check_source(state_dict.get("source"))
        saved = int(state_dict.get("max_staleness", 0))
        if saved != self.max_staleness:
            raise ConfigError(
                f"the checkpoint was written with data.max_staleness={saved}, this run sets {self.max_staleness}: "
                f"resume with data.max_staleness={saved} (the rollouts it had generated ahead depend on it)"
            )
        schedule = state_dict.get("async_schedule", "fixed")
        if self.max_staleness and schedule != self.async_schedule:
            raise ConfigError(
                f"the checkpoint was written with data.async_schedule={schedule}, this run sets "
                f"{self.async_schedule}: resume with data.async_schedule={schedule}"
            )
        self.schedule.load_state_dict(state_dict)
        if self.max_staleness:
            self._restored = {**state_dict, "ahead": self._own_ahead(state_dict)}
            self._version = int(state_dict["weights_version"]) - 1  # the first push restores the version

    def _own_ahead(self, state_dict: dict) -> list[dict]:
        """This rank's rollouts generated ahead in a checkpoint (see :meth:`state_dict`); a checkpoint whose
        rollouts ahead were shared among another number of ranks is refused (they cannot be re-split)."""
        rank, world_size = self._rank()
        by_rank = state_dict.get("ahead_by_rank", [state_dict["ahead"]])
        if len(by_rank) == world_size:
            return by_rank[rank]
        if not any(by_rank):  # nothing ahead (the free schedule may hold none): any number of ranks resumes
            return []
        raise ConfigError(
            f"the checkpoint holds rollouts generated ahead (data.max_staleness={self.max_staleness}) on "
            f"{len(by_rank)} data-parallel rank(s), each rank's own share of the step's prompts, and this run has "
            f"{world_size}: resume on {len(by_rank)} rank(s) (trainer.devices x trainer.num_nodes)"
        )

    @property
    def iteration(self) -> int:
        """Rollouts produced so far (the schedule's resume counter)."""
        return self.schedule.iteration

    # ---- training stream ----

    def _rank(self) -> tuple[int, int]:
        """``(rank, world_size)`` of data parallelism (``(0, 1)`` outside a Trainer)."""
        trainer = self.trainer
        return (0, 1) if trainer is None else (trainer.global_rank, trainer.world_size)

    def setup(self, stage: str) -> None:
        rank, world_size = self._rank()
        if self.held_out_note is not None and rank == 0:
            print(f"rlkit: {self.held_out_note}", file=sys.stderr)
            self.held_out_note = None  # said once
        if self.prompts_per_step % world_size:
            raise ConfigError(
                f"data.prompts_per_step={self.prompts_per_step} does not split over {world_size} data-parallel "
                f"ranks: make it a multiple of {world_size}"
            )

    def _producer_process(self, producer: GroupProducer) -> ProducerProcess:
        return ProducerProcess(producer, self._encoder(), self.producer_threads, self._rank()[0])

    def _encode(self, index: int, tokenizer=None) -> tuple[Prompt, list[int]]:
        return self._encoder()(index, tokenizer or self.tokenizer)

    def _encoder(self) -> PromptEncoder:
        return PromptEncoder(self.prompts, self.chat_template, self.environment.tool_schemas(), self.max_prompt_length)

    def _check_data(self) -> None:
        """The prompts' count and lengths, their encoding and the validation interval checked against the
        run's settings; every problem found in one ``ConfigError`` (see :mod:`rlkit.rollouts.data_check`).
        With ``long_prompts=skip`` the long prompts are dropped here."""
        trainer = self.trainer
        fitting = trainer is None or trainer.state.fn != "validate"
        problems = []
        steps = self.schedule.steps_per_epoch
        if fitting:
            tools = self.environment.tool_schemas()
            lengths, error = prompt_lengths(self.prompts, self.tokenizer, self.chat_template, tools)
            if error is not None:
                problems.append(encoding_problem(error, "data.prompts"))
                if len(self.prompts) < self.prompts_per_step:
                    problems.append(count_problem(len(self.prompts), self.prompts_per_step))
            else:
                limits = DataLimits(self.prompts_per_step, self.max_prompt_length, self.long_prompts)
                problems += prompt_problems(self.prompts, lengths, limits)
                fit = sum(n <= self.max_prompt_length for n in lengths)
                steps = (fit if self.long_prompts == "skip" else len(lengths)) // self.prompts_per_step
                if not problems and self.long_prompts == "skip" and self.schedule.kept is None:
                    self._drop_long_prompts(lengths)
        if self.held_out is not None and not any(p.startswith("data.prompts: ") for p in problems):
            tools = self.environment.tool_schemas()  # held-out episodes are offered the same tools
            _, error = prompt_lengths(self.held_out.prompts, self.tokenizer, self.chat_template, tools)
            if error is not None:
                problems.append(encoding_problem(error, "data.val_prompts"))
        if fitting and trainer is not None:  # Lightning refuses it with or without a held-out set
            problems.append(val_interval_problem(trainer, steps))
        raise_problems([p for p in problems if p is not None])

    def _drop_long_prompts(self, lengths: list[int]) -> None:
        """Keep the prompts within ``max_prompt_length``; the others are counted, said and logged once."""
        skipped = self.schedule.keep(lambda i: lengths[i] <= self.max_prompt_length)
        trainer = self.trainer
        if skipped and (trainer is None or trainer.is_global_zero):
            print(
                f"rlkit: {skipped} of {len(self.prompts)} prompts are longer than data.max_prompt_length="
                f"{self.max_prompt_length} tokens and are skipped (data.long_prompts=skip)",
                file=sys.stderr,
            )
        if trainer is not None and trainer.logger is not None:
            trainer.logger.log_metrics({"data/skipped_prompts": float(skipped)}, step=0)

    def train_dataloader(self) -> _Stream:
        # sized: Lightning prefetches from an iterable without a length, which would generate rollout k
        # before update k-1 is applied
        return _Stream(self.schedule.steps_per_epoch, self.next_rollout, lambda: self.schedule.position_in_epoch)

    def next_rollout(self) -> Rollout:
        """Produce this rank's groups of the next rollout and collate them."""
        if self.producer is None:
            raise RuntimeError("RolloutDataModule used before attach(): the algorithm module starts the engine")
        if self.ahead is not None:
            rollout = self.ahead.take(self.schedule.iteration)
            self.schedule.iteration += 1
            return rollout
        rank, world_size = self._rank()
        step = self.producer.produce(self.schedule.iteration, rank, world_size, self._version)
        self.schedule.iteration += 1
        return self._collate(step, self.tokenizer)

    def _collate(self, step: ProducedStep, tokenizer) -> Rollout:
        return collate(
            step.groups,
            step.iteration,
            pad_id=tokenizer.pad_token_id,  # load_tokenizer always sets one
            decode=lambda ids: tokenizer.batch_decode(ids, skip_special_tokens=True),
            temperature=self.engine.temperature,
            max_new_tokens=self.environment.response_budget(self.engine.max_new_tokens),
            mask_truncated=self.mask_truncated,
            timings=step.timings,
            stats=step.stats,
        )

    # ---- validation: greedy decoding on held-out prompts ----

    def val_dataloader(self):
        return _LazyList(self.held_out.batches(*self._rank()), self.evaluate) if self.held_out is not None else []

    def held_out_batches(self):
        return self.val_dataloader()

    def evaluate(self, indices: list[int]) -> HeldOutBatch:
        """Greedy completions of the held-out prompts at ``indices``, scored."""
        if self.producer is None:
            raise RuntimeError("RolloutDataModule used before attach(): the algorithm module starts the engine")
        if self.ahead is not None:  # validation sees the latest push, not the thread's version
            self.ahead.refresh(self.engine)
        return self.held_out.evaluate(
            indices,
            self.producer,
            lambda p: encode_prompt(p, self.tokenizer, self.chat_template, tools=self.environment.tool_schemas()),
        )

    def constant_metrics(self) -> frozenset[str]:
        """``reward/errors`` under ``reward_on_error=raise``: a failed call stops the run, so the count is 0."""
        return frozenset({"reward/errors"}) if self.scorer.on_error == "raise" else frozenset()

    def hparams_for_logging(self) -> dict[str, object]:
        """The data-side settings that tell two runs apart (TensorBoard's HPARAMS tab)."""
        group_filter = self.buffer.group_filter
        return {
            "task": self.task,
            "rewards": ",".join(type(fn).__name__ for fn in self.scorer.functions),
            "prompts_per_step": self.prompts_per_step,
            "samples_per_prompt": self.samples_per_prompt,
            "temperature": float(self.engine.temperature),
            "max_new_tokens": int(self.engine.max_new_tokens),
            "engine": type(self.engine).__name__,
            "data_seed": self.seed,
            "group_filter": "none" if group_filter is None else f"{type(group_filter).__name__}({group_filter.metric})",
            "mask_truncated": self.mask_truncated,
            "max_staleness": self.max_staleness,
            "async_producer": self.async_producer,
            "async_schedule": self.async_schedule,
            "partial_rollouts": self.partial_chunk_tokens is not None,
            "partial_chunk_tokens": self.partial_chunk_tokens or 0,  # 0: off
            "reward_workers": self.scorer.workers,
            "environment": type(self.environment).__name__,
        }


class _Stream:
    """A sized iterable over one epoch's rollouts, generated lazily.

    Having a length matters: Lightning prefetches one batch from an iterable without ``__len__``,
    which would generate rollout ``k`` before update ``k-1`` has been applied.
    """

    def __init__(self, length: int, make: Callable, position: Callable) -> None:
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
    # the schedule's checkpointed counter, so there is nothing more to keep here.
    def state_dict(self) -> dict:
        return {"position": self._position()}

    def load_state_dict(self, state_dict: dict) -> None:
        pass


class _LazyList:
    """A sized iterable that calls ``make(item)`` for each item when iterated (validation batches)."""

    def __init__(self, items: list, make: Callable) -> None:
        self._items = items
        self._make = make

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator:
        for item in self._items:
            yield self._make(item)
