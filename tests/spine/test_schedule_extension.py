"""Resuming a finished run with a larger ``trainer.max_steps`` stretches its LinearDecay to the new length
(the lr goes on, not 0), and the logged ``lr`` is the one the step used."""

from __future__ import annotations

import logging

import pytest
import torch

from rlkit.cli import main
from rlkit.schedules import LinearDecay
from rlkit.spine.optim import build_optimizer
from rlkit.spine.settings import Optimization
from spine.helpers import event_files, short_args


def _sgd(lr=1.0):
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def _run_steps(optimizer, scheduler, n):
    for _ in range(n):
        optimizer.step()
        scheduler.step()


def test_a_schedule_that_follows_the_run_is_stretched_on_resume(capsys):
    optim = Optimization(optimizer=_sgd_factory, lr_scheduler=LinearDecay)
    optimizer, scheduler = build_optimizer([torch.nn.Parameter(torch.zeros(1))], optim, max_steps=5)
    _run_steps(optimizer, scheduler, 5)
    assert optimizer.param_groups[0]["lr"] == 0.0  # the 5-step schedule has ended
    state = (optimizer.state_dict(), scheduler.state_dict())
    # resume with max_steps=8: built anew for 8 steps, then restored (optimizer first, as Lightning does)
    optimizer, scheduler = build_optimizer([torch.nn.Parameter(torch.zeros(1))], optim, max_steps=8)
    optimizer.load_state_dict(state[0])
    scheduler.load_state_dict(state[1])
    assert scheduler.total_steps == 8 and scheduler.last_epoch == 5
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1.0 - 5 / 8)  # step 6 of an 8-step decay
    assert "stretched from 5 to 8" in capsys.readouterr().err
    _run_steps(optimizer, scheduler, 3)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.0)  # and it still ends with the run


def test_a_schedule_of_fixed_length_is_restored_as_it_was():
    optimizer = _sgd()
    scheduler = LinearDecay(optimizer, total_steps=4)
    _run_steps(optimizer, scheduler, 2)
    state = (optimizer.state_dict(), scheduler.state_dict())
    optimizer = _sgd()
    scheduler = LinearDecay(optimizer, total_steps=10)
    optimizer.load_state_dict(state[0])
    scheduler.load_state_dict(state[1])
    assert scheduler.total_steps == 4 and optimizer.param_groups[0]["lr"] == pytest.approx(0.5)


def _sgd_factory(params):
    return torch.optim.SGD(params, lr=1.0)


def _logged_lr(runs) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    values = {}
    for events in event_files(runs):
        accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0})
        accumulator.Reload()
        values.update({e.step: e.value for e in accumulator.Scalars("lr")})
    return values


def test_extending_a_finished_run_trains_with_lr_above_zero(tmp_path, monkeypatch, capsys):
    """The issue's case: a 5-step run, then ``--ckpt_path=last --trainer.max_steps=8``."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(logging, "raiseExceptions", False)  # in-process runs: see test_cli_errors
    lr = 3e-4  # the embedded task's
    main(short_args(tmp_path, "drgrpo", "--trainer.max_steps=5"))
    [last] = list((tmp_path / "runs").rglob("last.ckpt"))
    before = torch.load(last, weights_only=True, map_location="cpu")["state_dict"]
    main(short_args(tmp_path, "drgrpo", "--trainer.max_steps=8", "--ckpt_path=last"))
    assert "stretched from 5 to 8" in capsys.readouterr().err
    logged = _logged_lr(tmp_path / "runs")
    # the logged lr is the one each step used: the first step's is the initial lr, the last one's above 0
    # (x = the rollout's index: rollout k takes optimizer step k + 1 here)
    assert logged[0] == pytest.approx(lr) and logged[4] == pytest.approx(lr * (1 - 4 / 5))
    for step in (5, 6, 7):  # an 8-step decay, from where the first run stopped
        assert logged[step] == pytest.approx(lr * (1 - step / 8), rel=1e-4), logged
    after = torch.load(last, weights_only=True, map_location="cpu")["state_dict"]
    assert any(not torch.equal(before[k], after[k]) for k in before)  # steps 6-8 moved the weights
