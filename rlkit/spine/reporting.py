"""What every family writes to its logger: rollout metrics, step metrics, samples, hparams and the layout.

The x-axis of every curve, and the step of every text, is the rollout index: ``x = k`` is rollout ``k``
(0 = the rollout sampled before any update), which is also the number of policy updates done before it
was sampled (with ``data.max_staleness=0``). So at ``x = k`` the training values are those of rollout ``k``
and of the update computed from it, and ``val/*`` is the held-out score of the weights after ``k``
updates, the weights that sampled rollout ``k``; the last ``val/*`` point (after the last update) is one
past the last rollout. This holds whatever ``ppo_epochs x minibatches`` make of ``trainer.global_step``.

Values are written straight to the logger: routing ~40 scalars a step through ``self.log`` cost ~40 ms of
Lightning bookkeeping per step, more than the tiny model's whole update; they are still copied to
``trainer.callback_metrics`` (checkpoint monitors and tests read them there).
"""

from __future__ import annotations

import html
import json
import re
from collections import deque
from collections.abc import Mapping
from pathlib import Path

import torch
from lightning.pytorch.utilities import rank_zero_only
from torch import Tensor

from rlkit.components.base import Component
from rlkit.data.batch import Rollout
from rlkit.run_folder import run_dir
from rlkit.spine.metrics import StepMetrics

#: hparams-tab metrics: the final greedy held-out reward and the training reward smoothed over the
#: last rollouts (one noisy batch is no basis for comparing runs).
HPARAM_METRICS = ("hp/val_reward", "hp/train_reward")
SMOOTHING_WINDOW = 10
#: the sub-run of a TensorBoard run that holds its HPARAMS session and metrics (see :class:`HParamsRun`)
HPARAMS_RUN = "hparams"

#: The CUSTOM SCALARS tab: chart title -> candidate tags (``prefix/``: every tag under it, by name), in the
#: order shown. A chart keeps the tags the run logged by the end of its first rollout (the held-out check
#: before any update included), so each family shows what it computes: every ``loss/*`` term (a user's
#: family's own too), a KL chart only with a KL term, penalty or teacher, a trust-region chart only when
#: the ratio can move.
HEADLINE_CHARTS: dict[str, tuple[str, ...]] = {
    "reward (sampled) and held-out reward (greedy)": ("reward/mean", "val/reward"),
    "loss": ("loss/total", "loss/policy", "loss/"),
    "KL": ("loss/kl", "reward/kl_penalty", "distill/kl"),
    "entropy": ("policy/entropy",),
    "response length (tokens)": ("completion/length", "val/length", "completion/length_max"),
    "trust region": ("clip/fraction", "ratio/approx_kl", "clip/selected"),
    "critic": ("value/explained_variance", "value/clip_fraction"),
}
HEADLINE_CATEGORY = "rlkit: what matters"
#: the run folder's file of sample tables, one JSON line per sample (:func:`write_samples`)
SAMPLES_FILE = "samples.jsonl"


def rollout_metrics(metrics: StepMetrics, rollout: Rollout, advantages: Tensor | None = None) -> None:
    """Rewards, completion lengths, advantages (if the family has them) and the data side's counters of one
    rollout (the policy's entropy and the engine/trainer mismatch come from a forward: :func:`forward_metrics`)."""
    mask = rollout.completion_mask.bool()  # [N, T]
    # lengths of what was sampled, also of rows masked out of the loss (data.mask_truncated)
    lengths = rollout.attention_mask[:, -mask.shape[1] :].sum(-1).float()  # [N]
    n = float(len(rollout))
    metrics.update("reward/mean", rollout.scores.mean(), n)
    metrics.update("reward/std", rollout.scores.std() if len(rollout) > 1 else 0.0, n)
    if len(rollout.reward_terms) > 1:  # with one function its curve is reward/mean
        for name, values in rollout.reward_terms.items():
            applies = ~values.isnan()  # [N]: NaN where the function does not apply (returned None)
            if applies.any():
                metrics.update(f"reward/{name}", values[applies].mean(), applies.sum())
    if rollout.baselines is not None:  # ReMax: the reward of each prompt's greedy completion
        metrics.update("reward/greedy_baseline", rollout.baselines.mean(), n)
    metrics.update("completion/length", lengths.mean(), n)
    metrics.update("completion/length_max", lengths.max(), reduce="max")
    metrics.update("completion/truncated_fraction", rollout.truncated.float().mean(), n)
    for name, value in rollout.stats.items():
        metrics.update(name, value)
    if rollout.turn_ids is not None:  # episodes: the reward of those that took n model turns
        turns = rollout.turn_ids.max(-1).values.clamp(min=0) + 1  # [N]
        for n in turns.unique().tolist():
            rows = turns == n  # [N]
            metrics.update(f"episode/reward_by_turns/{n}", rollout.scores[rows].mean(), rows.sum())
    if advantages is None:
        return
    valid = advantages[mask]  # [tokens]
    metrics.update("advantage/mean", valid.mean() if valid.numel() else 0.0, mask.sum())
    metrics.update("advantage/std", valid.std() if valid.numel() > 1 else 0.0, mask.sum())
    metrics.update("advantage/max", valid.max() if valid.numel() else 0.0, reduce="max")
    metrics.update("advantage/min", valid.min() if valid.numel() else 0.0, reduce="min")
    # Lengths of completions pushed up / down (the sign of their advantage): the length bias of
    # GRPO's per-sequence normalisation shows as growing negative-advantage completions (Liu et al. 2025).
    sequence_advantage = (advantages * rollout.completion_mask).sum(-1) / lengths.clamp(min=1)  # [N]
    for name, rows in (("pos_adv", sequence_advantage > 0), ("neg_adv", sequence_advantage < 0)):
        if rows.any():
            metrics.update(f"completion/length_{name}", lengths[rows].mean(), rows.sum())


