"""Rollouts generated ahead of training (``data.max_staleness``, the fixed pipeline schedule of
``rlkit.rollouts.ahead``): the thread at staleness 0 is the synchronous path bitwise, rollout ``k`` is sampled
by the weights after update ``k - 1 - s``, the lag bound is enforced, a resume is exact and trains every
rollout once, and a failing producer thread stops the run naming itself and leaves no thread behind."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from safetensors.torch import load_file
from spine.helpers import ROOT, event_files, short_args

from rlkit.cli import build_cli
from rlkit.data.batch import Rollout
from rlkit.embedded import AdditionChain
from rlkit.engines.hf import HFEngine
from rlkit.errors import ConfigError
from rlkit.rewards import FinalAnswer
from rlkit.rollouts import RolloutDataModule, RolloutSource, StepShape
from rlkit.rollouts.ahead import AheadProducer, ProducerError, _between, overlap_fraction, sampling_version
from rlkit.spine.sync import PolicyLagError, WeightSync

EVERY_STEP = Path(__file__).parents[1] / "spine" / "checkpoint_every_step.yaml"
#: large visible updates (as tests/spine/test_fit.py's lag test): lag is then told apart by log-probs
VISIBLE = ["--model.optim.optimizer.init_args.lr=1e-2", "--model.entropy_coef=0.1"]


class _Recorder(pl.Callback):
    """Each rollout the trainer gets, and the policy's weights when it gets it (after update k-1)."""

    def __init__(self) -> None:
        self.rollouts: list[Rollout] = []
        self.weights: list[dict] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.rollouts.append(batch)
        self.weights.append(copy.deepcopy(module.policy.state_dict()))


def _fit(workdir: Path, monkeypatch, *extra: str, steps: int = 4, callbacks=(), experiment: str = "drgrpo"):
    workdir.mkdir(parents=True, exist_ok=True)
    monkeypatch.chdir(workdir)
    args = [a for a in extra if not a.startswith("--ckpt_path=")]  # fit's argument, not the parser's
    cli = build_cli(short_args(workdir, experiment, f"--trainer.max_steps={steps}", *args)[1:], run=False)
    recorder = _Recorder()
    cli.trainer.callbacks.extend([recorder, *callbacks])
    cli.trainer.fit(cli.model, cli.datamodule, ckpt_path=_ckpt(extra))
    return cli, recorder


def _ckpt(extra) -> str | None:
    return next((a.split("=", 1)[1] for a in extra if a.startswith("--ckpt_path=")), None)


def _producer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("rlkit-rollout-producer")]


def test_sampling_versions_of_the_fixed_schedule():
    assert [sampling_version(k, 0) for k in range(4)] == [1, 2, 3, 4]  # the synchronous schedule
    assert [sampling_version(k, 1) for k in range(4)] == [1, 1, 2, 3]  # one-step-off
    assert [sampling_version(k, 2) for k in range(5)] == [1, 1, 1, 2, 3]
    assert sampling_version(5, 1, floor=5) == 5  # a resumed run's first push


