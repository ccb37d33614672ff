"""The ``rlkit`` command: a LightningCLI with ``fit`` and ``validate``.

Examples::

    rlkit fit --config experiments/drgrpo.yaml
    rlkit fit --config experiments/drgrpo.yaml --model.advantage=GroupNorm
    rlkit fit --config experiments/drgrpo.yaml --print_config
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import warnings
from pathlib import Path

# Registers every class with jsonargparse, so short names (`GroupMean`, `VLLMEngine`) resolve.
import rlkit.components  # noqa: F401
import rlkit.data.prompts  # noqa: F401
import rlkit.embedded  # noqa: F401  (the demo's task and model sources, by short name)
import rlkit.engines.hf  # noqa: F401
import rlkit.engines.vllm  # noqa: F401  (imports vllm only when the engine starts)
import rlkit.rewards  # noqa: F401
import rlkit.rollouts  # noqa: F401
import rlkit.schedules  # noqa: F401
from rlkit.errors import ConfigError, RLKitError
from rlkit.runs import (
    expand_config_defaults,
    experiment_name,
    explain_parser_error,
    import_user_modules,
    nulls_as_configs,
    run_name_suffix,
)
from rlkit.signals import Interrupted

SUBCOMMANDS = ("fit", "validate")
#: A run's name when neither the config nor the command line names it (otherwise: the experiment's file name)
DEFAULT_RUN_NAME = "rlkit"
#: Commands outside LightningCLI (plain argparse): name -> "module:function", called with the rest of argv.
TOOLS = {
    "ablate": "rlkit.studies.commands:ablate",
    "compare": "rlkit.studies.commands:compare",
    "data": "rlkit.data.prepare:main",
    "model": "rlkit.model_presets:main",
    "presets": "rlkit.presets:main",
}

HELP = """\
rlkit: reinforcement-learning post-training of language models (GRPO, Dr.GRPO, GSPO, DAPO, PPO, ...)
as compositions of one-flag components, on PyTorch Lightning.

Start with:
  rlkit fit --config experiments/drgrpo.yaml                             train the embedded CPU default
  rlkit fit --config experiments/drgrpo.yaml --model.advantage=GroupNorm ablate one component
  tensorboard --logdir runs                                              compare the runs

Commands:
  fit        train (options: rlkit fit --help; everything resolved: --print_config)
  validate   score held-out prompts greedily (--ckpt_path=... for a checkpoint)
  ablate     run a study: --vary KEY=V1,V2 over seeds, each variant as its own run, then compare them
  compare    summarise a study's runs: summary.md, summary.csv, reward.png
  data       convert a local GSM8K / MATH file into the prompt layout (rlkit data --help)
  model      build a model of real shape locally (rlkit model list; rlkit model build --preset qwen2-small DIR)
  presets    list the configs that ship with rlkit, by name (rlkit fit --config drgrpo --config trainer/cpu)

