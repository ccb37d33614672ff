"""What a study is: a base config, the factors it varies, the seeds, and where its runs live.

A study folder holds ``study.yaml`` (this definition, with the variants it resolved to) and one
TensorBoard run per variant and seed, ``runs/<variant>/seed=<s>/``, so ``rlkit ablate --resume DIR``
and ``rlkit compare DIR`` need nothing else.

Levels of a factor. The base run is the base config (plus the study's extra overrides) exactly as
given. A ``--vary`` value that resolves to the base's own value (``GroupMean`` on a Dr.GRPO config) is
the base level, wherever it stands in the list and whether or not it is listed; every other value is a
level of its own. One factor at a time, the variants are the base and each other level alone; with
``--grid``, every combination of levels (the all-base cell is the base).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from rlkit.errors import ConfigError

STUDY_FILE = "study.yaml"
BASE = "base"

#: Options a study sets for every run itself: a run's identity (seed, log folder) and resume point.
RESERVED = ("--seed_everything", "--trainer.logger", "--ckpt_path", "--config", "--print_config")


@dataclass(frozen=True)
class Factor:
    """One ``--vary key=v1,v2,...``: a config key and the values it takes."""

    key: str
    values: tuple[str, ...]

    @classmethod
    def parse(cls, text: str) -> Factor:
        key, sep, values = text.removeprefix("--").partition("=")
        if not sep or not key or not values.strip():
            raise ConfigError(
                f"--vary {text!r}: expected KEY=VALUE1,VALUE2 (e.g. --vary model.advantage=GroupMean,GroupNorm)"
            )
        if any(f"--{key}".startswith(reserved) for reserved in RESERVED):
            raise ConfigError(f"--vary {text!r}: {key} is set by the study for every run (seeds: --seeds N)")
        parts = tuple(part.strip() for part in split_top_level(values))
        if any(not part for part in parts) or len(set(parts)) != len(parts):
            raise ConfigError(f"--vary {text!r}: values must be non-empty and distinct")
        return cls(key, parts)

    def arg(self, value: str) -> str:
        return f"--{self.key}={value}"


@dataclass
class Variant:
    """A named set of changes to the base config (none for the base itself)."""

    name: str
    changes: dict[str, str] = field(default_factory=dict)

    @property
    def args(self) -> list[str]:
        return [f"--{key}={value}" for key, value in self.changes.items()]

    @property
    def is_base(self) -> bool:
        return not self.changes


@dataclass
class Study:
    """The definition of a study; :meth:`save` writes it as ``study.yaml``.

    Args:
        directory: the study folder.
        configs: the base config files (``--config``, in order), absolute paths.
        factors: what varies.
        seeds: every variant runs once per seed (``--seed_everything``).
        grid: every combination of levels instead of one factor at a time.
        overrides: extra ``--key=value`` options applied to every run.
        variants: filled by :func:`rlkit.studies.variants.resolve`.
        threshold: report the rollouts each run needed to reach this held-out reward.
        metrics: further TensorBoard tags to tabulate and plot (e.g. ``policy/entropy``).
    """

    directory: Path
    configs: list[str]
    factors: list[Factor]
    seeds: list[int]
    grid: bool = False
    overrides: list[str] = field(default_factory=list)
    variants: list[Variant] = field(default_factory=list)
    threshold: float | None = None
    metrics: list[str] = field(default_factory=list)
    digests: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.directory = Path(self.directory)
        from rlkit.presets import resolve  # a preset's name (--config drgrpo) as its file

        self.configs = [str(Path(resolve(c)).resolve()) for c in self.configs]
        if not self.configs:
            raise ConfigError("a study needs a base config: --config FILE")
        for config in self.configs:
            if not Path(config).is_file():
                raise ConfigError(f"config file not found: {config}")
        if not self.seeds:
            raise ConfigError("--seeds must give at least one seed")
        keys = [factor.key for factor in self.factors]
        if len(set(keys)) != len(keys):
            raise ConfigError(f"a key is varied twice: {', '.join(k for k in keys if keys.count(k) > 1)}")
        self.overrides = normalise_overrides(self.overrides)
        for option in self.overrides:
            key = option.split("=", 1)[0]
            if key.removeprefix("--") in keys:
                raise ConfigError(f"{key} is both varied (--vary) and fixed ({option}): keep one")
            if key.startswith(RESERVED):
                raise ConfigError(f"{option}: the study sets {key} for every run itself")
        self.digests = self.digests or {config: file_digest(config) for config in self.configs}

    # ---- runs ----

    def run_dir(self, variant: Variant, seed: int) -> Path:
        return self.directory / "runs" / variant.name / f"seed={seed}"

    def fit_args(self, variant: Variant, seed: int, ckpt_path: str | None = None) -> list[str]:
        """The ``rlkit fit`` command line of one run."""
        args = ["fit", *(f"--config={config}" for config in self.configs), *self.overrides, *variant.args]
        args += [
            f"--seed_everything={seed}",
            f"--trainer.logger.init_args.save_dir={self.directory.resolve() / 'runs'}",
            f"--trainer.logger.init_args.name={variant.name}",
            f"--trainer.logger.init_args.version=seed={seed}",
        ]
        return args + ([f"--ckpt_path={ckpt_path}"] if ckpt_path else [])

    @property
    def base(self) -> Variant:
        return next(v for v in self.variants if v.is_base)

    # ---- study.yaml ----

    def definition(self) -> dict:
        """What makes two studies the same study (a resumed one must match)."""
        return {
            "configs": self.configs,
            "config_sha256": self.digests,
            "factors": [{"key": f.key, "values": list(f.values)} for f in self.factors],
            "seeds": self.seeds,
            "grid": self.grid,
            "overrides": self.overrides,
        }

    def save(self) -> None:
        data = {
            **self.definition(),
            "variants": [{"name": v.name, "changes": v.changes} for v in self.variants],
            "report": {"threshold": self.threshold, "metrics": self.metrics},
        }
        self.directory.mkdir(parents=True, exist_ok=True)
        header = f"# rlkit study: resume with `rlkit ablate --resume {self.directory}`, report with `rlkit compare`.\n"
        write_atomic(self.directory / STUDY_FILE, header + yaml.safe_dump(data, sort_keys=False))

    @classmethod
    def load(cls, directory: str | Path) -> Study:
        path = Path(directory) / STUDY_FILE
        if not path.is_file():
            raise ConfigError(f"{directory} is not a study folder (no {STUDY_FILE}); start one with rlkit ablate")
        data = _read_definition(path)
        report = data["report"]
        study = cls.__new__(cls)
        study.directory = Path(directory)
        study.configs = list(data["configs"])
        study.factors = [Factor(f["key"], tuple(str(v) for v in f["values"])) for f in data["factors"]]
        study.seeds = [int(s) for s in data["seeds"]]
        study.grid = bool(data["grid"])
        study.overrides = list(data["overrides"])
        study.variants = [Variant(v["name"], dict(v.get("changes") or {})) for v in data["variants"]]
        study.threshold = report.get("threshold")
        study.metrics = list(report.get("metrics") or [])
        study.digests = dict(data["config_sha256"])
        return study

    def check_configs_unchanged(self) -> None:
        """A resumed study's runs must use the config its finished runs used."""
        for config, digest in self.digests.items():
            if not Path(config).is_file():
                raise ConfigError(f"the study's base config {config} no longer exists: restore it to resume")
            if file_digest(config) != digest:
                raise ConfigError(
                    f"the study's base config {config} changed since the study began: its runs would no longer "
                    "be comparable; restore the file, or start a new study (--study DIR)"
                )