def _events(workdir: Path):
    """The run's TensorBoard scalars and histograms."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = event_files(workdir / "runs")
    accumulator = EventAccumulator(str(events.parent), size_guidance={"scalars": 0, "histograms": 0})
    accumulator.Reload()
    return accumulator


def test_overlap_is_the_share_of_the_producers_work_outside_the_trainers_waits():
    # work 0-2 and 3-5 (4 s; 2-3 waiting for scoring), the trainer waiting 1-3.5: 1 s + 0.5 s shared
    assert overlap_fraction([(0.0, 2.0), (3.0, 5.0)], [(1.0, 3.5)]) == pytest.approx(1 - 1.5 / 4)
    assert overlap_fraction([(0.0, 2.0)], []) == 1.0  # the trainer never waited
    assert overlap_fraction([(1.0, 2.0)], [(0.0, 1.5), (1.5, 3.0)]) == 0.0  # it waited throughout
    assert overlap_fraction([], [(0.0, 1.0)]) == 0.0
    assert _between(0.0, 10.0, [(2.0, 3.0), (5.0, 6.0)]) == [(0.0, 2.0), (3.0, 5.0), (6.0, 10.0)]
    assert _between(0.0, 4.0, [(0.0, 1.0)]) == [(1.0, 4.0)]


def test_the_thread_at_staleness_0_is_the_synchronous_path_bitwise(tmp_path, monkeypatch):
    """The producer thread and its engine copy, run at staleness 0 (it waits for each rollout's weights), give
    bitwise the weights and metrics of today's path, which ``max_staleness: 0`` (the default) keeps."""
    sync, _ = _fit(tmp_path / "sync", monkeypatch, *VISIBLE)
    attach = RolloutDataModule.attach

    def attach_with_thread(self, request):
        attach(self, request)
        if self.ahead is None:
            self.ahead = AheadProducer(self.producer, self._collate, self._encode, 0, 0, 1)

    monkeypatch.setattr(RolloutDataModule, "attach", attach_with_thread)
    threaded, recorder = _fit(tmp_path / "threaded", monkeypatch, *VISIBLE)
    assert "async/trainer_wait_s" in recorder.rollouts[0].stats, "the producer thread did not run"
    after = threaded.model.policy.state_dict()
    for name, tensor in sync.model.policy.state_dict().items():
        assert torch.equal(tensor, after[name]), f"{name} differs between the thread and the synchronous path"
    metrics = {k: v for k, v in sync.trainer.callback_metrics.items() if not k.startswith(("time/", "perf/"))}
    assert metrics and "loss/policy" in metrics
    for tag, value in metrics.items():
        assert torch.equal(value, threaded.trainer.callback_metrics[tag]), tag
    events = _events(tmp_path / "sync")  # the synchronous path has no async bookkeeping
    assert "reward/mean" in events.Tags()["scalars"]
    assert not [tag for tag in events.Tags()["scalars"] if tag.startswith("async/")]
    assert not events.Tags()["histograms"]
    assert not _producer_threads()


def test_one_step_off_samples_with_the_weights_before_the_last_update(tmp_path, monkeypatch):
    """``max_staleness: 1``: rollout k's engine log-probs (the behaviour policy's, which the rollout
    corrections and ``mismatch/*`` read) are those of the weights after update k-2, not k-1; its version
    lags by one, as the async metrics say."""
    cli, recorder = _fit(tmp_path, monkeypatch, *VISIBLE, "--data.max_staleness=1", "--data.producer_threads=1")
    rollouts = recorder.rollouts
    assert [r.iteration for r in rollouts] == [0, 1, 2, 3]
    assert [r.weights_version for r in rollouts] == [1, 1, 2, 3]
    assert [r.stats["async/staleness_max"] for r in rollouts] == [0.0, 1.0, 1.0, 1.0]
    assert all(r.stats["async/trainer_wait_s"] >= 0 and r.stats["async/producer_wait_s"] >= 0 for r in rollouts)
    assert all(0.0 <= r.stats["async/overlap"] <= 1.0 for r in rollouts)
    # the trainer waits for the first rollout: most of its work overlaps that wait (not all: the thread starts
    # while Lightning still sets up the loop, a share that grows with the load; 0.15 was seen at load 6)
    assert rollouts[0].stats["async/overlap"] < 0.5, "the trainer waits for the first rollout"
    histograms = _events(tmp_path).Histograms("async/staleness")  # every row's staleness, per rollout
    assert [h.step for h in histograms] == [0, 1, 2, 3]
    for h in histograms:
        lag = 0.0 if h.step == 0 else 1.0
        assert (h.histogram_value.min, h.histogram_value.max, h.histogram_value.num) == (lag, lag, 16), h
    policy = copy.deepcopy(cli.model.policy)
    for k in range(2, 4):
        sampling = _gap(policy, recorder.weights[k - 1], rollouts[k])  # weights after update k-2
        latest = _gap(policy, recorder.weights[k], rollouts[k])  # weights after update k-1
        assert sampling < 1e-4, f"rollout {k}: engine vs the weights after update {k - 2}: {sampling}"
        assert latest > 1e-3, f"rollout {k}: the updates are too small to tell the versions apart ({latest})"
    assert not _producer_threads()


def _gap(policy, weights: dict, rollout: Rollout, tokens: torch.Tensor | None = None) -> float:
    """The largest gap between ``rollout``'s engine log-probs and those of ``policy`` with ``weights``, on
    ``tokens [N, T]`` (None: every completion token in the loss)."""
    policy.load_state_dict(weights)
    with torch.no_grad():
        logprobs = policy(rollout, 1.0).logprobs  # [N, T]
    mask = rollout.completion_mask.bool() if tokens is None else tokens
    return (logprobs - rollout.engine_logprobs)[mask].abs().max().item()


class _Source(RolloutSource):
    """A source whose weights version and bound the test sets."""

    def __init__(self, version: int, bound: int) -> None:
        super().__init__()
        self.version, self.max_staleness = version, bound

    def attach(self, request):
        pass

    def push_weights(self, named_tensors):
        pass

    @property
    def weights_version(self) -> int:
        return self.version

    def step_shape(self):
        return StepShape(1, 1)

    def held_out_batches(self):
        return []


@pytest.mark.parametrize(("lag", "bound", "caught"), [(0, 0, False), (1, 0, True), (1, 1, False), (2, 1, True)])
def test_the_lag_bound_is_enforced(lag, bound, caught):
    trainer = SimpleNamespace(datamodule=_Source(version=5, bound=bound), logger=None)
    batch = SimpleNamespace(weights_version=5 - lag, iteration=7)
    check = lambda: WeightSync().on_train_batch_start(trainer, None, batch, 0)  # noqa: E731
    if caught:
        with pytest.raises(PolicyLagError, match=f"{lag} update\\(s\\) old, outside 0..data.max_staleness={bound}"):
            check()
    else:
        check()
    with pytest.raises(PolicyLagError):  # sampled by weights newer than the trainer's: never valid
        WeightSync().on_train_batch_start(trainer, None, SimpleNamespace(weights_version=6, iteration=7), 0)


def test_resume_is_exact_and_trains_every_rollout_once(tmp_path, monkeypatch):
    """``max_staleness: 1``, 4 rollouts straight == 2, a checkpoint holding the one rollout sampled ahead by
    older weights, and 2 more in a new trainer: bitwise, each rollout (and so each prompt) trained once."""
    every = [f"--config={EVERY_STEP}", "--data.max_staleness=1", "--model.optim.lr_scheduler.init_args.total_steps=4"]
    straight, full = _fit(tmp_path / "straight", monkeypatch, *every)
    _, first = _fit(tmp_path / "split", monkeypatch, *every, steps=2)
    checkpoint = torch.load(tmp_path / "split" / "ckpts" / "last.ckpt", weights_only=True)["RolloutDataModule"]
    assert checkpoint["iteration"] == 2 and checkpoint["max_staleness"] == 1 and checkpoint["weights_version"] == 3
    assert [r["iteration"] for r in checkpoint["ahead"]] == [2] and checkpoint["ahead"][0]["weights_version"] == 2
    resumed, second = _fit(tmp_path / "split", monkeypatch, *every, "--ckpt_path=ckpts/last.ckpt")
    trained = first.rollouts + second.rollouts
    assert [r.iteration for r in trained] == [0, 1, 2, 3]
    assert [r.weights_version for r in trained] == [r.weights_version for r in full.rollouts]
    assert [r.prompt_texts for r in trained] == [r.prompt_texts for r in full.rollouts]
    after = resumed.model.policy.state_dict()
    for name, tensor in straight.model.policy.state_dict().items():
        assert torch.equal(tensor, after[name]), f"{name} differs after resume"
    with pytest.raises(ConfigError, match="resume with data.max_staleness=1"):
        _fit(tmp_path / "split", monkeypatch, f"--config={EVERY_STEP}", "--ckpt_path=ckpts/last.ckpt")


class _OwnEnvironment(pl.Callback):
    """Whether the producer thread plays its episodes with an environment of its own, per training batch."""

    def __init__(self) -> None:
        self.own: list[bool] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        data = trainer.datamodule
        if data.ahead._backend is None:  # the process's copy is pickled into it
            self.own.append(data.ahead._producer.environment is not data.environment)


def test_episodes_run_ahead_and_resume_exactly(tmp_path, monkeypatch):
    """Multi-turn episodes (experiments/multiturn.yaml: running sums, the environment revealing each next
    term) at ``max_staleness: 1``: 4 rollouts straight (thread) == 2 with the thread, a
    checkpoint holding the episodes sampled ahead, and 2 more in a new trainer with the producer in its own
    process: the same episodes with the one-step-off versions, bitwise the same weights."""
    every = [f"--config={EVERY_STEP}", "--data.max_staleness=1", "--model.optim.lr_scheduler.init_args.total_steps=4"]
    every.append("--data.environment.init_args.turn_reward=0.5")  # per-turn rewards in the token rewards
    own = _OwnEnvironment()
    straight, full = _fit(tmp_path / "straight", monkeypatch, *every, callbacks=[own], experiment="multiturn")
    assert own.own == [True] * 4, "the thread shares the validation's environment"
    assert [r.weights_version for r in full.rollouts] == [1, 1, 2, 3]
    assert all(r.stats["episode/length_environment"] > 0 for r in full.rollouts), "no episode had a second turn"
    assert all(r.turn_ids is not None and r.token_rewards is not None for r in full.rollouts)
    _, first = _fit(tmp_path / "split", monkeypatch, *every, steps=2, experiment="multiturn")
    checkpoint = torch.load(tmp_path / "split" / "ckpts" / "last.ckpt", weights_only=True)["RolloutDataModule"]
    assert [(r["iteration"], r["weights_version"]) for r in checkpoint["ahead"]] == [(2, 2)]
    resume = ["--data.async_producer=process", "--ckpt_path=ckpts/last.ckpt"]
    resumed, second = _fit(tmp_path / "split", monkeypatch, *every, *resume, experiment="multiturn")
    trained = first.rollouts + second.rollouts
    assert [r.iteration for r in trained] == [0, 1, 2, 3]
    assert [r.weights_version for r in trained] == [r.weights_version for r in full.rollouts]
    for a, b in zip(trained, full.rollouts, strict=True):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.turn_ids, b.turn_ids), a.iteration
        assert torch.equal(a.token_rewards, b.token_rewards), a.iteration
    after = resumed.model.policy.state_dict()
    for name, tensor in straight.model.policy.state_dict().items():
        assert torch.equal(tensor, after[name]), f"{name} differs after resume"
    assert not _producer_threads()


