"""The run-ahead producer in its own process (``data.async_producer: process``, ``rlkit.rollouts.process``): the
fixed schedule gives bitwise the thread's rollouts and weights and a resume is exact, and a child that dies or raises
stops the run with one line naming it, leaving no process behind."""

from __future__ import annotations

import multiprocessing
import os
import signal

import lightning.pytorch as pl
import pytest
import torch
from test_async_rollouts import EVERY_STEP, VISIBLE, _fit

from rlkit.engines.hf import HFEngine
from rlkit.errors import ConfigError
from rlkit.rollouts import RolloutDataModule
from rlkit.rollouts.ahead import ProducerError

ONE_STEP_OFF = [
    f"--config={EVERY_STEP}",
    "--data.max_staleness=1",
    "--data.producer_threads=1",
    "--model.optim.lr_scheduler.init_args.total_steps=4",
    *VISIBLE,
]
PROCESS = "--data.async_producer=process"


def _assert_same_rollouts(got, expected) -> None:
    assert [r.iteration for r in got] == [r.iteration for r in expected]
    assert [r.weights_version for r in got] == [r.weights_version for r in expected]
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a.input_ids, b.input_ids), f"rollout {a.iteration}: other completions"
        assert torch.equal(a.engine_logprobs, b.engine_logprobs), f"rollout {a.iteration}: other log-probs"
        assert torch.equal(a.scores, b.scores), f"rollout {a.iteration}: other rewards"


def _assert_same_weights(got: dict, expected: dict) -> None:
    for name, tensor in expected.items():
        assert torch.equal(tensor, got[name]), f"{name} differs"


def test_the_process_gives_the_thread_s_run_bitwise_and_resumes_exactly(tmp_path, monkeypatch):
    """At staleness 1, 4 rollouts with the producer in a thread; then in a process, 2 rollouts, a checkpoint
    holding the one sampled ahead by older weights, and 2 more in a new trainer (and a new child): the same
    rollouts (each trained once) and the same weights after each part, bitwise."""
    thread_cli, thread = _fit(tmp_path / "thread", monkeypatch, *ONE_STEP_OFF)
    assert [r.weights_version for r in thread.rollouts] == [1, 1, 2, 3]  # the one-step-off schedule
    first_cli, first = _fit(tmp_path / "process", monkeypatch, *ONE_STEP_OFF, PROCESS, steps=2)
    _assert_same_rollouts(first.rollouts, thread.rollouts[:2])
    _assert_same_weights(first_cli.model.policy.state_dict(), thread.weights[2])  # after update 1
    checkpoint = torch.load(tmp_path / "process" / "ckpts" / "last.ckpt", weights_only=True)["RolloutDataModule"]
    assert [r["iteration"] for r in checkpoint["ahead"]] == [2] and checkpoint["weights_version"] == 3
    assert not multiprocessing.active_children()
    resumed, second = _fit(tmp_path / "process", monkeypatch, *ONE_STEP_OFF, PROCESS, "--ckpt_path=ckpts/last.ckpt")
    _assert_same_rollouts(second.rollouts, thread.rollouts[2:])
    _assert_same_weights(resumed.model.policy.state_dict(), thread_cli.model.policy.state_dict())
    assert not multiprocessing.active_children()


class _KillTheProducer(pl.Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if batch.iteration == 0:
            os.kill(trainer.datamodule.ahead._backend.pid, signal.SIGKILL)


def test_a_killed_process_stops_the_run_naming_it_and_leaves_no_process(tmp_path, monkeypatch):
    with pytest.raises(ProducerError) as caught:
        _fit(tmp_path, monkeypatch, "--data.max_staleness=1", PROCESS, callbacks=[_KillTheProducer()])
    message = str(caught.value)
    assert "\n" not in message
    assert "the rollout producer process rlkit-rollout-producer-rank0 (pid " in message
    assert "died with exit code -9 (SIGKILL)" in message
    assert not multiprocessing.active_children()


class CrashingEngine(HFEngine):
    """Raises on its third sampling call (counted in the process that samples: the child)."""

    calls = 0

    def generate(self, *args, **kwargs):
        CrashingEngine.calls += 1
        if CrashingEngine.calls == 3:
            raise RuntimeError("engine crashed")
        return super().generate(*args, **kwargs)


def test_a_raising_process_stops_the_run_naming_it_and_leaves_no_process(tmp_path, monkeypatch):
    attach = RolloutDataModule.attach

    def attach_crashing(self, request):
        self.engine.__class__ = CrashingEngine  # the child gets a copy of it
        attach(self, request)

    monkeypatch.setattr(RolloutDataModule, "attach", attach_crashing)
    with pytest.raises(ProducerError) as caught:
        _fit(tmp_path, monkeypatch, "--data.max_staleness=1", PROCESS)
    message = str(caught.value)
    assert "\n" not in message
    assert "stopped on rollout 2 with ProducerProcessError: the rollout producer process " in message
    assert "raised RuntimeError: engine crashed" in message
    assert CrashingEngine.calls == 0  # the calls were the child's
    assert not multiprocessing.active_children()


def test_the_process_needs_a_staleness_bound():
    from rlkit.embedded import AdditionChain
    from rlkit.rewards import FinalAnswer

    with pytest.raises(ConfigError, match="set data.max_staleness to 1 or more"):
        RolloutDataModule(AdditionChain(num_prompts=32), HFEngine(), [FinalAnswer()], async_producer="process")
    with pytest.raises(ConfigError, match="must be thread or process"):
        RolloutDataModule(AdditionChain(num_prompts=32), HFEngine(), [FinalAnswer()], async_producer="fork")


class _Interrupt(pl.Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if batch.iteration == 1:
            raise KeyboardInterrupt  # what Ctrl-C raises in the trainer's main thread


def test_an_interrupted_run_leaves_no_process(tmp_path, monkeypatch):
    children = []

    class Watch(pl.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            children.append(trainer.datamodule.ahead._backend.pid)

    try:
        _fit(tmp_path, monkeypatch, "--data.max_staleness=1", PROCESS, callbacks=[Watch(), _Interrupt()])
    except (KeyboardInterrupt, SystemExit):  # Lightning may re-raise it or exit
        pass
    assert children and not multiprocessing.active_children()
