"""The real ``rlkit fit``: a subprocess run, zero policy lag, exact resume."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlkit.cli import build_cli
from rlkit.embedded.cache import embedded_checkpoint
from rlkit.spine.loop import UpdateLoop
from rlkit.spine.policy import Policy
from spine.helpers import FLOAT64, ROOT, SAME_MATHS, assert_same_update, event_files, run_rlkit, short_args

EVERY_STEP = Path(__file__).with_name("checkpoint_every_step.yaml")


def _scalars(run_dir: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    [events] = event_files(run_dir)
    accumulator = EventAccumulator(str(events.parent))
    accumulator.Reload()
    return {tag: [e.value for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def test_rlkit_fit_subprocess(tmp_path):
    """The console command a user types: trains, logs, checkpoints, exports a loadable HF directory."""
    result = run_rlkit(short_args(tmp_path, "drgrpo"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    scalars = _scalars(tmp_path / "runs")
    for tag in ("reward/mean", "loss/policy", "mismatch/logprob_abs_diff", "time/generate_s"):
        assert tag in scalars, f"{tag} not logged; got {sorted(scalars)}"
    assert "clip/fraction" not in scalars and "ratio/mean" not in scalars  # on-policy: the ratio is exactly 1
    assert len(scalars["loss/policy"]) == 4  # one optimizer step per rollout, max_steps=4
    # on-policy with one update per rollout: the engine's log-probs are the trainer's
    assert max(scalars["mismatch/logprob_abs_diff"]) < 1e-4
    [export] = list((tmp_path / "runs").rglob("hf_export"))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(export, local_files_only=True)
    assert sum(p.numel() for p in model.parameters()) > 0


class _Recorder:
    """Keeps each rollout and the policy weights it should have been generated with."""

    def __init__(self) -> None:
        import lightning.pytorch as pl

        recorder = self

        class Callback(pl.Callback):
            def on_train_batch_start(self, trainer, module, batch, batch_idx):
                recorder.rollouts.append(batch)
                recorder.weights.append(copy.deepcopy(module.policy.state_dict()))

        self.callback = Callback()
        self.rollouts, self.weights = [], []


def _fit_in_process(tmp_path, monkeypatch, *extra: str):
    monkeypatch.chdir(tmp_path)
    args = short_args(tmp_path, "drgrpo", "--model.optim.optimizer.init_args.lr=1e-3", *extra)[1:]
    cli = build_cli(args, run=False)
    recorder = _Recorder()
    cli.trainer.callbacks.append(recorder.callback)
    cli.trainer.fit(cli.model, cli.datamodule)
    return cli, recorder


def _max_logprob_gap(module, state, rollout) -> float:
    policy = copy.deepcopy(module.policy)
    policy.load_state_dict(state)
    with torch.no_grad():
        logprobs = policy(rollout, 1.0).logprobs  # [N, T]
    mask = rollout.completion_mask.bool()
    return (logprobs - rollout.engine_logprobs)[mask].abs().max().item()


@pytest.mark.parametrize("engine", ["HFEngine", pytest.param("VLLMEngine", marks=pytest.mark.vllm)])
def test_zero_policy_lag(engine, tmp_path, monkeypatch):
    """Rollout k is sampled with the weights after update k-1: the engine's log-probs of rollout k
    match those weights, and not the weights one update older.

    Every update must move the policy visibly whatever the warm-up reached: a group whose samples all
    score alike has zero advantage, and a rollout of such groups alone would not change the weights. The
    entropy bonus gives every step a gradient, and lr 1e-2 makes the step large."""
    if engine == "VLLMEngine":
        pytest.importorskip("vllm")
    cli, recorder = _fit_in_process(
        tmp_path,
        monkeypatch,
        f"--data.engine=rlkit.engines.{engine.lower()[:-6]}.{engine}",
        "--model.optim.optimizer.init_args.lr=1e-2",
        "--model.entropy_coef=0.1",
    )
    module = cli.model
    assert len(recorder.rollouts) == 4
    tolerance = 1e-4
    for k in range(1, 4):
        rollout = recorder.rollouts[k]
        current = _max_logprob_gap(module, recorder.weights[k], rollout)
        stale = _max_logprob_gap(module, recorder.weights[k - 1], rollout)
        assert current < tolerance, f"rollout {k}: engine vs weights after update {k - 1}: {current}"
        assert stale > 10 * tolerance, f"rollout {k}: updates too small to tell lag apart ({stale})"


def _resume_runs(
    tmp_path: Path, *extra: str, experiment: str = "drgrpo", steps: int = 4, file: str = "model.safetensors"
) -> tuple[dict, dict]:
    """``steps`` optimizer steps straight, and half of them, a checkpoint, a new process and the rest;
    returns ``export/<file>`` of both runs."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    straight.mkdir(), split.mkdir()
    # The first half stops early by max_steps; the schedule's length stays that of the whole run (LinearDecay
    # otherwise ends with trainer.max_steps), as when a run is killed and resumed.
    common = [
        f"--config={EVERY_STEP}",
        f"--trainer.max_steps={steps}",
        f"--model.optim.lr_scheduler.init_args.total_steps={steps}",
        *extra,
    ]

    result = run_rlkit(short_args(straight, experiment, *common), cwd=straight)
    assert result.returncode == 0, result.stderr[-3000:]
    result = run_rlkit(short_args(split, experiment, *common, f"--trainer.max_steps={steps // 2}"), cwd=split)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (split / "ckpts" / "last.ckpt").exists()
    result = run_rlkit(short_args(split, experiment, *common, "--ckpt_path=ckpts/last.ckpt"), cwd=split)
    assert result.returncode == 0, result.stderr[-3000:]
    return load_file(straight / "export" / file), load_file(split / "export" / file)


