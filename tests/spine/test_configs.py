"""Every YAML in the repository is parsed and instantiated; presets and experiments agree; each
documented one-line ablation changes exactly the component it names."""

from __future__ import annotations

import re

import pytest
import torch
import yaml

from rlkit.cli import build_cli
from rlkit.runs import run_name_suffix
from spine.helpers import EXPERIMENTS, ROOT

#: Per family, the keys a preset must name (its components and the settings that define the algorithm).
COMPONENT_KEYS = {
    "rlkit.algorithms.PolicyGradient": (
        "advantage", "ratio", "clip", "aggregation", "kl", "kl_coef", "kl_in_reward", "entropy_coef",
        "rollout_correction",
    ),
    "rlkit.algorithms.ActorCritic": (
        "advantage", "ratio", "clip", "aggregation", "kl", "kl_coef", "kl_in_reward", "entropy_coef",
        "critic", "value_loss", "value_aggregation", "value_coef", "critic_warmup_rollouts",
    ),
    "rlkit.algorithms.Distillation": (
        "loss", "ratio", "clip", "aggregation", "policy_gradient", "reward_weight", "advantage"
    ),
    "rlkit.algorithms.OnlineDPO": ("loss",),
}  # fmt: skip
ALL_YAMLS = sorted(p for p in ROOT.rglob("*.yaml") if ".git" not in p.parts and "runs" not in p.parts)
EXPERIMENT_YAMLS = sorted(EXPERIMENTS.rglob("*.yaml"))
PRESETS = sorted((ROOT / "configs" / "algorithms").rglob("*.yaml"))
TRAINERS = sorted((ROOT / "configs" / "trainer").rglob("*.yaml"))
TASKS = sorted((ROOT / "configs" / "tasks").rglob("*.yaml"))
TEST_YAMLS = sorted((ROOT / "tests").rglob("*.yaml"))  # instantiated by the tests that use them


def _parse(*args: str):
    return build_cli(list(args), run=False)


def _components(namespace) -> dict:
    init = namespace.model.init_args
    return {key: init[key] for key in COMPONENT_KEYS[namespace.model.class_path]}


def test_every_yaml_is_covered_below():
    """A YAML added anywhere must belong to a group that a test below instantiates."""
    covered = set(EXPERIMENT_YAMLS) | set(PRESETS) | set(TRAINERS) | set(TASKS) | set(TEST_YAMLS)
    assert ALL_YAMLS, "no YAML found"
    assert set(ALL_YAMLS) <= covered, f"untested YAMLs: {sorted(set(ALL_YAMLS) - covered)}"


