"""What a run shows a researcher: the console, the run folders, and TensorBoard's scalars, text and hparams."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from rlkit.runs import explain_parser_error, run_name_suffix
from rlkit.schedules import LinearDecay
from rlkit.spine.reporting import HPARAMS_RUN
from spine.helpers import EXPERIMENTS, QUICK, event_files, run_rlkit


def _events(run_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    [events] = event_files(run_dir)
    accumulator = EventAccumulator(str(events.parent), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


def _hparams_run(run_dir: Path):
    """The HPARAMS sub-run of the run under ``run_dir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    [run] = [p for p in run_dir.rglob(HPARAMS_RUN) if p.is_dir()]
    accumulator = EventAccumulator(str(run), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


def _hparams(run_dir: Path) -> dict[str, object]:
    from tensorboard.plugins.hparams import plugin_data_pb2

    content = _hparams_run(run_dir).PluginTagToContent("hparams")["_hparams_/session_start_info"]
    info = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
    return {k: v.WhichOneof("kind") and getattr(v, v.WhichOneof("kind")) for k, v in info.hparams.items()}


def _texts(accumulator, tag: str) -> dict[int, str]:
    """``step -> text`` of a TEXT-tab tag."""
    return {e.step: e.tensor_proto.string_val[0].decode() for e in accumulator.Tensors(f"{tag}/text_summary")}


def _layout(accumulator) -> dict[str, list[str]]:
    """The CUSTOM SCALARS layout: chart title -> tags (the anchors removed)."""
    from tensorboard.plugins.custom_scalar import layout_pb2

    [event] = accumulator.Tensors("custom_scalars__config__")
    layout = layout_pb2.Layout.FromString(event.tensor_proto.string_val[0])
    return {
        chart.title: [re.sub(r"^\^|\$$", "", tag).replace("\\", "") for tag in chart.multiline.tag]
        for category in layout.category
        for chart in category.chart
    }


@pytest.fixture(scope="module")
def console_run(tmp_path_factory):
    """One real `rlkit fit` with the progress bar on, then the same with one ablation flag."""
    workdir = tmp_path_factory.mktemp("console")
    base = run_rlkit(["fit", f"--config={EXPERIMENTS / 'drgrpo.yaml'}", *QUICK], cwd=workdir)
    ablation = run_rlkit(
        ["fit", f"--config={EXPERIMENTS / 'drgrpo.yaml'}", *QUICK, "--model.advantage=GroupNorm"], cwd=workdir
    )
    return workdir, base, ablation


BASE = f"runs/drgrpo/{run_name_suffix(QUICK)}"


def test_console_shows_rollouts_and_where_the_run_is(console_run):
    workdir, base, _ = console_run
    assert base.returncode == 0, base.stderr[-3000:]
    out = base.stdout + base.stderr
    assert "rollouts" in out and "3/3" in out and "reward=" in out and "val_reward=" in out
    assert "0/?" not in out and "Epoch" not in out and "v_num" not in out
    assert "Loading weights" not in out and "Writing model shards" not in out  # transformers' bars
    assert f"TensorBoard logs: {BASE}/version_0" in out and "tensorboard --logdir runs" in out
    assert f"checkpoints:      {BASE}/version_0/checkpoints" in out
    assert f"HF export:        {BASE}/version_0/hf_export" in out


def test_an_ablation_gets_its_own_named_folder(console_run):
    workdir, base, ablation = console_run
    assert ablation.returncode == 0, ablation.stderr[-3000:]
    base, changed = workdir / BASE, workdir / f"{BASE},advantage=GroupNorm"
    assert (base / "version_0" / "checkpoints" / "last.ckpt").is_file()
    assert (changed / "version_0" / "checkpoints" / "last.ckpt").is_file()
    assert not (base / "version_1").exists() and not list(workdir.rglob("last-v1.ckpt"))
    assert _hparams(changed)["advantage"] == "GroupNorm" and "advantage.eps" in _hparams(changed)
    assert _hparams(base)["advantage"] == "GroupMean"


def test_tensorboard_scalars_are_aligned_and_not_padded(console_run):
    workdir, _, _ = console_run
    scalars = _events(workdir / BASE / "version_0")
    tags = set(scalars.Tags()["scalars"])
    for tag in tags:
        points = scalars.Scalars(tag)
        assert all(math.isfinite(p.value) for p in points), f"{tag} has a non-finite point"
    assert [p.step for p in scalars.Scalars("reward/mean")] == [0, 1, 2]  # x = the rollout's index
    # held-out: before any update (the weights of rollout 0), at the val check after 2 updates, after the last
    assert [p.step for p in scalars.Scalars("val/reward")] == [0, 2, 3]
    # no constant or duplicate curves: on-policy the ratio is exactly 1 (no ratio/*, clip/*); a reward call that
    # fails stops the run (reward_on_error=raise: no reward/errors); the HPARAMS metrics live in their sub-run
    for tag in ("epoch", "rollout/iteration", "buffer/groups", "reward/accuracy", "loss/total", "val/accuracy"):
        assert tag not in tags, tag
    assert not [t for t in tags if t.startswith(("ratio/", "clip/", "hp/")) or t == "reward/errors"], sorted(tags)
    assert all(tag.endswith("_s") for tag in tags if tag.startswith("time/")), "time/* carry their unit"
    texts = scalars.Tags()["tensors"]
    assert "samples/text_summary" in texts and "validation/text_summary" in texts


def test_text_steps_are_the_scalars_rollouts(console_run):
    workdir, _, _ = console_run
    scalars = _events(workdir / BASE / "version_0")
    samples = _texts(scalars, "samples")  # samples_every=10: rollout 0 only in a 3-rollout run
    assert samples and all(text.startswith(f"rollout {step},") for step, text in samples.items()), samples
    assert set(samples) <= {p.step for p in scalars.Scalars("reward/mean")}
    assert set(_texts(scalars, "validation")) == {p.step for p in scalars.Scalars("val/reward")}


def test_custom_scalars_open_on_what_matters(console_run):
    workdir, _, _ = console_run
    scalars = _events(workdir / BASE / "version_0")
    layout = _layout(scalars)
    assert list(layout)[0].startswith("reward") and layout[list(layout)[0]] == ["reward/mean", "val/reward"]
    logged = set(scalars.Tags()["scalars"])
    for title, tags in layout.items():
        assert tags and set(tags) <= logged, (title, tags)
    assert "loss/policy" in layout["loss"] and "policy/entropy" in layout["entropy"]
    assert "completion/length" in layout["response length (tokens)"]
    assert "KL" not in layout and "trust region" not in layout  # Dr.GRPO on-policy: no KL term, ratio 1


def test_hparams_hold_what_tells_runs_apart(console_run):
    workdir, _, _ = console_run
    params = _hparams(workdir / BASE / "version_0")
    for key in ("advantage", "aggregation", "clip", "lr", "samples_per_prompt", "prompts_per_step", "temperature"):
        assert key in params, key
    for key in ("max_steps", "seed", "task", "rewards", "max_new_tokens", "engine", "clip.eps_low"):
        assert key in params, key
    assert params["max_steps"] == 3 and params["samples_per_prompt"] == 4 and params["prompts_per_step"] == 4
    assert params["engine"] == "HFEngine" and params["clip"] == "PPOClip" and params["clip.eps_low"] == 0.2
    # the asynchronous settings are ablation axes too (issue 17's study varies max_staleness)
    assert (params["max_staleness"], params["async_schedule"], params["partial_rollouts"]) == (0, "fixed", False)
    assert (params["partial_chunk_tokens"], params["reward_workers"]) == (0, 0)
    assert not any("cache" in str(value) for value in params.values()), "the cache path is not a setting"
    # no experiment summary: TensorBoard then takes every run's settings as columns, what differs first
    hparams = _hparams_run(workdir / BASE / "version_0")
    assert "_hparams_/experiment" not in hparams.PluginTagToContent("hparams")
    # the sub-run's scalars are the table's metrics: exactly the two, at the main run's steps
    assert set(hparams.Tags()["scalars"]) == {"hp/val_reward", "hp/train_reward"}
    main = _events(workdir / BASE / "version_0")
    assert [(p.step, p.value) for p in hparams.Scalars("hp/val_reward")] == [
        (p.step, p.value) for p in main.Scalars("val/reward")
    ]
    assert [p.step for p in hparams.Scalars("hp/train_reward")] == [p.step for p in main.Scalars("reward/mean")]


def test_x_axis_counts_rollouts_with_several_optimizer_steps(tmp_path):
    """Off-policy updates (2 epochs x 2 mini-batches) make the ratio move: ratio/* and clip/* are logged and
    the layout gains its trust-region chart."""
    args = ["fit", f"--config={EXPERIMENTS / 'drgrpo.yaml'}", *QUICK, "--trainer.enable_progress_bar=false"]
    args += ["--trainer.max_steps=8", "--model.loop.ppo_epochs=2", "--model.loop.minibatches=2"]
    result = run_rlkit(args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    scalars = _events(tmp_path / "runs")
    assert [p.step for p in scalars.Scalars("reward/mean")] == [0, 1]  # 8 optimizer steps = 2 rollouts
    assert [p.step for p in scalars.Scalars("val/reward")] == [0, 2]
    tags = set(scalars.Tags()["scalars"])
    for tag in ("ratio/mean", "ratio/max", "ratio/approx_kl", "clip/fraction", "clip/lower", "clip/upper"):
        assert tag in tags, tag
    assert max(p.value for p in scalars.Scalars("ratio/max")) > 1.0  # it moved: the first step's rows are 1
    assert _layout(scalars)["trust region"] == ["clip/fraction", "ratio/approx_kl"]


@pytest.mark.parametrize("max_steps", [5, 12])
def test_linear_decay_ends_with_the_run(max_steps):
    from rlkit.spine.optim import build_optimizer
    from rlkit.spine.settings import Optimization

    parameter = torch.nn.Parameter(torch.zeros(1))
    optim = Optimization(optimizer=lambda p: torch.optim.SGD(p, lr=0.5), lr_scheduler=lambda o: LinearDecay(o))
    optimizer, scheduler = build_optimizer([parameter], optim, max_steps=max_steps)
    lrs = []
    for _ in range(max_steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs[0] == 0.5 and lrs[-1] == pytest.approx(0.5 / max_steps)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.0)
    assert all(a > b for a, b in zip(lrs, lrs[1:], strict=False))


def test_linear_decay_warm_up_and_state_round_trip():
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([parameter], lr=1.0)
    schedule = LinearDecay(optimizer, warmup_steps=2, end_factor=0.1, total_steps=6)
    assert [round(schedule.factor(s), 4) for s in range(7)] == [0.3333, 0.6667, 1.0, 0.775, 0.55, 0.325, 0.1]
    state = schedule.state_dict()
    restored = LinearDecay(torch.optim.SGD([parameter], lr=1.0))
    restored.load_state_dict(state)
    assert restored.total_steps == 6 and restored.factor(5) == schedule.factor(5)


def test_run_names_say_what_changed():
    assert run_name_suffix(["--model.advantage=GroupNorm"]) == "advantage=GroupNorm"
    assert run_name_suffix(["--model.clip.init_args.eps_high", "0.28", "--trainer.max_steps=5"]) == "clip.eps_high=0.28"
    assert run_name_suffix(["--seed_everything=3", "--data.engine=rlkit.engines.vllm.VLLMEngine"]) == (
        "seed=3,engine=VLLMEngine"
    )
    assert run_name_suffix(["--config=x.yaml", "--trainer.devices=2"]) == ""


def test_parser_errors_on_other_values_are_left_alone():
    message = 'Parser key "data.prompts_per_step":\n  Expected a <class int>. Got value: many'
    assert explain_parser_error(message) == message


def test_the_sample_table_shows_the_most_varied_group():
    from rlkit.data.batch import Rollout
    from rlkit.spine.reporting import group_sample

    N, T = 6, 3
    rollout = Rollout(
        input_ids=torch.zeros(N, 5, dtype=torch.long),
        attention_mask=torch.ones(N, 5),
        completion_mask=torch.tensor([[1.0, 1.0, 0.0]] * N),
        group_ids=torch.tensor([0, 0, 1, 1, 2, 2]),
        scores=torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0]),
        engine_logprobs=torch.zeros(N, T),
        truncated=torch.zeros(N, dtype=torch.bool),
        texts=["a", "b", "c", "d", "e", "f"],
        prompt_texts=["P", "P", "Q", "Q", "R", "R"],
    )
    advantages = torch.tensor([[0.0] * T, [0.0] * T, [-0.5] * T, [0.5] * T, [0.0] * T, [0.0] * T])
    table = group_sample(rollout, advantages)
    assert "prompt `Q`" in table and "| `c` | 2 | 0 | -0.5 |" in table and "| `d` | 2 | 1 | +0.5 |" in table
    assert "`a`" not in table and "`e`" not in table


