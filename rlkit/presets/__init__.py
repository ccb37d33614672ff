"""The presets that ship with rlkit, found by name: ``rlkit fit --config drgrpo``.

``configs/`` (algorithm presets, the embedded task, trainer settings) and ``experiments/`` (runnable:
preset + task) are kept at the top of the checkout, where the README's commands name them; this package
holds links to both, and a wheel installs their files here (``rlkit/presets/{configs,experiments}``), so
an installed rlkit finds them from any working directory.

A ``--config`` value that is not a file is looked up here: ``drgrpo`` (an experiment),
``trainer/cpu`` or ``algorithms/grpo`` (a config), ``rlkit:experiments/drgrpo.yaml`` (a path in the
package) or ``experiments/drgrpo.yaml`` run outside the checkout. ``rlkit presets`` lists them.
"""

from __future__ import annotations

import difflib
import sys
from pathlib import Path

from rlkit.errors import ConfigError

#: where the presets are: links to the checkout's folders, or the installed copies
ROOT = Path(__file__).resolve().parent
#: prefix of a path inside the package (``rlkit:experiments/drgrpo.yaml``)
PREFIX = "rlkit:"
FOLDERS = ("experiments", "configs")


def presets() -> dict[str, Path]:
    """Every preset by its short name: ``drgrpo`` for ``experiments/drgrpo.yaml``, ``algorithms/grpo`` for
    ``configs/algorithms/grpo.yaml``."""
    found: dict[str, Path] = {}
    for folder in FOLDERS:
        base = ROOT / folder
        for path in sorted(base.rglob("*.yaml")):
            found.setdefault(path.relative_to(base).with_suffix("").as_posix(), path)
    return found


def resolve(value: str) -> str:
    """The file a ``--config`` value names: the value itself if it is a file (or YAML text), else the preset
    it names; an unknown name is a ``ConfigError`` listing the close ones."""
    if value.startswith(PREFIX):
        path = ROOT / value[len(PREFIX) :]
        if not path.is_file():
            raise ConfigError(f"--config {value}: no such file in rlkit's presets ({ROOT}); `rlkit presets` lists them")
        return str(path)
    if Path(value).is_file() or "\n" in value or ":" in value or value.lstrip().startswith("{"):
        return value
    relative = Path(value)
    if relative.parts and relative.parts[0] in FOLDERS and (ROOT / relative).is_file():
        return str(ROOT / relative)  # experiments/drgrpo.yaml from outside the checkout
    name = value.removesuffix(".yaml").removesuffix(".yml")
    known = presets()
    if name in known:
        return str(known[name])
    if relative.suffix in (".yaml", ".yml") and "/" in value.rstrip("/"):
        return value  # a path of the user's that does not exist: the parser names it
    close = difflib.get_close_matches(name, list(known), n=3)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    raise ConfigError(
        f"--config {value}: no such file and no preset of that name{hint}; `rlkit presets` lists them "
        f"(e.g. --config drgrpo)"
    )


def describe(path: Path) -> str:
    """The first comment line of a preset, its one-line description."""
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            return line.lstrip("# ").strip()
        if line.strip():
            break
    return ""


def main(argv: list[str]) -> None:
    """``rlkit presets``: every preset by name, with its description."""
    if argv and argv[0] in ("-h", "--help"):
        print("usage: rlkit presets\n\nLists the configs that ship with rlkit; use one with rlkit fit --config NAME.")
        return
    if argv:
        raise ConfigError(f"rlkit presets takes no arguments, got {' '.join(argv)}")
    known = presets()
    width = max(map(len, known)) + 2
    print(f"rlkit presets (in {ROOT}); run one with: rlkit fit --config NAME [--config trainer/cpu ...]")
    for folder in FOLDERS:
        what = "runnable: an algorithm preset + the embedded task" if folder == "experiments" else "to compose"
        print(f"\n{folder}/ ({what}):")
        for name, path in known.items():
            if path.parent.resolve().is_relative_to((ROOT / folder).resolve()):
                print(f"  {name:<{width}}{describe(path)[:100]}")
    sys.stdout.flush()