def test_each_rank_resumes_its_own_rollouts_ahead_and_another_rank_count_is_refused():
    """A checkpoint of 2 ranks holds each rank's rollouts sampled ahead (``ahead_by_rank``; Lightning writes
    rank 0's state only); each rank takes its own. Rollouts ahead cannot be re-split over another number of
    ranks: one line, unless there are none (the free schedule may hold none)."""
    data = RolloutDataModule(AdditionChain(num_prompts=32), HFEngine(), [FinalAnswer()], prompts_per_step=4,
                             max_staleness=1)  # fmt: skip
    state = {**data.schedule.state_dict(), "max_staleness": 1, "async_schedule": "fixed", "weights_version": 3}
    two = {**state, "ahead": ["rank 0's"], "ahead_by_rank": [["rank 0's"], ["rank 1's"]]}
    for (rank, world_size), saved, expected in [
        ((1, 2), two, ["rank 1's"]), ((0, 2), two, ["rank 0's"]), ((0, 1), {**state, "ahead": ["one"]}, ["one"]),
        ((0, 1), {**state, "ahead": [], "ahead_by_rank": [[], []]}, []),
    ]:  # fmt: skip
        data.trainer = SimpleNamespace(global_rank=rank, world_size=world_size)
        data.load_state_dict(saved)
        assert data._restored["ahead"] == expected and data.weights_version == 2
    for (rank, world_size), saved, count in [((0, 1), two, 2), ((1, 2), {**state, "ahead": ["one"]}, 1)]:
        data.trainer = SimpleNamespace(global_rank=rank, world_size=world_size)
        with pytest.raises(ConfigError, match=f"on {count} data-parallel rank.* this run has {world_size}: resume on"):
            data.load_state_dict(saved)


