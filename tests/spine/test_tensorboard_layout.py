"""Which metrics a run's settings let move, and the CUSTOM SCALARS layout built from what a run logs.

The TensorBoard files of a real run are read in ``test_run_output.py``; these are the rules alone.
"""

from __future__ import annotations

import pytest

from rlkit.algorithms import PolicyGradient
from rlkit.components.advantage import GroupMean
from rlkit.components.aggregation import TokenMean
from rlkit.components.clip import DRO, SAPO, NoClip, PPOClip
from rlkit.components.covariance import ClipCov
from rlkit.components.ratio import LogProb, TokenRatio
from rlkit.components.rollout_correction import TruncatedIS
from rlkit.spine.reporting import HEADLINE_CATEGORY, StepWriter, headline_layout
from rlkit.spine.settings import LoopSettings


def _constant(clip=None, ratio=None, **kwargs) -> frozenset[str]:
    loop = LoopSettings(**{k: kwargs.pop(k) for k in ("ppo_epochs", "minibatches") if k in kwargs})
    module = PolicyGradient(GroupMean(), ratio or TokenRatio(), clip or PPOClip(), TokenMean(), loop=loop, **kwargs)
    return module.spine.constant_metrics()


@pytest.mark.parametrize(
    ("settings", "constant"),
    [
        ({}, {"ratio/", "clip/"}),  # one epoch, one mini-batch: log pi_old is the update's own forward
        ({"ppo_epochs": 2}, set()),
        ({"minibatches": 2}, set()),
        ({"clip": ClipCov()}, set()),  # reads the log-probs before the update: a scoring pass, a ratio ~1
        ({"rollout_correction": TruncatedIS(bypass=True)}, set()),  # the engine's log-probs: the ratio moves
        ({"clip": NoClip(), "ratio": LogProb(), "ppo_epochs": 2}, {"clip/"}),  # never clips, whatever the loop
        ({"clip": SAPO(), "ppo_epochs": 2}, {"clip/"}),
        ({"clip": DRO(), "minibatches": 2}, {"clip/"}),
    ],
)
def test_constant_metrics_follow_the_settings(settings, constant):
    assert _constant(**settings) == constant


def test_the_writer_leaves_out_names_and_prefixes():
    writer = StepWriter()
    writer.constant = frozenset({"ratio/", "clip/", "reward/errors"})
    assert not writer.moves("ratio/mean") and not writer.moves("clip/fraction") and not writer.moves("reward/errors")
    assert writer.moves("reward/errors_total") and writer.moves("reward/mean") and writer.moves("ratios")


def test_the_layout_names_only_logged_tags_in_order():
    logged = {"reward/mean", "val/reward", "loss/policy", "policy/entropy", "completion/length", "clip/upper"}
    [(category, charts)] = headline_layout(logged).items()
    assert category == HEADLINE_CATEGORY
    titles = list(charts)
    assert titles[0].startswith("reward") and charts[titles[0]] == ["Multiline", ["^reward/mean$", "^val/reward$"]]
    assert "KL" not in charts and "trust region" not in charts and "critic" not in charts  # nothing logged there
    named = {tag for kind, tags in charts.values() for tag in tags}
    assert {tag.strip("^$") for tag in named} <= logged
    assert headline_layout({"time/step_s"}) == {}  # nothing to show: no layout


def test_every_loss_term_is_charted_the_total_first():
    [charts] = headline_layout({"loss/nll", "loss/total", "loss/policy", "loss/kl", "lossy"}).values()
    assert charts["loss"] == ["Multiline", ["^loss/total$", "^loss/policy$", "^loss/kl$", "^loss/nll$"]]