def _read_definition(path: Path) -> dict:
    """``study.yaml`` as :meth:`Study.save` writes it; a ``ConfigError`` naming the file and what is wrong
    with it (a file cut short or edited by hand) instead of a traceback."""

    def damaged(what: str) -> ConfigError:
        return ConfigError(
            f"{path}: {what}: the file is damaged (cut short, or edited). Restore it from a copy; or delete it and "
            f"rerun the study's original rlkit ablate command (the first lines of summary.md show it): its finished "
            f"runs are kept and skipped"
        )

    raw = path.read_bytes()
    try:
        data = yaml.safe_load(raw.decode("utf-8"))
    except UnicodeDecodeError as error:
        raise damaged(f"not UTF-8 text (byte 0x{raw[error.start]:02x} at offset {error.start})") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise damaged(f"not valid YAML{where} ({getattr(error, 'problem', None) or error})") from None
    if data is None:
        raise damaged("it is empty")
    if not isinstance(data, dict):
        raise damaged(f"expected the study's settings (a mapping), got {type(data).__name__} {data!r:.60}")
    # every key save() writes, with what it holds
    shapes = {
        "configs": (list, str, "a list of config paths"),
        "config_sha256": (dict, str, "a mapping of config paths to hashes"),
        "factors": (list, dict, "a list of {key, values}"),
        "seeds": (list, int, "a list of integer seeds"),
        "grid": (bool, None, "true or false"),
        "overrides": (list, str, "a list of --key=value options"),
        "variants": (list, dict, "a list of {name, changes}"),
        "report": (dict, None, "a mapping (threshold, metrics)"),
    }
    missing = [key for key in shapes if key not in data]
    if missing:
        raise damaged(f"no {', '.join(missing)}")
    for key, (kind, item, what) in shapes.items():
        value = data[key]
        items = value.values() if isinstance(value, dict) and item is not None else value
        if not isinstance(value, kind) or (item is not None and not all(isinstance(x, item) for x in items)):
            raise damaged(f"{key} should be {what}, got {value!r:.80}")
    if not data["configs"] or not data["seeds"]:
        raise damaged("configs and seeds should not be empty")
    for factor in data["factors"]:
        if not isinstance(factor.get("key"), str) or not isinstance(factor.get("values"), list):
            raise damaged(f"a factor should be {{key: ..., values: [...]}}, got {factor!r:.80}")
    for variant in data["variants"]:
        if not isinstance(variant.get("name"), str) or not isinstance(variant.get("changes") or {}, dict):
            raise damaged(f"a variant should be {{name: ..., changes: {{...}}}}, got {variant!r:.80}")
    if not any(variant["name"] == BASE for variant in data["variants"]):
        raise damaged(f"its variants do not include the base ({BASE!r})")
    return data