def test_a_dying_producer_stops_the_run_naming_it_and_leaves_no_thread(tmp_path, monkeypatch):
    generate, calls = HFEngine.generate, []

    def crashing(self, *args, **kwargs):
        calls.append(threading.current_thread().name)
        if len(calls) == 3:
            raise RuntimeError("engine crashed")
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(HFEngine, "generate", crashing)
    with pytest.raises(ProducerError) as caught:
        _fit(tmp_path, monkeypatch, "--data.max_staleness=1")
    message = str(caught.value)
    assert "\n" not in message
    assert "rollout producer thread (rlkit-rollout-producer-rank0" in message
    assert "stopped on rollout 2 with RuntimeError: engine crashed" in message
    assert set(calls) == {"rlkit-rollout-producer-rank0"}
    assert not _producer_threads()


def test_a_hanging_producer_stops_the_run_within_the_timeout_and_the_last_checkpoint_resumes(tmp_path, monkeypatch):
    """An engine that blocks on rollout 2: the trainer gives up after ``data.producer_timeout_s`` (here while
    step 2's checkpoint waits for rollout 2) with one line naming the thread, the rollout and what it was doing;
    the thread is abandoned (it ends once the engine returns), and the last checkpoint resumes to the end."""
    generate, calls, release = HFEngine.generate, [], threading.Event()

    def hanging(self, *args, **kwargs):
        calls.append(threading.current_thread().name)
        if len(calls) == 3 and not release.wait(timeout=120):  # bounded: a missing timeout fails, never hangs
            raise RuntimeError("the engine stand-in was never released")
        return generate(self, *args, **kwargs)

    every = [f"--config={EVERY_STEP}", "--data.max_staleness=1", "--model.optim.lr_scheduler.init_args.total_steps=4"]
    monkeypatch.setattr(HFEngine, "generate", hanging)
    with pytest.raises(ProducerError) as caught:
        _fit(tmp_path, monkeypatch, *every, "--data.producer_timeout_s=2")
    message = str(caught.value)
    assert "\n" not in message
    assert (
        "rollout producer thread (rlkit-rollout-producer-rank0) gave no sign for data.producer_timeout_s=2 s" in message
    )
    assert "waited for rollout 2 for the checkpoint: it is on rollout 2, generating" in message
    assert "raise data.producer_timeout_s (null: wait forever)" in message
    release.set()  # the abandoned thread returns from the engine and ends
    for thread in _producer_threads():
        thread.join(timeout=60)
    assert not _producer_threads()
    checkpoint = torch.load(tmp_path / "ckpts" / "last.ckpt", weights_only=True)["RolloutDataModule"]
    assert checkpoint["iteration"] == 1 and [r["iteration"] for r in checkpoint["ahead"]] == [1]
    monkeypatch.setattr(HFEngine, "generate", generate)
    _, resumed = _fit(tmp_path, monkeypatch, *every, "--ckpt_path=ckpts/last.ckpt")
    assert [r.iteration for r in resumed.rollouts] == [1, 2, 3]
    with pytest.raises(ConfigError, match="producer_timeout_s must be > 0 seconds or null"):
        RolloutDataModule(AdditionChain(num_prompts=32), HFEngine(), [FinalAnswer()], producer_timeout_s=0)


