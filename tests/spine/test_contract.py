"""The family contract: declared needs checked at construction, old flat options, user modules by short name."""

from __future__ import annotations

import pytest

from rlkit.algorithms import ActorCritic, Distillation, OnlineDPO, PolicyGradient
from rlkit.cli import build_cli
from rlkit.components import (
    CISPO,
    GAE,
    GDPO,
    Clip,
    ClipOutput,
    GroupMean,
    LogProb,
    Need,
    NoClip,
    OptimalTokenBaseline,
    PPOClip,
    ReverseKL,
    SigmoidDPO,
    TokenMean,
    TokenRatio,
    TruncatedIS,
)
from rlkit.components.kl import K1
from rlkit.errors import ConfigError
from rlkit.spine import LoopSettings, OldLogProbs
from spine.helpers import EXPERIMENTS


class BandClip(Clip):
    """A user's clip that bounds the ratio, declared as such."""

    needs = frozenset({Need.RATIO})

    def __call__(self, inputs):
        return ClipOutput(-inputs.advantages * inputs.ratio.clamp(0.9, 1.1))


def pg(**kwargs):
    arguments = {"advantage": GroupMean(), "ratio": TokenRatio(), "clip": PPOClip(), "aggregation": TokenMean()}
    return PolicyGradient(**{**arguments, **kwargs})


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"advantage": GAE()},
            r"model.advantage=GAE needs a critic's values .* PolicyGradient does not provide: use the actor-critic",
        ),
        ({"ratio": LogProb()}, r"model.clip=PPOClip needs an importance ratio around 1 .* --model.ratio=TokenRatio"),
        ({"ratio": LogProb(), "clip": CISPO()}, r"model.clip=CISPO needs an importance ratio"),
        ({"ratio": LogProb(), "clip": BandClip()}, r"model.clip=BandClip needs an importance ratio"),  # a user's clip
        (
            {"advantage": OptimalTokenBaseline(use_is_weights=True)},
            r"needs rollout-correction weights .* set model.rollout_correction",
        ),
        (
            {"advantage": OptimalTokenBaseline(), "rollout_correction": TruncatedIS(bypass=True)},
            r"model.advantage=OptimalTokenBaseline needs the policy's scoring pass .*bypass=false",
        ),
    ],
)
def test_a_need_nothing_provides_is_a_one_line_config_error(kwargs, message):
    with pytest.raises(ConfigError, match=message) as error:
        pg(**kwargs)
    assert "\n" not in str(error.value)


def test_what_other_components_provide_meets_a_need():
    pg(ratio=LogProb(), clip=NoClip())  # REINFORCE: no ratio is bounded
    pg(ratio=TokenRatio(), clip=BandClip())
    pg(advantage=OptimalTokenBaseline(use_is_weights=True), rollout_correction=TruncatedIS())  # weights provided
    assert ActorCritic.provides >= {Need.VALUES} and Need.VALUES not in PolicyGradient.provides


def test_capabilities_hold_in_every_family():
    """The same needs checked in every family, so a family cannot accept what fails at its first step."""
    with pytest.raises(ConfigError, match="model.advantage=GAE needs a critic's values .* Distillation"):
        Distillation(ReverseKL(K1()), TokenRatio(), PPOClip(), TokenMean(), reward_weight=1.0, advantage=GAE())
    # GDPO reads each reward function's score: every family's spine provides them now
    family = Distillation(ReverseKL(K1()), TokenRatio(), PPOClip(), TokenMean(), reward_weight=1.0, advantage=GDPO())
    assert Need.REWARD_TERMS in family.spine.needs


@pytest.mark.parametrize(
    "kwargs, loop, source",
    [
        ({}, {}, OldLogProbs.UPDATE_FORWARD),  # one optimizer step per rollout: the update's own forward
        ({}, {"ppo_epochs": 2}, OldLogProbs.RECOMPUTED),
        ({"rollout_correction": TruncatedIS()}, {}, OldLogProbs.RECOMPUTED),  # decoupled: compared before
        ({"rollout_correction": TruncatedIS(bypass=True)}, {"ppo_epochs": 2}, OldLogProbs.ENGINE),
        ({"advantage": OptimalTokenBaseline()}, {}, OldLogProbs.RECOMPUTED),
    ],
)
def test_where_old_log_probs_come_from_is_decided_once(kwargs, loop, source):
    assert pg(loop=LoopSettings(**loop), **kwargs).spine.old_logprobs is source


def test_a_reference_is_loaded_when_a_component_needs_one():
    assert Need.REFERENCE not in pg().spine.needs
    assert Need.REFERENCE in pg(kl=K1()).spine.needs
    assert Need.REFERENCE in OnlineDPO(SigmoidDPO(), loop=LoopSettings(keep_groups=True)).spine.needs


def test_online_dpo_needs_its_pairs_together():
    with pytest.raises(ConfigError, match="--model.loop.keep_groups=true"):
        OnlineDPO(SigmoidDPO())


@pytest.mark.parametrize(
    "flag, new",
    [
        ("--model.ppo_epochs=2", "--model.loop.ppo_epochs"),
        ("--model.micro_batch_tokens=64", "--model.loop.micro_batch_tokens"),
        ("--model.checkpoint=/tmp/x", "--model.policy.checkpoint"),
        ("--model.max_grad_norm=2", "--model.optim.max_grad_norm"),
        ("--model.optimizer=torch.optim.SGD", "--model.optim.optimizer"),
    ],
)
def test_an_old_flat_option_names_its_new_place(flag, new, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        build_cli(["fit", f"--config={EXPERIMENTS / 'drgrpo.yaml'}", flag, "--print_config"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"is now {new.removeprefix('--')}" in err and f"write {new}=" in err


def test_an_old_flat_key_in_a_config_file_names_its_new_place(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    old = tmp_path / "old.yaml"
    old.write_text("model:\n  init_args:\n    critic_optimizer:\n      class_path: torch.optim.SGD\n")
    with pytest.raises(SystemExit):
        build_cli(["fit", f"--config={EXPERIMENTS / 'ppo.yaml'}", f"--config={old}", "--print_config"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "model.critic_optimizer is now model.critic_optim.optimizer" in err


def test_a_typo_in_a_nested_setting_is_refused_not_abbreviated(tmp_path, monkeypatch, capsys):
    """jsonargparse's nested parsers would expand --model.loop.ppo_epoch to ppo_epochs silently."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        build_cli(["fit", f"--config={EXPERIMENTS / 'drgrpo.yaml'}", "--model.loop.ppo_epoch=2", "--print_config"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "model.loop has no setting 'ppo_epoch' (did you mean ppo_epochs?)" in err


def test_null_reaches_a_nested_setting(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = [f"--config={EXPERIMENTS / 'dapo.yaml'}", "--model.optim.max_grad_norm=null", "--data.group_filter=null"]
    config = build_cli(args, run=False).config
    assert config.model.init_args.optim.max_grad_norm is None and config.data.init_args.group_filter is None


def test_a_module_that_cannot_be_imported_is_a_config_error(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"imports: could not import 'no_such_module_x'"):
        build_cli([f"--config={EXPERIMENTS / 'drgrpo.yaml'}", "--import=no_such_module_x"], run=False)
