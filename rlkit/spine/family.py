"""Family: the typed face every algorithm family plugs into, and the :class:`Spine` it holds.

A family is its loss and what the loss needs. It subclasses :class:`Family`, takes its components as its
own constructor arguments, passes the shared settings on (``**shared``: ``policy``, ``loop``, ``optim``,
``samples_every``, documented here once), declares its arguments with :meth:`Spine.declare` (checked
against what the family and the components provide; recorded for TensorBoard's HPARAMS tab), and writes
``training_step``. Everything else, the Lightning hooks included, is the spine's.

This base class carries implementation, which rlkit's style otherwise avoids: it holds no maths, only
the Lightning hooks every family needs in the same form (model loading, optimizers, callbacks, fit and
validation start). When each family wrote them, the copies drifted (a family renamed its frozen model
and the device placement skipped it); here they cannot.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import ClassVar

import lightning.pytorch as pl
import torch
from torch import Tensor

from rlkit.components.base import BEFORE_UPDATES, Component, Need, all_needs, unmet_needs
from rlkit.components.clip import Clip
from rlkit.components.rollout_correction import RolloutCorrection
from rlkit.data.batch import Rollout
from rlkit.errors import ConfigError
from rlkit.models import describe_checkpoint
from rlkit.resuming import METADATA_KEY, check_weights, metadata
from rlkit.rollouts.source import rollout_source
from rlkit.spine.evaluation import HeldOutEvaluation
from rlkit.spine.loop import LossInputs, MicroStep, PrepareStep, UpdateLoop
from rlkit.spine.metrics import StepMetrics
from rlkit.spine.optim import lightning_optimizers, step_optimizer
from rlkit.spine.policy import Policy, TokenScores, score_rollout
from rlkit.spine.reporting import HParamsRun, StepWriter, rollout_metrics, settings
from rlkit.spine.settings import LoopSettings, Optimization, PolicySettings
from rlkit.spine.sharding import shard_family
from rlkit.spine.sync import WeightSync

#: What the spine computes for any family's components (a critic's values are an actor-critic's own).
SPINE_PROVIDES = frozenset(
    {Need.GREEDY_BASELINES, Need.REWARD_TERMS, Need.OLD_LOGPROBS, Need.SUM_PI_SQUARED, Need.REFERENCE}
)


class OldLogProbs(Enum):
    """Where the ratio's ``log pi_old`` comes from, decided once from the loop and the components' needs."""

    UPDATE_FORWARD = "the update's own forward, detached (one optimizer step per rollout: the ratio is 1)"
    RECOMPUTED = "a no-grad scoring pass of the policy before the updates"
    ENGINE = "the engine's sampling log-probs (a rollout correction in bypass mode)"


def old_logprob_source(loop: UpdateLoop, components: Mapping[str, object]) -> OldLogProbs:
    """:class:`OldLogProbs` for ``loop`` and ``components``; a need bypass mode cannot meet is a config error.

    With one optimizer step per rollout the policy being updated is the one whose log-probs the ratio
    divides by, so the update's own forward gives them (as verl); a pass first is needed with several
    steps per rollout, or when a component reads them before the update (a decoupled rollout correction,
    the optimal token baseline, a covariance selection, the KL penalty in the reward, a critic's values
    from the same pass). In bypass mode the engine's log-probs are the old ones and no pass runs.
    """
    needs = all_needs(components)
    bypass = [name for name, c in components.items() if isinstance(c, RolloutCorrection) and c.bypass]
    if bypass:
        for name, component in components.items():
            if isinstance(component, Component) and Need.SUM_PI_SQUARED in component.needs:
                raise ConfigError(
                    f"model.{name}={type(component).__name__} needs the policy's scoring pass before the update, "
                    f"which bypass mode skips: set model.{bypass[0]}.init_args.bypass=false or choose another {name}"
                )
        return OldLogProbs.ENGINE
    if not loop.on_policy or needs & (BEFORE_UPDATES | {Need.VALUES}):
        return OldLogProbs.RECOMPUTED
    return OldLogProbs.UPDATE_FORWARD


@dataclass
class Step:
    """One training step's bookkeeping: the rollout's own timings plus the phases the family times."""

    rollout: Rollout
    timings: dict[str, float] = field(default_factory=dict)
    _start: float = field(default_factory=time.perf_counter)

    def lap(self, phase: str) -> None:
        """Record the seconds since the last lap (or the step's start) as ``phase``."""
        now = time.perf_counter()
        self.timings[phase] = self.timings.get(phase, 0.0) + now - self._start
        self._start = now


class Spine:
    """The machinery every family shares: the policy's settings and frozen models, the update loop, the
    metrics sink and writer, the components' needs, and the count of rollouts trained on.

    Args:
        policy: the policy's settings.
        loop: the update loop's settings.
        optim: the policy's optimizer, schedule and clipping.
        samples_every: rollouts between two sample tables (TensorBoard's TEXT tab, W&B/MLflow tables,
            samples.jsonl; 0: none).
    """

    def __init__(
        self, policy: PolicySettings, loop: LoopSettings, optim: Optimization, samples_every: int = 10
    ) -> None:
        if samples_every < 0:
            raise ConfigError(f"model.samples_every must be >= 0 (0: no sample tables), got {samples_every}")
        self.policy_settings = policy
        self.loop = UpdateLoop(loop)
        self.optim = optim.check("model.optim")
        self.metrics = StepMetrics()
        self.writer = StepWriter(samples_every)
        self.frozen: dict[str, Policy] = {}  # out of the module's state: never checkpointed, never trained
        self.rollouts_done = 0
        #: each optimizer's lr for the rollout being trained, read before its first optimizer step (logged as ``lr``)
        self.lrs_used: list[float] = []
        self.components: dict[str, Component | None] = {}
        self.settings: dict[str, object] = {}
        self.needs: frozenset[Need] = frozenset()
        self.old_logprobs = OldLogProbs.UPDATE_FORWARD

    # ---- declaration ----

    def declare(self, family: type, provides: frozenset[Need], **arguments) -> None:
        """Record a family's own arguments: components (checked: every need met by ``provides`` or by
        another component, else a one-line config error naming the fix) and scalar settings (HPARAMS)."""
        self.components = {k: v for k, v in arguments.items() if v is None or isinstance(v, Component)}
        self.settings = {k: v for k, v in arguments.items() if k not in self.components}
        for name, component, need in unmet_needs(self.components, provides):
            raise ConfigError(
                f"model.{name}={type(component).__name__} needs {need.value}, which {family.__name__} does not "
                f"provide: {_fix(need, name)}"
            )
        self.needs = all_needs(self.components)
        self.old_logprobs = old_logprob_source(self.loop, self.components)

    # ---- models ----

    def load_policy(self) -> Policy:
        """The policy, and the frozen reference when a component needs one."""
        policy = Policy.from_settings(self.policy_settings, pack=self.loop.pack_sequences)
        if Need.REFERENCE in self.needs:
            self.frozen["reference"] = policy.frozen_copy()
        return policy

    def place_frozen(self, module: pl.LightningModule) -> None:
        """Move the frozen models to the module's device and its policy's dtype."""
        dtype = next(module.policy.parameters()).dtype
        for model in self.frozen.values():
            model.to(device=module.device, dtype=dtype)

    def start_fit(self, module: Family) -> None:
        """Check that every rank holds a row (a group) per mini-batch, move the metric states and frozen
        models to the device, and record the run's settings for TensorBoard's HPARAMS tab."""
        shape = rollout_source(module.trainer).step_shape()
        world = module.trainer.world_size
        self.loop.check_rows(shape.rows_per_rank(world), shape.groups_per_rank(world))
        self.metrics.to(module.device)
        self.place_frozen(module)
        self.writer.constant = self.constant_metrics() | rollout_source(module.trainer).constant_metrics()
        self.writer.hparams_run = HParamsRun(module.logger, module.hparams_for_logging())

    def end_fit(self) -> None:
        """Close the HPARAMS sub-run's writer."""
        if self.writer.hparams_run is not None:
            self.writer.hparams_run.close()

    def constant_metrics(self) -> frozenset[str]:
        """The metrics (names, or ``prefix/``) that cannot move under the run's settings, so are not logged.

        When the update's own forward gives the old log-probs (:class:`OldLogProbs` ``UPDATE_FORWARD``: one
        epoch, one mini-batch, no component reading log-probs before the update, no bypass), ``log pi -
        log pi_old`` is exactly 0: every ratio is 1, ``ratio/approx_kl`` 0, and no clip or trust region can
        be active, so ``ratio/*`` and ``clip/*`` are constant. A clip that never clips (``NoClip``, ``SAPO``,
        ``DRO``: its class says ``clips = False``) has ``clip/*`` at 0 under any settings. A recomputed
        on-policy ratio (a scoring pass first) is kept: it is 1 only up to the two passes' rounding.
        """
        constant: set[str] = set()
        if self.old_logprobs is OldLogProbs.UPDATE_FORWARD:
            constant |= {"ratio/", "clip/"}
        clip = self.components.get("clip")
        if isinstance(clip, Clip) and not clip.clips:
            constant.add("clip/")
        return frozenset(constant)

    # ---- the step ----

    def begin(self, rollout: Rollout) -> Step:
        """Start a training step: its timings begin with the rollout's own (generation, scoring)."""
        return Step(rollout, dict(rollout.timings))

    def old_logprobs_of(self, rollout: Rollout, own: TokenScores | None) -> Tensor | None:
        """The ratio's denominator ``[N, T]`` as :attr:`old_logprobs` says: the scoring pass's, the engine's
        (bypass), or None (the update's own forward gives them, detached)."""
        if self.old_logprobs is OldLogProbs.RECOMPUTED:
            return own.logprobs
        if self.old_logprobs is OldLogProbs.ENGINE:
            return rollout.engine_logprobs
        return None

    def score_before_updates(
        self, module: Family, rollout: Rollout, critic=None
    ) -> tuple[TokenScores | None, dict[str, Tensor]]:
        """The policy's no-grad scores of ``rollout`` before its updates (None unless
        :attr:`old_logprobs` is ``RECOMPUTED``), and by name the frozen models' log-probs (``reference``)
        and, with a ``critic``, its ``values``; in the update loop's micro-batches."""
        own = self.old_logprobs is OldLogProbs.RECOMPUTED
        if not (own or self.frozen or critic is not None):
            return None, {}
        micro_batches = self.loop.micro_rollouts(rollout, torch.arange(len(rollout), device=module.device))
        return score_rollout(
            module.policy,
            rollout,
            micro_batches,
            self.frozen,
            own=own,
            sum_pi_squared=Need.SUM_PI_SQUARED in self.needs,
            critic=critic,
        )

    def update(
        self,
        module: Family,
        rollout: Rollout,
        inputs: LossInputs,
        micro_step: MicroStep,
        optimizer_step: Callable[[], None] | None = None,
        prepare_step: PrepareStep | None = None,
    ) -> None:
        """Every optimizer step of ``rollout`` (see :meth:`~rlkit.spine.loop.UpdateLoop.run`); the default
        ``optimizer_step`` steps the policy's one optimizer."""
        # the lr the steps use: a schedule steps after each optimizer step, so reading it afterwards would log
        # the next step's (0 at the end of a decay to 0)
        self.lrs_used = [optimizer.param_groups[0]["lr"] for optimizer in module.optimizers_list()]
        step = optimizer_step or (lambda: self.step_policy_optimizer(module))
        world = module.trainer.world_size
        self.loop.run(module, rollout, inputs, micro_step, step, self.metrics, world, prepare_step=prepare_step)

    def step_policy_optimizer(self, module: Family) -> None:
        """Clip, step and zero the policy's optimizer and schedule; log ``grad/norm``."""
        norm = step_optimizer(
            module.optimizers(), module.lr_schedulers(), module.policy.parameters(), self.optim.max_grad_norm,
            module.trainer, "model.optim.max_grad_norm",
        )  # fmt: skip
        self.metrics.update("grad/norm", norm)

    def finish(
        self, module: Family, step: Step, advantages: Tensor | None = None, extra: Mapping[str, float] = ()
    ) -> None:
        """Count the rollout as trained on, record its rollout metrics (rewards, lengths, advantages, the
        data side's counters) and write the step's values."""
        rollout = step.rollout
        rollout_metrics(self.metrics, rollout, advantages)
        self.rollouts_done = rollout.iteration + 1
        lr = self.lrs_used[0] if self.lrs_used else module.optimizers_list()[0].param_groups[0]["lr"]
        values = {"lr": lr, **dict(extra)}
        self.writer.write(module, self.metrics, rollout, step.timings, advantages, values)

    # ---- reporting ----

    def hparams(self, module: Family) -> dict[str, object]:
        """Every component and setting that tells two runs apart, for TensorBoard's HPARAMS tab."""
        params: dict[str, object] = {"family": type(module).__name__}
        for name, component in self.components.items():
            params.update(settings(name, component))
        for name, value in self.settings.items():
            params[name] = value if isinstance(value, int | float | bool | str) else str(value)
        trainer = module.trainer
        loop, optim = self.loop, self.optim
        group = trainer.optimizers[0].param_groups[0] if trainer.optimizers else None
        params.update(
            ppo_epochs=loop.ppo_epochs,
            minibatches=loop.minibatches,
            micro_batch_tokens="none" if loop.micro_batch_tokens is None else loop.micro_batch_tokens,
            pack_sequences=loop.pack_sequences,
            max_grad_norm="none" if optim.max_grad_norm is None else optim.max_grad_norm,
            lr=group.get("initial_lr", group["lr"]) if group is not None else "none",
            optimizer=type(trainer.optimizers[0]).__name__ if trainer.optimizers else "none",
            model=describe_checkpoint(self.policy_settings.checkpoint),
            max_steps=trainer.max_steps,
            seed=loop.seed,
            old_logprobs=self.old_logprobs.name.lower(),
        )
        params.update(rollout_source(trainer).hparams_for_logging())
        return params


class Family(pl.LightningModule):
    """Base of algorithm families: a LightningModule whose shared machinery is a :class:`Spine`.

    Args:
        policy: the policy's checkpoint and how its forward runs (``--model.policy.checkpoint=DIR``).
        loop: the update loop: epochs, mini-batches, micro-batches (``--model.loop.minibatches=4``).
        optim: the policy's optimizer, schedule and gradient clipping
            (``--model.optim.optimizer.init_args.lr=3e-4``).
        samples_every: rollouts between two sample tables (a whole group): TensorBoard's TEXT tab, W&B/MLflow tables
            and the run folder's samples.jsonl.
    """

    #: what the family computes for its components (the spine's; an actor-critic adds a critic's values)
    provides: ClassVar[frozenset[Need]] = SPINE_PROVIDES

    def __init__(
        self,
        policy: PolicySettings = PolicySettings(),  # noqa: B008 - frozen dataclasses: safe to share
        loop: LoopSettings = LoopSettings(),  # noqa: B008
        optim: Optimization = Optimization(),  # noqa: B008
        samples_every: int = 10,
    ) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.policy: Policy | None = None
        self.spine = Spine(policy, loop, optim, samples_every)

    # ---- set-up (Lightning hooks) ----

    def configure_model(self) -> None:
        if self.policy is not None:
            return
        self.policy = self.spine.load_policy()
        self.configure_family_models()
        if self._device_mesh is not None:  # Lightning's ModelParallelStrategy: FSDP2
            shard_family(self)

    def configure_family_models(self) -> None:
        """Create the family's own models once the policy is loaded (a critic, a teacher); none by default."""

    def configure_optimizers(self):
        return lightning_optimizers(self.policy.parameters(), self.spine.optim, max_steps=self.trainer.max_steps)

    def configure_callbacks(self) -> list[pl.Callback]:
        """The engine seam and the held-out evaluation, which no run may go without."""
        return [WeightSync(), HeldOutEvaluation()]

    def on_fit_start(self) -> None:
        self.spine.start_fit(self)

    def on_fit_end(self) -> None:
        self.spine.end_fit()

    def on_validation_start(self) -> None:
        self.spine.place_frozen(self)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint[METADATA_KEY] = metadata(self, self.trainer)  # what a resume checks (rlkit.resuming)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        # Called after the models are built and before Lightning copies the weights: a checkpoint of another
        # shape or family is one line here rather than a traceback there. A sharded strategy reads its shards
        # itself (and the module's parameters are shards), so the check is the whole-state strategies'.
        from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

        if isinstance(self.trainer.strategy, SingleDeviceStrategy | DDPStrategy):
            saved = checkpoint.get("state_dict", {})
            check_weights(self.trainer.ckpt_path, saved, self.state_dict(), strict=self.strict_loading)

    def validation_step(self, batch, batch_idx: int):
        return batch  # scored by the data source's engine; HeldOutEvaluation reduces and logs it

    def optimizers_list(self) -> list:
        """The module's optimizers as a list (Lightning returns one optimizer bare)."""
        optimizers = self.optimizers()
        return list(optimizers) if isinstance(optimizers, list | tuple) else [optimizers]

    # ---- what callbacks read ----

    def exported_models(self) -> dict[str, torch.nn.Module]:
        """Trained models exported beside the policy (``hf_export/<name>``); none by default."""
        return {}

    def hparams_for_logging(self) -> dict[str, object]:
        """Every component and setting that tells two runs apart (TensorBoard's HPARAMS tab)."""
        return self.spine.hparams(self)


def _fix(need: Need, name: str) -> str:
    """How to meet ``need`` of the component at ``model.<name>``."""
    if need is Need.VALUES:
        return (
            "use the actor-critic family (configs/algorithms/ppo.yaml, rlkit.algorithms.ActorCritic) or an "
            "outcome estimator such as GroupNorm"
        )
    if need is Need.RATIO:
        return (
            "this clip bounds a ratio around 1: use --model.ratio=TokenRatio, or a clip for log pi "
            "(--model.clip=NoClip for REINFORCE/GPG, or DRO)"
        )
    if need is Need.IS_WEIGHTS:
        return "set model.rollout_correction (not in bypass mode), or the component's use_is_weights=false"
    return f"choose another {name}, or a family that provides it"
