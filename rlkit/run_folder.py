"""A run's folder, whatever the logger: ``<root>/<name>/version_N`` holds ``config.yaml``, ``checkpoints/``,
``hf_export/`` and ``samples.jsonl``.

TensorBoard's and the CSV logger's ``log_dir`` is such a folder (``<save_dir>/<name>/version_N``), and
Lightning puts checkpoints and ``config.yaml`` in it: with them rlkit changes nothing. Any other logger
(``WandbLogger``, ``MLFlowLogger``, ...) or none (``--trainer.logger=false``) gets the same folder from
:func:`place_run`: under the ``save_dir`` given to the logger (``<trainer.default_root_dir>/runs`` when the logger
has none or keeps its class's default), named by the run's name, in the next free ``version_N`` (or the resumed
one). The
logger's ``save_dir`` is then pointed at that folder (W&B writes ``<folder>/wandb/``, an MLflow file store
is ``<folder>/mlruns``), ``trainer.default_root_dir`` is the folder (:func:`run_dir`; ``config.yaml`` is written
there), and every ``ModelCheckpoint`` without a ``dirpath`` writes to ``<folder>/checkpoints``, so
``--ckpt_path=last`` finds it as it finds TensorBoard's.
"""

from __future__ import annotations

import inspect
from pathlib import Path

from rlkit.runs import _import as _class  # a class by its path, or None

#: the run-name option of loggers that take one, in the order looked for (MLflow's is ``run_name``)
NAME_KEYS = ("name", "run_name")


def logger_config(trainer_config):
    """The run's logger in the trainer's config (the first of a list, as Lightning's ``trainer.logger``), or None."""
    logger = trainer_config.get("logger")
    if isinstance(logger, list):
        logger = logger[0] if logger else None
    return logger if getattr(logger, "class_path", None) else None


def keeps_own_folder(logger_class) -> bool:
    """Whether a logger class lays its logs out as a run folder itself (TensorBoard, CSV)."""
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    return isinstance(logger_class, type) and issubclass(logger_class, TensorBoardLogger | CSVLogger)


def name_key(logger) -> str | None:
    """The logger's run-name option (``name``, MLflow's ``run_name``), or None if it takes none."""
    init_args = getattr(logger, "init_args", None)
    return next((key for key in NAME_KEYS if init_args is not None and key in init_args), None)


def runs_root(trainer_config) -> Path:
    """Where runs of every name live: the logger's ``save_dir``, unless it is that logger class's own default
    (``.`` for W&B, ``./mlruns`` for MLflow) or there is none; then ``<trainer.default_root_dir>/runs``."""
    logger = logger_config(trainer_config)
    init_args = getattr(logger, "init_args", None)
    save_dir = init_args.get("save_dir") if init_args is not None else None
    if save_dir:
        cls = _class(logger.class_path)
        parameter = inspect.signature(cls).parameters.get("save_dir") if cls is not None else None
        if keeps_own_folder(cls) or parameter is None or save_dir != parameter.default:
            return Path(save_dir)
    return Path(trainer_config.get("default_root_dir") or ".") / "runs"


def store_subfolder(logger_class) -> str:
    """Where in the run folder a logger's ``save_dir`` goes: ``mlruns`` for MLflow, whose file store reads every
    folder beside its experiments as a broken experiment (``checkpoints/``, ``hf_export/``); the folder itself
    for the others (W&B makes its own ``wandb/``)."""
    from lightning.pytorch.loggers import MLFlowLogger

    return "mlruns" if isinstance(logger_class, type) and issubclass(logger_class, MLFlowLogger) else ""


def next_version(runs: Path) -> str:
    """The first unused ``version_N`` under ``runs`` (one more than the largest), as TensorBoardLogger counts."""
    numbers = [int(p.name[8:]) for p in runs.glob("version_*") if p.is_dir() and p.name[8:].isdigit()]
    return f"version_{max(numbers, default=-1) + 1}"


def place_run(trainer_config, runs: Path, version: str | None) -> Path | None:
    """Point a logger that does not keep its own run folder, the trainer and the checkpoints at ``runs/version``
    (``version``: the resumed one, or None for the next free one). Returns that folder; None for TensorBoard and
    CSV loggers, whose ``log_dir`` is the run folder already."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    logger = logger_config(trainer_config)
    if trainer_config.get("logger") is True or (logger is not None and keeps_own_folder(_class(logger.class_path))):
        return None  # `logger: true` is Lightning's own TensorBoardLogger
    folder = runs / (version or next_version(runs))
    if logger is not None and "save_dir" in logger.init_args:
        logger.init_args.save_dir = str(folder / store_subfolder(_class(logger.class_path)))
    trainer_config.default_root_dir = str(folder)
    callbacks = trainer_config.get("callbacks") or []
    for callback in callbacks if isinstance(callbacks, list) else [callbacks]:
        init_args = getattr(callback, "init_args", None)
        cls = _class(callback.class_path) if init_args is not None else None
        if isinstance(cls, type) and issubclass(cls, ModelCheckpoint):
            if not init_args.get("dirpath"):
                init_args.dirpath = str(folder / "checkpoints")
    return folder


def run_dir(trainer) -> Path:
    """The run's folder during and after ``fit``: the TensorBoard or CSV logger's ``log_dir``, else
    ``trainer.default_root_dir`` (where :func:`place_run` put the run). Not ``trainer.log_dir``: that is a
    collective (rank 0 alone may ask here), and for other loggers it is their ``save_dir``, None for an MLflow
    server."""
    logger = trainer.logger
    return Path(logger.log_dir) if keeps_own_folder(type(logger)) else Path(trainer.default_root_dir)
