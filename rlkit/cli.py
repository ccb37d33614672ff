"""The ``rlkit`` command: a LightningCLI with ``fit`` and ``validate``.

Examples::

    rlkit fit --config experiments/drgrpo.yaml
    rlkit fit --config experiments/drgrpo.yaml --model.advantage=GroupNorm
    rlkit fit --config experiments/drgrpo.yaml --print_config
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

# Registers every component class so jsonargparse resolves short names like `GroupMean`.
import rlkit.components  # noqa: F401
import rlkit.data.arithmetic  # noqa: F401
import rlkit.rewards  # noqa: F401
from rlkit.errors import ConfigError, RLKitError

SUBCOMMANDS = ("fit", "validate")


def _concise(error: Exception) -> str:
    """The component's own message out of jsonargparse's report on a failed Union/subclass value."""
    reasons = [
        line.strip()[2:]
        for line in str(error).splitlines()
        if line.strip().startswith("- ") and "NoneType" not in line and "Expected a" not in line
    ]
    return reasons[0] if reasons else str(error).splitlines()[0]


def _import_lightning_cli():
    from lightning.pytorch.cli import LightningCLI

    class RLKitCLI(LightningCLI):
        """LightningCLI with rlkit's subcommands and parser settings."""

        @staticmethod
        def subcommands() -> dict[str, set[str]]:
            return {name: LightningCLI.subcommands()[name] for name in SUBCOMMANDS}

        def init_parser(self, **kwargs):
            parser = super().init_parser(**kwargs)
            # On a bad value jsonargparse prints the whole usage (hundreds of options) before the
            # error; a one-line usage keeps the error itself on screen.
            parser.format_usage = lambda: "usage: rlkit {fit,validate} --config FILE [--key=value ...]\n"
            return parser

        def add_arguments_to_parser(self, parser) -> None:
            parser.set_defaults(
                {
                    "trainer.logger": {
                        "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                        "init_args": {"save_dir": "runs", "name": "rlkit"},
                    },
                    # checkpoints are written atomically (see rlkit.checkpointing)
                    "trainer.plugins": [{"class_path": "rlkit.checkpointing.AtomicCheckpointIO"}],
                }
            )

        def instantiate_classes(self) -> None:
            # A component that rejects its hyper-parameters raises ValueError at construction: that is
            # a usage error (exit 2), reported in one line rather than as a traceback.
            try:
                super().instantiate_classes()
            except RLKitError:
                raise
            except (ValueError, TypeError) as error:
                raise ConfigError(f"invalid configuration: {_concise(error)}") from error

    return RLKitCLI


# Lightning warns that checkpoints of manual optimization hold the state after the step: that is
# exactly what rlkit wants (the data side's counter has advanced with it).
warnings.filterwarnings("ignore", message=".*Using ModelCheckpoint with manual optimization.*")
warnings.filterwarnings("ignore", message=".*treespec, LeafSpec.*")


class _DropTips(logging.Filter):
    """Lightning's start-up advertisement ("Tip: ... litlogger") is noise in rlkit's output."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "litlogger" not in record.getMessage()


logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_DropTips())


def build_cli(args: list[str] | None = None, run: bool = True):
    """The configured CLI object (``run=False``: parse and instantiate only, for tests and tools)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from lightning.pytorch import LightningModule

    from rlkit.algorithms import ActorCritic, PolicyGradient  # noqa: F401  (registers the module classes)
    from rlkit.data.datamodule import RolloutDataModule

    return _import_lightning_cli()(
        LightningModule,
        RolloutDataModule,
        subclass_mode_model=True,
        subclass_mode_data=False,
        auto_configure_optimizers=False,
        parser_kwargs={"prog": "rlkit", "allow_abbrev": False},
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
    )


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``rlkit`` console script."""
    try:
        build_cli(args)
    except RLKitError as error:
        print(f"rlkit: error: {error}", file=sys.stderr)
        sys.exit(error.exit_code)
    except (FileNotFoundError, NotADirectoryError) as error:
        print(f"rlkit: error: {error}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("rlkit: interrupted; resume with --ckpt_path=last", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