def forward_metrics(
    metrics: StepMetrics, mask: Tensor, engine_logprobs: Tensor, entropy: Tensor, raw_logprobs: Tensor
) -> None:
    """The policy's entropy and the engine/trainer mismatch over the valid tokens of ``mask [n, T]``.

    Token-weighted (and a maximum), so rows scored in several micro-batches add up to the whole rollout.
    ``raw_logprobs`` are the trainer's untempered log-probs, what engines report.
    """
    valid = mask.bool()  # [n, T]
    tokens = valid.sum()
    if not tokens:
        return
    metrics.update("policy/entropy", entropy[valid].mean(), tokens)
    diff = engine_logprobs[valid] - raw_logprobs[valid]  # [tokens]
    metrics.update("mismatch/logprob_abs_diff", diff.abs().mean(), tokens)
    metrics.update("mismatch/logprob_abs_diff_max", diff.abs().max(), reduce="max")
    # k3 estimate of KL(engine || trainer) on the engine's samples
    metrics.update("mismatch/kl", (torch.exp(-diff) - 1 + diff).mean(), tokens)


def group_rows(rollout: Rollout, advantages: Tensor | None = None) -> list[dict]:
    """One whole group as rows: each completion with its prompt, tokens, reward (and advantage, if any).

    The group shown is the one whose rewards vary most (ties: the first): a group where every completion
    scored the same teaches nothing and shows nothing.
    """
    ids = rollout.group_ids  # [N]
    spread = [(rollout.scores[ids == g].float().std(correction=0).item(), -k) for k, g in enumerate(ids.unique())]
    chosen = ids.unique()[-max(spread)[1]]
    lengths = rollout.completion_mask.sum(-1)  # [N]
    if advantages is not None:
        sequence_advantage = (advantages * rollout.completion_mask).sum(-1) / lengths.clamp(min=1)  # [N]
    rows = []
    for i in (ids == chosen).nonzero().flatten().tolist():
        row = {
            "rollout": rollout.iteration,
            "prompt": rollout.prompt_texts[i],
            "completion": rollout.texts[i],
            "tokens": int(lengths[i]),
            "reward": rollout.scores[i].item(),
        }
        if advantages is not None:
            row["advantage"] = sequence_advantage[i].item()
        rows.append(row)
    return rows


def group_sample(rollout: Rollout, advantages: Tensor | None = None) -> str:
    """:func:`group_rows` as a markdown table (TensorBoard's TEXT tab)."""
    rows = group_rows(rollout, advantages)
    signed = "advantage" in rows[0]
    lines = [
        f"rollout {rollout.iteration}, prompt `{_code(rows[0]['prompt'])}`",
        "",
        "| # | completion | tokens | reward |" + (" advantage |" if signed else ""),
        "|---|---|---|---|" + ("---|" if signed else ""),
    ]
    for k, row in enumerate(rows):
        line = f"| {k} | `{_code(row['completion'])}` | {row['tokens']} | {row['reward']:.3g} |"
        if signed:
            line += f" {row['advantage']:+.3g} |"
        lines.append(line)
    return "\n".join(lines)


def _code(text: str) -> str:
    return html.escape(text.replace("\n", "⏎").replace("|", "\\|").replace("`", "'"))


def write_scalars(module, values: Mapping[str, float], step: int) -> None:
    """Log ``values`` at ``step`` and make them visible in ``trainer.callback_metrics``."""
    module.trainer.callback_metrics.update({name: torch.tensor(value) for name, value in values.items()})
    if module.logger is not None:
        module.logger.log_metrics(dict(values), step=step)