def test_sigterm_checkpoints_the_rollout_ahead_and_the_resume_ends_bitwise_where_a_straight_run_ends(tmp_path):
    """SIGTERM mid-run with ``max_staleness: 1`` (issue 21's ``StopOnSignal``, in a real ``rlkit fit``): exit
    143 at a rollout's end, ``last.ckpt`` holding the latest weights version and the rollout sampled ahead
    by the weights before the last update, no producer thread left at exit; ``--ckpt_path=last`` then ends
    bitwise where an uninterrupted run ends. Six steps: on a quiet machine a step takes a fraction of a second, and
    with four the signal sent once step 2's checkpoint is seen was once handled only at the last step."""
    steps, runs = 6, {}
    for name in ("straight", "stopped"):
        run = tmp_path / name
        run.mkdir()
        args = short_args(
            run, "drgrpo", f"--config={EVERY_STEP}", "--data.max_staleness=1", f"--trainer.max_steps={steps}",
            f"--model.optim.lr_scheduler.init_args.total_steps={steps}",
            "--trainer.callbacks+=trained_log.ThreadsAtExit",
            f"--trainer.callbacks.init_args.path={run / 'threads.txt'}",
        )  # fmt: skip
        process = _subprocess(args, run)
        if name == "stopped":  # during rollout 2 (step 2's checkpoint is on disk)
            while process.poll() is None and not list((run / "ckpts").glob("*step=2*")):
                time.sleep(0.05)
            process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=600)
        runs[name] = (run, args, process.returncode, err)
    run, args, code, err = runs["stopped"]
    assert code == 143, err[-3000:]
    assert "Traceback" not in err and not (run / "export").exists(), err[-3000:]
    assert not [t for t in (run / "threads.txt").read_text().split() if t.startswith("rlkit-rollout-producer")]
    checkpoint = torch.load(run / "ckpts" / "last.ckpt", weights_only=True, mmap=True)
    state, step = checkpoint["RolloutDataModule"], checkpoint["global_step"]
    assert 2 < step < steps and state["iteration"] == step, err[-3000:]
    assert state["weights_version"] == step + 1, "the checkpoint was written before the weights push"
    assert [(r["iteration"], r["weights_version"]) for r in state["ahead"]] == [(step, step)]
    resumed = _subprocess([*args, "--ckpt_path=last"], run)
    _, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err[-3000:]
    straight = load_file(runs["straight"][0] / "export" / "model.safetensors")
    after = load_file(run / "export" / "model.safetensors")
    for name, tensor in straight.items():
        assert torch.equal(tensor, after[name]), f"{name} differs after SIGTERM and resume"
    assert not [t for t in (run / "threads.txt").read_text().split() if t.startswith("rlkit-rollout-producer")]