#: the actor-critic run (4 rollouts, resumed after 2) crosses the resume point with everything that has
#: state: the critic and its optimizer, the critic warm-up (rollouts 0-2; the policy steps in rollout 3), two
#: mini-batches (value clipping active) and an adaptive KL coefficient in the reward (it moves every rollout)
RESUME_CASES = {
    "drgrpo": dict(extra=()),
    "ppo": dict(
        extra=(
            "--model.loop.minibatches=2",
            "--model.critic_warmup_rollouts=3",
            "--model.kl_in_reward.controller=AdaptiveKLController",
            "--model.kl_in_reward.controller.init_args.coef=0.1",
            "--model.kl_in_reward.controller.init_args.target_kl=1e-6",
            "--model.kl_in_reward.controller.init_args.horizon=8",
        ),
        steps=8,
    ),
}


@pytest.mark.parametrize("experiment", sorted(RESUME_CASES))
def test_exact_resume_hf_engine(experiment, tmp_path):
    """N steps straight == N/2 steps, checkpoint, new process, N/2 more: bitwise, with HFEngine on CPU.
    For the actor-critic family the critic's weights and the KL coefficient too."""
    case = RESUME_CASES[experiment]
    straight, resumed = _resume_runs(tmp_path, *case["extra"], experiment=experiment, steps=case.get("steps", 4))
    assert straight.keys() == resumed.keys()
    initial = load_file(embedded_checkpoint() / "model.safetensors")
    assert any(not torch.equal(straight[k], initial[k]) for k in straight if k in initial), "training changed nothing"
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), f"{name} differs after resume"
    if experiment != "ppo":
        return
    for file in ("critic/model.safetensors", "critic/value_head.safetensors"):
        straight, resumed = (load_file(tmp_path / run / "export" / file) for run in ("straight", "split"))
        assert any(t.abs().sum() > 0 for t in straight.values())
        for name in straight:
            assert torch.equal(straight[name], resumed[name]), f"critic {name} differs after resume"
    straight, resumed = (
        torch.load(tmp_path / run / "ckpts" / "last.ckpt", weights_only=True) for run in ("straight", "split")
    )
    coef = straight["state_dict"]["kl_in_reward._extra_state"]["coef"]
    assert coef != 0.1, "the adaptive coefficient never moved"
    assert resumed["state_dict"]["kl_in_reward._extra_state"]["coef"] == coef
    assert len(straight["optimizer_states"]) == 2