@pytest.mark.parametrize("path", EXPERIMENT_YAMLS, ids=lambda p: p.name)
def test_experiment_instantiates(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first_line = path.read_text().splitlines()[0]
    assert first_line.startswith("#"), f"{path.name} must begin with a comment"
    assert f"rlkit fit --config experiments/{path.name}" in path.read_text(), "the run command is documented"
    cli = _parse(f"--config={path}")
    assert f"{type(cli.model).__module__.rsplit('.', 1)[0]}.{type(cli.model).__name__}" in COMPONENT_KEYS
    assert cli.datamodule.samples_per_prompt >= 2
    assert cli.trainer.max_steps > 0


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.name)
def test_preset_names_every_component_and_matches_its_experiment(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = yaml.safe_load(path.read_text())["model"]
    raw = model["init_args"]
    missing = [key for key in COMPONENT_KEYS[model["class_path"]] if key not in raw]
    assert not missing, f"{path.name} must name every component; missing {missing}"
    experiment = EXPERIMENTS / path.name
    cli = _parse(f"--config={experiment}", f"--config={path}")
    with_preset = _components(cli.config)
    alone = _components(_parse(f"--config={experiment}").config)
    assert with_preset == alone, f"experiments/{path.name} and configs/algorithms/{path.name} disagree"


def _leaves(tree: dict, prefix: str = ""):
    """``(dotted key, value)`` of every leaf of a nested config dict; a class (``class_path``) is a leaf."""
    for key, value in tree.items():
        if isinstance(value, dict) and "class_path" not in value:
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


@pytest.mark.parametrize("path", TASKS, ids=lambda p: p.name)
@pytest.mark.parametrize("preset", ["grpo", "ppo", "opd", "online_dpo"])
def test_task_composes_after_every_family_preset(path, preset, tmp_path, monkeypatch):
    """A task config sets the data, trainer and shared model settings (policy, loop, optim) of any family's
    preset given first, and leaves the preset's components as they are."""
    monkeypatch.chdir(tmp_path)
    algorithm = ROOT / "configs" / "algorithms" / f"{preset}.yaml"
    composed = _parse(f"--config={algorithm}", f"--config={path}").config
    task = yaml.safe_load(path.read_text())
    assert composed.model.class_path == yaml.safe_load(algorithm.read_text())["model"]["class_path"]
    assert composed.trainer.max_steps == task["trainer"]["max_steps"]
    assert composed.data.init_args.prompts.class_path == task["data"]["prompts"]["class_path"]
    shared = {"policy", "loop", "optim"}
    assert set(task["model"]["init_args"]) <= shared, "a task file sets only the settings every family shares"
    for key, value in _leaves(task["model"]["init_args"]):
        got = composed.model.init_args[key]
        if isinstance(value, dict) or key.endswith("lr_scheduler"):  # a class: compare its path
            value, got = value["class_path"] if isinstance(value, dict) else value, got.class_path
        assert got == value, key
    experiment = EXPERIMENTS / f"{preset}.yaml"
    assert _components(composed) == _components(_parse(f"--config={experiment}").config)


@pytest.mark.parametrize("path", TRAINERS, ids=lambda p: p.name)
def test_trainer_config_instantiates(path, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    settings = yaml.safe_load(path.read_text())["trainer"]
    if settings.get("accelerator") == "gpu" and not torch.cuda.is_available():
        # Parsing validates every key and class path; building a GPU Trainer needs CUDA.
        with pytest.raises(SystemExit) as exit_info:
            _parse(f"--config={EXPERIMENTS / 'drgrpo.yaml'}", f"--config={path}", "--print_config")
        assert exit_info.value.code in (0, None)
        resolved = yaml.safe_load(capsys.readouterr().out)["trainer"]
        assert resolved["precision"] == settings["precision"]
        pytest.skip("the GPU trainer config parsed; instantiating it needs CUDA")
    cli = _parse(f"--config={EXPERIMENTS / 'drgrpo.yaml'}", f"--config={path}")
    task = ROOT / "configs" / "tasks" / "embedded.yaml"  # drgrpo.yaml's trainer settings come from its task
    assert cli.trainer.max_steps == yaml.safe_load(task.read_text())["trainer"]["max_steps"]


def _documented_ablations() -> list[tuple[str, str, str, str]]:
    """``rlkit fit --config experiments/X.yaml --model.KEY=VALUE`` (or ``--data.KEY=VALUE``; KEY may be
    dotted) lines of README.md and the YAMLs."""
    found = set()
    pattern = re.compile(r"rlkit fit --config (experiments/[\w.]+\.yaml) --(model|data)\.([\w.]+)=(\S+)")
    for source in [ROOT / "README.md", *EXPERIMENT_YAMLS]:
        found.update(pattern.findall(source.read_text()))
    return sorted(found)


def test_ablations_are_documented():
    assert len(_documented_ablations()) >= 4


@pytest.mark.parametrize("experiment,section,key,value", _documented_ablations())
def test_ablation_changes_exactly_one_component(experiment, section, key, value, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    value = value.strip("'\"")  # as the shell passes it
    base = _parse(f"--config={ROOT / experiment}").config
    ablated = _parse(f"--config={ROOT / experiment}", f"--{section}.{key}={value}").config

    def settings(config) -> dict:
        return {"model": config.model.init_args.as_dict(), "data": config.data.init_args.as_dict()}

    before, after = settings(base), settings(ablated)
    changed = sorted(
        (part, k) for part in before for k in before[part].keys() | after[part].keys()
        if before[part].get(k) != after[part].get(k)
    )  # fmt: skip
    flag = f"--{section}.{key}={value}"
    assert changed == [(section, key.split(".")[0])], f"{flag} changed {changed}"
    # the run is named by its change (its own folder); nothing else of the trainer moves
    base_name, ablated_name = base.trainer.logger.init_args.name, ablated.trainer.logger.init_args.name
    assert ablated_name == f"{base_name}/{run_name_suffix([flag])}"
    ablated.trainer.logger.init_args.name = base_name
    assert base.trainer == ablated.trainer
    if section == "model" and "." not in key:
        assert value.split(".")[-1] in str(after["model"][key])