def default_directory(configs: list[str], factors: list[Factor], grid: bool) -> Path:
    """``studies/<config>-<varied keys>``: the same command finds (and resumes) the same study."""
    stem = Path(configs[-1]).stem if configs else "study"
    keys = "-".join(f.key.split(".", 1)[-1].replace(".init_args", "") for f in factors) or "seeds"
    return Path("studies") / f"{stem}-{keys}{'-grid' if grid else ''}"


def split_top_level(text: str) -> list[str]:
    """Split on commas outside brackets and quotes: ``"{a: 1, b: 2},X"`` is two values."""
    parts, depth, quote, current = [], 0, None, []
    for char in text:
        if quote:
            quote = None if char == quote else quote
        elif char in "\"'":
            quote = char
        elif char in "[{(":
            depth += 1
        elif char in "]})":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append("".join(current))
            current = []
            continue
        current.append(char)
    parts.append("".join(current))
    return parts


def normalise_overrides(args: list[str]) -> list[str]:
    """``["--a", "1", "--b=2"]`` -> ``["--a=1", "--b=2"]``; anything else is a usage error."""
    out, i = [], 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or arg == "--":
            raise ConfigError(f"unexpected argument {arg!r}: extra options are --key=value")
        if "=" not in arg:
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                raise ConfigError(f"{arg} needs a value: {arg}=VALUE")
            arg = f"{arg}={args[i + 1]}"
            i += 1
        out.append(arg)
        i += 1
    return out


def file_digest(path: str | Path) -> str:
    """A config file's hash, with the files its ``defaults:`` list brings in (see ``expand_config_defaults``)."""
    from rlkit.runs import expand_config_defaults

    digest = hashlib.sha256()
    for arg in expand_config_defaults([f"--config={path}"]):
        value = arg.split("=", 1)[1]
        part = Path(value)
        # an expanded config's own body is inline YAML, too long for a path on most systems
        is_file = "\n" not in value and part.is_file()
        digest.update(f"{part.resolve()}\n".encode() + part.read_bytes() if is_file else value.encode())
    return digest.hexdigest()


def write_atomic(path: Path, text: str) -> None:
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text)
    os.replace(partial, path)