@pytest.mark.vllm
def test_exact_resume_vllm_engine(tmp_path):
    """The same with VLLMEngine: per-request seeds make sampling reproducible; the stated tolerance
    covers vLLM's CPU kernels, whose log-probs differ from the trainer's by ~1e-7."""
    pytest.importorskip("vllm")
    straight, resumed = _resume_runs(tmp_path, "--data.engine=rlkit.engines.vllm.VLLMEngine")
    for name in straight:
        torch.testing.assert_close(resumed[name], straight[name], rtol=0, atol=1e-5, msg=f"{name} after resume")

    # the exported policy is a checkpoint vLLM serves as it is
    from rlkit.engines.vllm import VLLMEngine

    engine = VLLMEngine(max_new_tokens=4)
    engine.start(str(tmp_path / "split" / "export"))
    try:
        [[generation]] = engine.generate([[1, 7, 14, 9, 18]], n=1, seed=0, greedy=True)
        assert 1 <= len(generation.token_ids) <= 4
    finally:
        engine.close()


def test_readme_commands_are_current():
    readme = (ROOT / "README.md").read_text()
    assert "rlkit fit --config experiments/drgrpo.yaml" in readme
    assert "bash scripts/install.sh && python -m pytest" in readme
    ci = (ROOT / ".ci" / "run").read_text()
    assert "bash scripts/install.sh && python -m pytest" in ci