Every option is a config key: --model.* (the algorithm and its components; the settings every family
shares under --model.policy.*, --model.loop.*, --model.optim.*), --data.* (prompts, engine, rewards),
--trainer.* (Lightning's Trainer). Resume a run with --ckpt_path=last. Your own components and families:
--imports=[my_package.module] (or `imports:` in a config) makes their short names resolve.
"""

#: the first lines of ``rlkit fit --help``: where the options that are not the Trainer's are
FIT_HELP = """

Start from a preset (rlkit presets lists them): rlkit fit --config drgrpo [--config trainer/cpu].
The algorithm's and the data's options are not listed below (they depend on the classes chosen):
  rlkit fit --model.help PolicyGradient          a family's options (--model.*)
  rlkit fit --data.help RolloutDataModule        the data module's (--data.*: prompts, engine, rewards)
  rlkit fit --config drgrpo --print_config       every value a preset resolves to
The Trainer's options (--trainer.*) follow."""

#: what ``rlkit fit`` without a config says instead of the parser's list of required keys
NO_CONFIG = (
    "no --config given: a run needs a model (an algorithm family), a data module (prompts, engine, rewards) and a "
    "trainer; start from a preset, e.g. `rlkit fit --config drgrpo` (the embedded CPU task: no GPU, no download), "
    "and override what you change; `rlkit presets` lists them"
)


class ParserError(BaseException):
    """A parser error under ``build_cli(raise_parser_errors=True)``: its one-line message, as ``rlkit`` prints
    it. A ``BaseException``, as the ``SystemExit`` it replaces, so no ``except ValueError`` inside the parser
    swallows it; :func:`rlkit.fit` turns it into a ``ConfigError``."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def _concise(error: Exception) -> str:
    """The component's own message out of jsonargparse's report on a failed Union/subclass value."""
    reasons = [
        line.strip()[2:]
        for line in str(error).splitlines()
        if line.strip().startswith("- ") and "NoneType" not in line and "Expected a" not in line
    ]
    return reasons[0] if reasons else str(error).splitlines()[0]


def _cause(error: BaseException, kind: type[BaseException] = RLKitError) -> BaseException | None:
    """The rlkit error (or other ``kind``) a chain of wrapped exceptions started from, if any."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, kind):
            return error
        seen.add(id(error))
        # `raise ... from None` hides the context: an error that chose its own message keeps it
        error = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
    return None


def _lightning_checkpoint_name(ckpt_path) -> bool:
    """``last``, ``best``, ... (names Lightning resolves itself) or a remote path: no local file to check."""
    return str(ckpt_path) in ("last", "best", "hpc") or str(ckpt_path).startswith("registry") or "://" in str(ckpt_path)


def _import_lightning_cli():
    from lightning.pytorch.callbacks import ProgressBar
    from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback

    from rlkit.callbacks import RunFiles, finish_logger_run
    from rlkit.progress import RolloutProgressBar
    from rlkit.resuming import check_family, check_sharded_folder, check_world_size, read_checkpoint
    from rlkit.run_folder import NAME_KEYS, keeps_own_folder, logger_config, name_key, place_run, run_dir, runs_root
    from rlkit.runs import purge_resumed_steps, resolve_resume
    from rlkit.signals import StopOnSignal

    class SaveConfigOnFitStart(SaveConfigCallback):
        """Lightning's ``config.yaml`` writer, which during ``fit`` writes at ``on_fit_start`` instead of
        ``setup``: after a resumed checkpoint was checked against the model (``on_load_checkpoint``), so a
        refused resume leaves the run's own ``config.yaml`` as it was. With a logger that does not keep its own
        run folder (W&B, MLflow, none) it writes to rlkit's (``rlkit.run_folder.run_dir``), not to
        ``trainer.log_dir`` (the logger's ``save_dir``: W&B's, or None for an MLflow server)."""

        def setup(self, trainer, pl_module, stage: str) -> None:
            if stage != "fit":
                self.save_to_log_dir = keeps_own_folder(type(trainer.logger))
                super().setup(trainer, pl_module, stage)

        def on_fit_start(self, trainer, pl_module) -> None:
            self.save_to_log_dir = keeps_own_folder(type(trainer.logger))
            super().setup(trainer, pl_module, "fit")

        def save_config(self, trainer, pl_module, stage: str) -> None:
            if self.save_to_log_dir:
                return  # written by Lightning, to the TensorBoard or CSV logger's log_dir
            folder = run_dir(trainer)  # rank 0 only: Lightning calls this there
            folder.mkdir(parents=True, exist_ok=True)
            path = str(folder / self.config_filename)
            self.parser.save(self.config, path, skip_none=False, overwrite=self.overwrite, multifile=self.multifile)

    class ExactOptionsParser(LightningArgumentParser):
        """A parser that never expands an abbreviated option. jsonargparse builds the parsers of nested
        settings (``--model.loop.*``) with the parent's class and default arguments, so without this
        ``--model.loop.ppo_epoch=2`` would silently be read as ``ppo_epochs``."""

        def __init__(self, *args, **kwargs) -> None:
            kwargs.setdefault("allow_abbrev", False)
            super().__init__(*args, **kwargs)

    class RLKitCLI(LightningCLI):
        """LightningCLI with rlkit's subcommands, parser settings, run folders and messages."""

        raise_parser_errors = False  # True: a bad value raises ParserError instead of printing it and exiting

        @staticmethod
        def subcommands() -> dict[str, set[str]]:
            return {name: LightningCLI.subcommands()[name] for name in SUBCOMMANDS}

        def init_parser(self, **kwargs):
            kwargs["description"] = HELP.splitlines()[0]
            parser = super().init_parser(**kwargs)
            full_help = parser.format_help

            def format_help() -> str:
                # the usage of every option would be hundreds of lines; argparse prints a given usage as it
                # is (the description is reflowed), so the pointers to the other options go there
                parser.usage = "rlkit {fit,validate} --config FILE|PRESET [--key=value ...]" + FIT_HELP
                try:
                    return full_help()
                finally:
                    parser.usage = None

            parser.format_help = format_help
            # On a bad value jsonargparse prints the whole usage (hundreds of options) before the
            # error; a one-line usage keeps the error itself on screen.
            parser.format_usage = lambda: "usage: rlkit {fit,validate} --config FILE [--key=value ...]\n"
            report = parser.error

            def error(message: str, ex: Exception | None = None):
                configs = [a for a in self.args_given if a in ("--config", "-c") or a.startswith("--config=")]
                if "required" in message and not configs:
                    message = NO_CONFIG
                if self.raise_parser_errors:  # rlkit.fit: the message the command line prints, as an exception
                    raise ParserError(explain_parser_error(message)) from ex
                report(explain_parser_error(message), ex)

            parser.error = error
            return parser

        def add_arguments_to_parser(self, parser) -> None:
            parser.add_argument(
                "--imports",
                type=list[str],
                default=[],
                help="Python modules to import before parsing, so your own components, families and data "
                "modules resolve by short name (e.g. [my_package.rewards]).",
            )
            parser.set_defaults(
                {
                    "data": {"class_path": "rlkit.rollouts.RolloutDataModule"},
                    "trainer.logger": {
                        "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                        "init_args": {"save_dir": "runs", "name": DEFAULT_RUN_NAME},
                    },
                    # checkpoints are written atomically (see rlkit.checkpointing)
                    "trainer.plugins": [{"class_path": "rlkit.checkpointing.AtomicCheckpointIO"}],
                }
            )

        def _parse_ckpt_path(self) -> None:
            # Lightning reads the whole checkpoint here (its hyper-parameters), and a file that is none ends
            # in torch's traceback: check it first, reading only its index (rlkit.resuming.read_checkpoint).
            subcommand = self.config.get("subcommand")
            ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
            if ckpt_path and not _lightning_checkpoint_name(ckpt_path) and not Path(ckpt_path).is_dir():
                if "hyper_parameters" not in read_checkpoint(ckpt_path):
                    return  # rlkit's families save none: nothing for Lightning to read
            super()._parse_ckpt_path()

        def before_instantiate_classes(self) -> None:
            # every run, whatever its logger, gets rlkit's name and folder (rlkit.run_folder)
            config = self.config[self.subcommand] if self.subcommand else self.config
            logger = logger_config(config.trainer)
            key = name_key(logger)
            name = self.run_name(logger.init_args.get(key) if key else None)
            if key:
                logger.init_args[key] = name
            runs = runs_root(config.trainer) / name
            version = resolve_resume(config, runs) if self.subcommand == "fit" else None
            if place_run(config.trainer, runs, version) is None and version is not None:
                logger.init_args.version = version  # TensorBoard, CSV: their log_dir is the run folder

        def run_name(self, given: str | None) -> str:
            """The logger's name if the config gives one, else the experiment's; then what the command line
            changed (unless it names the run itself): ``drgrpo/advantage=GroupNorm``."""
            name = given if given not in (None, DEFAULT_RUN_NAME) else experiment_name(self.args_given)
            name = name or DEFAULT_RUN_NAME
            suffix = run_name_suffix(self.args_given)
            named = any(f"init_args.{k}" in " ".join(self.args_given) for k in NAME_KEYS)
            return f"{name}/{suffix}" if suffix and not named else name

        def instantiate_classes(self) -> None:
            # A component that rejects its hyper-parameters raises ValueError at construction: that is
            # a usage error (exit 2), reported in one line rather than as a traceback.
            try:
                super().instantiate_classes()
            except RLKitError:
                raise
            except (ValueError, TypeError) as error:
                cause = _cause(error)
                if cause is not None:  # jsonargparse wrapped a class's own one-line error: report that
                    raise cause from error
                missing = _cause(error, ModuleNotFoundError)  # e.g. a logger's: Lightning's hint names it
                if missing is not None:
                    raise ConfigError(f"a package the configuration needs is not installed: {missing}") from error
                raise ConfigError(f"invalid configuration: {_concise(error)}") from error

        def _instantiate_trainer(self, config, callbacks):
            callbacks = [*callbacks, RunFiles(), StopOnSignal()]
            given = config.get("callbacks") or []
            given = given if isinstance(given, list) else [given]
            if config.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in given):
                callbacks.append(RolloutProgressBar())
            return super()._instantiate_trainer(config, callbacks)

        save_config_class = SaveConfigOnFitStart

        def before_fit(self) -> None:
            self.check_resume(self.config_init["fit"].get("ckpt_path"))
            purge_resumed_steps(self.trainer.logger, self.config_init["fit"].get("ckpt_path"))

        def before_validate(self) -> None:
            self.check_resume(self.config_init["validate"].get("ckpt_path"))

        def check_resume(self, ckpt_path) -> None:
            """The checkpoint is one, of this family, for this strategy (rlkit.resuming): before the Trainer
            starts; its weights' names and shapes are checked once the model is built (Family.on_load_checkpoint)."""
            if not ckpt_path or _lightning_checkpoint_name(ckpt_path):
                return  # resolve_resume has made `last` a path when one exists
            if check_sharded_folder(ckpt_path, self.trainer):
                return
            state = read_checkpoint(ckpt_path)
            check_family(ckpt_path, state, self.model)
            check_world_size(ckpt_path, state, self.trainer)

        def after_fit(self) -> None:
            for callback in self.trainer.callbacks:
                if isinstance(callback, RunFiles):
                    callback.print_summary(self.trainer)
            finish_logger_run(self.trainer.logger)

    return RLKitCLI, ExactOptionsParser