def write_text(module, tag: str, text: str, step: int) -> None:
    """``text`` (markdown) in TensorBoard's TEXT tab; other loggers get tables (:func:`write_samples`)."""
    experiment = getattr(module.logger, "experiment", None)
    if module.trainer.is_global_zero and hasattr(experiment, "add_text"):
        experiment.add_text(tag, text, step)


def write_histogram(logger, tag: str, values: Tensor, step: int) -> None:
    """``values`` as a histogram at ``step``: TensorBoard's HISTOGRAMS and DISTRIBUTIONS tabs; a logger
    without histograms (CSV, none) is skipped quietly."""
    experiment = getattr(logger, "experiment", None)
    if hasattr(experiment, "add_histogram"):
        experiment.add_histogram(tag, values, step)


def headline_layout(logged) -> dict[str, dict[str, list]]:
    """The CUSTOM SCALARS layout of :data:`HEADLINE_CHARTS` restricted to the ``logged`` tags (charts left
    empty are dropped), in the form of ``SummaryWriter.add_custom_scalars``; tags are anchored regexes."""
    charts = {}
    for title, candidates in HEADLINE_CHARTS.items():
        tags: list[str] = []
        for candidate in candidates:
            found = sorted(t for t in logged if t.startswith(candidate)) if candidate.endswith("/") else [candidate]
            tags += [tag for tag in found if tag in logged and tag not in tags]
        if tags:
            charts[title] = ["Multiline", [f"^{re.escape(tag)}$" for tag in tags]]
    return {HEADLINE_CATEGORY: charts} if charts else {}


def write_samples(module, tag: str, rows: list[dict], step: int) -> None:
    """A sample table at ``step`` (rollouts trained on), for any logger or none.

    Every row goes to ``<run folder>/samples.jsonl`` as one JSON line, ``{"table": tag, "step": step, **row}``
    (:func:`rlkit.run_folder.run_dir`); a logger that takes tables gets the table too: W&B as ``tag``
    (``WandbLogger.log_table``), MLflow as the artifact ``<tag>/step_<step>.json`` (``MlflowClient.log_dict``:
    ``{"columns": [...], "data": [[...], ...]}``). TensorBoard's markdown copy is :func:`write_text`'s.
    """
    if not rows or not module.trainer.is_global_zero:
        return
    path = run_dir(module.trainer) / SAMPLES_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as file:
        file.writelines(json.dumps({"table": tag, "step": step, **row}) + "\n" for row in rows)
    from lightning.pytorch.loggers import MLFlowLogger, WandbLogger

    logger = module.logger
    columns = ["step", *rows[0]]
    data = [[step, *row.values()] for row in rows]
    if isinstance(logger, WandbLogger):
        logger.log_table(key=tag, columns=columns, data=data, step=step)
    elif isinstance(logger, MLFlowLogger):  # log_dict: MLflow's log_table needs pandas
        table = {"columns": columns, "data": data}
        logger.experiment.log_dict(logger.run_id, table, artifact_file=f"{tag}/step_{step:06d}.json")


def write_layout(module, logged) -> None:
    """Write :func:`headline_layout` (TensorBoard only; rank zero), so CUSTOM SCALARS opens on it."""
    experiment = getattr(module.logger, "experiment", None)
    layout = headline_layout(logged)
    if module.trainer.is_global_zero and layout and hasattr(experiment, "add_custom_scalars"):
        experiment.add_custom_scalars(layout)


class HParamsRun:
    """The run's HPARAMS session: its settings and :data:`HPARAM_METRICS`, in the sub-run ``<run>/hparams``.

    TensorBoard builds the HPARAMS table from one run's experiment summary when any run has one (it picks
    the first): then the columns are that run's settings only (an ablated component's own settings,
    absent there, are no columns), none is marked as differing, and the page shows the first five by
    name. Without an experiment summary it takes the union over all runs' session starts and shows first
    what differs between them (a seed, the varied component and its settings), but it then counts every
    scalar of a session's run as a metric. So only the session start is written, in a sub-run that holds
    nothing but the two metrics: the table's columns are every setting of every run, its metric columns
    are exactly ``hp/val_reward`` (the last held-out score) and ``hp/train_reward``, and the main run's
    SCALARS page holds no copy of ``val/reward``. With another logger, ``log_hyperparams(params)`` and the
    metrics go to it as scalars.

    Args:
        logger: the trainer's logger (None: nothing is written).
        params: the run's settings (:meth:`Family.hparams_for_logging`).
    """

    def __init__(self, logger, params: dict[str, object]) -> None:
        from lightning.pytorch.loggers import TensorBoardLogger

        self.logger = logger if rank_zero_only.rank == 0 else None
        self.writer = None
        self.tensorboard = isinstance(logger, TensorBoardLogger)
        if self.logger is None:
            return
        if not self.tensorboard:
            logger.log_hyperparams(params)
            return
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        logger.hparams.update(params)  # hparams.yaml
        self.writer = SummaryWriter(str(Path(logger.log_dir) / HPARAMS_RUN))
        _, start, end = hparams(params, dict.fromkeys(HPARAM_METRICS, 0.0))  # no experiment summary
        file_writer = self.writer._get_file_writer()
        for summary in (start, end):
            file_writer.add_summary(summary)
        self.writer.flush()

    def log(self, values: Mapping[str, float], step: int) -> None:
        """Write the :data:`HPARAM_METRICS` among ``values`` at ``step``."""
        metrics = {name: value for name, value in values.items() if name in HPARAM_METRICS}
        if not metrics or self.logger is None:
            return
        if not self.tensorboard:
            self.logger.log_metrics(metrics, step=step)
            return
        if self.writer is None:  # closed: a check after the fit (trainer.validate) is no HPARAMS metric
            return
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def settings(prefix: str, component) -> dict[str, object]:
    """``{prefix: ClassName, prefix.attr: value}`` for a component's scalar settings, nested components
    (a user's included) expanded under ``prefix.attr``."""
    if component is None:
        return {prefix: "none"}
    out: dict[str, object] = {prefix: type(component).__name__}
    for attr, value in vars(component).items():
        if attr.startswith("_") or attr in ("needs", "provides"):
            continue
        if value is None:
            out[f"{prefix}.{attr}"] = "none"
        elif isinstance(value, int | float | bool | str):
            out[f"{prefix}.{attr}"] = value
        elif isinstance(value, Component):  # a nested component (an estimator, a controller)
            out.update(settings(f"{prefix}.{attr}", value))
    return out