def test_validate_subcommand_from_a_checkpoint(tmp_path, monkeypatch):
    """``rlkit validate --ckpt_path=...`` scores held-out prompts greedily with the checkpoint's weights."""
    monkeypatch.chdir(tmp_path)
    args = short_args(tmp_path, "drgrpo", f"--config={EVERY_STEP}", "--trainer.max_steps=2")
    build_cli(args)
    assert (tmp_path / "ckpts" / "last.ckpt").exists()
    # other data settings than the fit's: validation may score a checkpoint on any data (a resumed fit may not)
    cli = build_cli([*args[1:], "--trainer.limit_val_batches=1.0", "--data.samples_per_prompt=2"], run=False)
    [results] = cli.trainer.validate(cli.model, cli.datamodule, ckpt_path="ckpts/last.ckpt")
    accuracy = results["val/reward"]  # what `rlkit validate` prints
    assert 0.0 <= accuracy <= 1.0 and accuracy == cli.trainer.callback_metrics["val/reward"].item()
    assert results["val/length"] >= 1.0


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_fit_on_a_prompt_file_in_verl_layout(suffix, tmp_path, monkeypatch):
    """Real-use data path: prompts and ground truths from a verl-layout file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.chdir(tmp_path)
    rows = [{"prompt": f"{a}+{b}=", "reward_model": {"ground_truth": str(a + b)}} for a in range(4) for b in range(4)]
    path = tmp_path / f"train.{suffix}"
    if suffix == "jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)
    args = short_args(
        tmp_path, "drgrpo", "--data.prompts=rlkit.data.prompts.PromptFile", f"--data.prompts.path={path}"
    )[1:]
    recorder = _Recorder()
    cli = build_cli(args, run=False)
    cli.trainer.callbacks.append(recorder.callback)
    cli.trainer.fit(cli.model, cli.datamodule)
    assert len(recorder.rollouts) == 4
    prompts = {text for rollout in recorder.rollouts for text in rollout.prompt_texts}
    assert prompts <= {row["prompt"] for row in rows}


def test_killed_run_resumes_exactly(tmp_path):
    """SIGKILL in the middle of training (possibly mid-checkpoint): resuming from ``last.ckpt`` ends
    bitwise where an uninterrupted run ends. Checkpoints are written to a temporary file and renamed
    (Lightning's fsspec transaction), so the kill never leaves a torn ``last.ckpt``."""
    import os
    import signal
    import subprocess
    import sys
    import time

    straight, killed = tmp_path / "straight", tmp_path / "killed"
    straight.mkdir(), killed.mkdir()
    common = [f"--config={EVERY_STEP}", "--trainer.max_steps=6"]
    result = run_rlkit(short_args(straight, "drgrpo", *common), cwd=straight)
    assert result.returncode == 0, result.stderr[-3000:]

    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "rlkit.cli", *short_args(killed, "drgrpo", *common)]
    process = subprocess.Popen(command, cwd=killed, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and len(list((killed / "ckpts").glob("*step=2*"))) == 0:
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (killed / "export").exists(), "the run finished before it was killed"
    result = run_rlkit(short_args(killed, "drgrpo", *common, "--ckpt_path=ckpts/last.ckpt"), cwd=killed)
    assert result.returncode == 0, result.stderr[-3000:]
    expected = load_file(straight / "export" / "model.safetensors")
    resumed = load_file(killed / "export" / "model.safetensors")
    for name in expected:
        assert torch.equal(expected[name], resumed[name]), f"{name} differs after kill and resume"


def test_checkpoint_holds_the_policy_but_not_the_reference(tmp_path, monkeypatch):
    """GRPO (K3 KL term) keeps a frozen reference policy; checkpoints stay the policy's size."""
    monkeypatch.chdir(tmp_path)
    args = short_args(tmp_path, "grpo", f"--config={EVERY_STEP}", "--trainer.max_steps=1")[1:]
    cli = build_cli(args, run=False)
    cli.trainer.fit(cli.model, cli.datamodule)
    assert "reference" in cli.model.spine.frozen, "GRPO must load a reference model for its KL term"
    checkpoint = torch.load(tmp_path / "ckpts" / "last.ckpt", weights_only=True)
    keys = set(checkpoint["state_dict"])
    assert keys == {f"policy.{name}" for name in cli.model.policy.state_dict()}
    data = checkpoint["RolloutDataModule"]
    assert data["iteration"] == 1 and set(data) == {"iteration", "source"}  # the source: what a resume checks


SGD = [
    "--model.optim.optimizer=torch.optim.SGD",
    "--model.optim.optimizer.init_args.lr=0.1",
    "--model.optim.max_grad_norm=null",
]


def _fit_state(tmp_path, monkeypatch, name: str, *extra: str) -> dict:
    workdir = tmp_path / name
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    cli = build_cli(short_args(workdir, "drgrpo", "--trainer.max_steps=2", *FLOAT64, *SGD, *extra)[1:], run=False)
    cli.trainer.fit(cli.model, cli.datamodule)
    return {k: v.clone() for k, v in cli.model.policy.state_dict().items()}, cli


@pytest.mark.parametrize("aggregation", ["SeqMeanTokenSumNorm", "SeqMeanTokenMean", "TokenMean"])
@pytest.mark.parametrize(
    "split",
    [
        "--model.loop.micro_batch_size=3",
        "--model.loop.micro_batch_tokens=24",
        "--model.loop.pack_sequences=true",
        "--model.loop.pack_sequences=true --model.loop.micro_batch_tokens=60",
    ],
)
def test_micro_batches_change_memory_not_maths(aggregation, split, tmp_path, monkeypatch):
    """16 rows in one forward, in micro-batches of 3 (uneven), in token-budget micro-batches (rows sorted
    by length, each cut to its own longest row), packed without padding into one row, or packed into
    micro-batches of at most 60 real tokens: the same update (SGD, no clipping, so a wrong normaliser or a
    sequence attending to its neighbour in the packed row would show)."""
    agg = f"--model.aggregation={aggregation}"
    whole, _ = _fit_state(tmp_path, monkeypatch, "whole", agg)
    sizes, packed = [], []
    monkeypatch.setattr(UpdateLoop, "micro_batches", _recording(UpdateLoop.micro_batches, sizes))
    monkeypatch.setattr(Policy, "_packed_forward", _recording_packed(Policy._packed_forward, packed))
    micro, _ = _fit_state(tmp_path, monkeypatch, "micro", agg, *split.split())
    if "micro_batch" in split:
        assert len(sizes) > 1 and max(sizes) < 16  # several micro-batches per step
    if "pack" in split:
        assert packed and max(packed) > 1  # the policy forwards ran packed, several sequences in a row
    initial = load_file(embedded_checkpoint() / "model.safetensors")
    assert_same_update(whole, micro, {f"model.{k}": v for k, v in initial.items()})


def _recording_packed(packed_forward, rows: list[int]):
    def wrapped(self, batch, hidden):
        rows.append(len(batch))
        return packed_forward(self, batch, hidden)

    return wrapped


def _recording(micro_batches, sizes: list[int]):
    def wrapped(self, rows, rollout):
        batches = micro_batches(self, rows, rollout)
        sizes.extend(len(b) for b in batches)
        return batches

    return wrapped


def test_on_policy_updates_skip_the_scoring_pass_and_change_nothing(tmp_path, monkeypatch):
    """One optimizer step per rollout: the old log-probs are the update's own, detached. The update and
    the metrics the scoring pass gave (entropy, engine/trainer mismatch) are those of a run that scores
    first, with one policy forward per micro-batch instead of two."""
    calls = {"skip": 0, "scored": 0}
    forward = Policy.forward

    def counting(run):
        def wrapped(self, *args, **kwargs):
            calls[run] += 1
            return forward(self, *args, **kwargs)

        return wrapped

    monkeypatch.setattr(Policy, "forward", counting("skip"))
    skipped, cli_skip = _fit_state(tmp_path, monkeypatch, "skip", "--model.loop.micro_batch_size=8")
    monkeypatch.setattr(Policy, "forward", counting("scored"))
    monkeypatch.setattr(UpdateLoop, "on_policy", property(lambda self: False))
    scored, cli_scored = _fit_state(tmp_path, monkeypatch, "scored", "--model.loop.micro_batch_size=8")
    assert (calls["skip"], calls["scored"]) == (2 * 2, 2 * 2 * 2)  # 2 steps x 2 micro-batches (x 2 passes)
    initial = load_file(embedded_checkpoint() / "model.safetensors")
    assert_same_update(scored, skipped, {f"model.{k}": v for k, v in initial.items()})
    metrics = ("policy/entropy", "mismatch/logprob_abs_diff", "mismatch/logprob_abs_diff_max", "mismatch/kl")
    for tag in (*metrics, "loss/policy"):
        torch.testing.assert_close(
            cli_skip.trainer.callback_metrics[tag], cli_scored.trainer.callback_metrics[tag], rtol=1e-5, atol=1e-6
        )
    # the ratio is exactly 1 when the update's forward gives the old log-probs (not logged), ~1 after a scoring pass
    assert "ratio/mean" not in cli_skip.trainer.callback_metrics
    assert cli_scored.trainer.callback_metrics["ratio/mean"].item() == pytest.approx(1.0, abs=1e-6)


def test_ppo_epochs_and_minibatches(tmp_path, monkeypatch):
    """2 rollouts x 2 epochs x 2 mini-batches = 8 optimizer steps; after the first optimizer step
    the policy is off the rollout's, so the ratio moves away from 1."""
    monkeypatch.chdir(tmp_path)
    args = short_args(
        tmp_path, "drgrpo", "--trainer.max_steps=8", "--model.loop.ppo_epochs=2", "--model.loop.minibatches=2"
    )
    cli = build_cli(args[1:] + ["--model.optim.optimizer.init_args.lr=1e-2"], run=False)
    recorder = _Recorder()
    cli.trainer.callbacks.append(recorder.callback)
    cli.trainer.fit(cli.model, cli.datamodule)
    assert cli.trainer.global_step == 8
    assert len(recorder.rollouts) == 2
    scalars = _scalars(tmp_path / "runs")
    assert max(scalars["ratio/max"]) > 1.0 or min(scalars["ratio/min"]) < 1.0


def test_the_invariance_check_catches_a_wrong_normaliser(tmp_path, monkeypatch):
    """What the micro-batch comparisons guard against: each micro-batch's loss divided by its own tokens
    instead of the step's (a classic bug) moves the weights by far more than SAME_MATHS of the update, so
    the same check that passes above fails here; in float64 the two are orders of magnitude apart."""
    from rlkit.components.aggregation import TokenMean

    token_mean = "--model.aggregation=TokenMean"
    whole, _ = _fit_state(tmp_path, monkeypatch, "whole", token_mean)

    def own_tokens(self, loss, mask, totals):
        return (loss * mask).sum() / mask.sum().clamp(min=1)  # the micro-batch's own normaliser

    monkeypatch.setattr(TokenMean, "__call__", own_tokens)
    broken, _ = _fit_state(tmp_path, monkeypatch, "broken", token_mean, "--model.loop.micro_batch_size=3")
    initial = {f"model.{k}": v for k, v in load_file(embedded_checkpoint() / "model.safetensors").items()}
    with pytest.raises(AssertionError, match="more than"):
        assert_same_update(whole, broken, initial)
    update = assert_same_update(whole, whole, initial)
    gap = max((broken[k] - whole[k]).abs().max().item() for k in whole)
    assert gap > 1e3 * SAME_MATHS * update, (
        f"a wrong normaliser moved the weights by only {gap / update:.3g} of the update"
    )