def _subprocess(args: list[str], cwd: Path) -> subprocess.Popen:
    """``rlkit`` (``args`` from ``short_args``) in a new process, the test modules importable."""
    path = os.pathsep.join([str(ROOT / "tests"), str(ROOT / "tests" / "data"), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)
    return subprocess.Popen(
        [sys.executable, "-m", "rlkit.cli", *args], cwd=cwd, env=env, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def test_a_failing_trainer_stops_the_producer_thread(tmp_path, monkeypatch):
    class Fail(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if batch.iteration == 1:
                raise RuntimeError("trainer failed")

    with pytest.raises(RuntimeError, match="trainer failed"):
        _fit(tmp_path, monkeypatch, "--data.max_staleness=2", callbacks=[Fail()])
    assert not _producer_threads()


def test_staleness_needs_an_engine_it_can_copy():
    from rlkit.engines.base import RolloutEngine

    class Remote(RolloutEngine):
        temperature, max_new_tokens = 1.0, 4

        def start(self, checkpoint_dir, trust_remote_code=False):
            pass

        def generate(self, prompts, n, seed, greedy=False):
            return []

        def update_weights(self, named_tensors):
            pass

    with pytest.raises(ConfigError, match="Remote does not support yet"):
        RolloutDataModule(AdditionChain(num_prompts=32), Remote(), [FinalAnswer()], max_staleness=1)
    with pytest.raises(ConfigError, match="max_staleness must be >= 0"):
        RolloutDataModule(AdditionChain(num_prompts=32), HFEngine(), [FinalAnswer()], max_staleness=-1)