class StepWriter:
    """Writes a training step: the metrics sink's values, timings (seconds), throughput, samples.

    Metrics that cannot move under the run's settings (:meth:`~rlkit.spine.family.Spine.constant_metrics`)
    are left out; the first rollout also writes the CUSTOM SCALARS layout.

    Args:
        samples_every: rollouts between two sample tables (TensorBoard's TEXT tab, a W&B/MLflow table and
            ``samples.jsonl`` in the run folder; 0: none).
    """

    def __init__(self, samples_every: int = 10) -> None:
        self.samples_every = samples_every
        self._recent_rewards: deque[float] = deque(maxlen=SMOOTHING_WINDOW)
        #: names (or ``prefix/`` prefixes) of the metrics not written: constant by construction
        self.constant: frozenset[str] = frozenset()
        self.hparams_run: HParamsRun | None = None

    def moves(self, name: str) -> bool:
        """Whether ``name`` can move under the run's settings (is not in :attr:`constant`)."""
        return not any(name == c or (c.endswith("/") and name.startswith(c)) for c in self.constant)

    def write(
        self,
        module,
        metrics: StepMetrics,
        rollout: Rollout,
        timings: Mapping[str, float],
        advantages: Tensor | None,
        extra: Mapping[str, float] = (),
    ) -> dict[str, float]:
        """Compute (collective) and log this rollout's step values at ``rollout.iteration``."""
        values = {name: value.item() for name, value in metrics.compute(exclude="val/").items()}
        total = sum(timings.values())
        values.update({f"time/{name}_s": seconds for name, seconds in timings.items()})
        values["time/step_s"] = total
        tokens = rollout.completion_mask.sum().item()
        values["perf/rollout_tokens_per_s"] = tokens / max(timings.get("generate", 0.0), 1e-9)
        values["perf/tokens_per_s"] = tokens / max(total, 1e-9)
        values.update(extra)
        values = {name: value for name, value in values.items() if self.moves(name)}
        step = rollout.iteration
        hp = {}
        if "reward/mean" in values:
            self._recent_rewards.append(values["reward/mean"])
            hp["hp/train_reward"] = sum(self._recent_rewards) / len(self._recent_rewards)
        module.trainer.callback_metrics.update({name: torch.tensor(v) for name, v in {**values, **hp}.items()})
        if rollout.iteration % max(module.trainer.log_every_n_steps, 1) == 0:
            write_scalars(module, values, step)
            if self.hparams_run is not None:
                self.hparams_run.log(hp, step)
        if rollout.iteration == 0:  # what the run logs is known now (the held-out check ran before it)
            write_layout(module, set(module.trainer.callback_metrics))
        if self.samples_every and rollout.iteration % self.samples_every == 0:
            write_text(module, "samples", group_sample(rollout, advantages), step)
            write_samples(module, "samples", group_rows(rollout, advantages), step)
        values.update(hp)
        if "reward/mean" not in values:
            return values
        module.trainer.callback_metrics["reward"] = torch.tensor(values["reward/mean"])
        if module.trainer.progress_bar_callback is not None:  # Lightning's logging bookkeeping: ~1 ms a step
            module.log(
                "reward", values["reward/mean"], prog_bar=True, on_step=True, logger=False, batch_size=len(rollout)
            )
        return values