# Lightning warns that checkpoints of manual optimization hold the state after the step: that is
# exactly what rlkit wants (the data side's counter has advanced with it).
warnings.filterwarnings("ignore", message=".*Using ModelCheckpoint with manual optimization.*")
warnings.filterwarnings("ignore", message=".*treespec, LeafSpec.*")
# rlkit puts each run in its own version folder and resumes into it on purpose
warnings.filterwarnings("ignore", message=".*Checkpoint directory .* exists and is not empty.*")
# `rlkit validate --ckpt_path=...` logs into a new version folder; the checkpoint callback's state is moot there
warnings.filterwarnings("ignore", message=".*The dirpath has changed from.*")
# build_cli passes the command line with experiments' `defaults:` expanded, i.e. always as `args`
warnings.filterwarnings("ignore", message=".*LightningCLI's args parameter is intended to run from within Python.*")


class _DropTips(logging.Filter):
    """Lightning's start-up advertisement ("Tip: ... litlogger") is noise in rlkit's output."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "litlogger" not in record.getMessage()


logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_DropTips())


def build_cli(args: list[str] | None = None, run: bool = True, raise_parser_errors: bool = False):
    """The configured CLI object (``run=False``: parse and instantiate only, for tests and tools;
    ``raise_parser_errors``: a bad value raises :class:`ParserError` rather than printing and exiting)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from lightning.pytorch import LightningModule
    from transformers.utils import logging as transformers_logging

    import rlkit.algorithms  # noqa: F401  (registers the module classes)
    from rlkit.rollouts.source import RolloutSource

    # transformers' "Loading weights" / "Writing model shards" bars would repeat at every load and save
    transformers_logging.disable_progress_bar()
    cli_class, parser_class = _import_lightning_cli()
    cli_class.args_given = list(sys.argv[1:] if args is None else args)
    cli_class.raise_parser_errors = raise_parser_errors
    args = expand_config_defaults(cli_class.args_given)
    args = nulls_as_configs(import_user_modules(args))
    return cli_class(
        LightningModule,
        RolloutSource,
        subclass_mode_model=True,
        subclass_mode_data=True,
        parser_class=parser_class,
        auto_configure_optimizers=False,
        parser_kwargs={"prog": "rlkit", "allow_abbrev": False},
        save_config_callback=cli_class.save_config_class,
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
    )


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``rlkit`` console script."""
    argv = list(sys.argv[1:] if args is None else args)
    if argv in ([], ["-h"], ["--help"]):
        print(HELP, end="")
        sys.exit(0 if argv else 2)
    try:
        if argv[0] in TOOLS:
            module, _, function = TOOLS[argv[0]].partition(":")
            return getattr(importlib.import_module(module), function)(argv[1:])
        build_cli(args)
    except Interrupted as stop:
        if not stop.quiet:
            print(stop.report(argv), file=sys.stderr)
        sys.exit(stop.exit_code)
    except RLKitError as error:
        print(f"rlkit: error: {error}", file=sys.stderr)
        sys.exit(error.exit_code)
    except (FileNotFoundError, NotADirectoryError) as error:
        print(f"rlkit: error: {error}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("rlkit: interrupted; resume with --ckpt_path=last", file=sys.stderr)
        sys.exit(130)
    except SystemExit as stop:
        if type(stop).__name__ != "SIGTERMException":
            raise
        # Lightning stops a fit on SIGTERM with SystemExit(): exit 0, as if the run had finished
        print("rlkit: stopped by SIGTERM; resume with --ckpt_path=last", file=sys.stderr)
        sys.exit(143)


if __name__ == "__main__":
    main()