def test_config_defaults_expand_in_order(tmp_path):
    from rlkit.runs import expand_config_defaults, experiment_name

    (tmp_path / "presets").mkdir()
    (tmp_path / "presets" / "algo.yaml").write_text("model:\n  init_args: {kl_coef: 0.1}\n")
    (tmp_path / "task.yaml").write_text("defaults: [base.yaml]\ndata: {prompts_per_step: 4}\n")
    (tmp_path / "base.yaml").write_text("trainer: {max_steps: 9}\n")
    experiment = tmp_path / "exp.yaml"
    experiment.write_text("defaults: [presets/algo.yaml, task.yaml]\ntrainer: {max_steps: 3}\n")
    args = expand_config_defaults(["fit", "--config", str(experiment), "--model.kl_coef=0.2"])
    assert args[0] == "fit" and args[-1] == "--model.kl_coef=0.2"
    configs = [a.split("=", 1)[1] for a in args if a.startswith("--config=")]
    assert configs[0] == str(tmp_path / "presets" / "algo.yaml")
    assert configs[1] == str(tmp_path / "base.yaml")  # a default's defaults come before it
    assert "prompts_per_step: 4" in configs[2] and "max_steps: 3" in configs[3]
    assert experiment_name(["fit", "--config", str(experiment)]) == "exp"


def test_config_defaults_errors_name_the_file(tmp_path):
    from rlkit.errors import ConfigError
    from rlkit.runs import expand_config_defaults

    loop = tmp_path / "loop.yaml"
    loop.write_text("defaults: [loop.yaml]\n")
    with pytest.raises(ConfigError, match="include itself"):
        expand_config_defaults([f"--config={loop}"])
    missing = tmp_path / "missing.yaml"
    missing.write_text("defaults: [nowhere.yaml]\n")
    with pytest.raises(ConfigError, match="nowhere.yaml"):
        expand_config_defaults([f"--config={missing}"])
