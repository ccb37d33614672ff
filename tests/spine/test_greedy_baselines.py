"""ReMax end to end: an advantage that uses greedy baselines makes the data module decode one greedy
completion per prompt, and each rollout row carries the reward of its own prompt's greedy completion."""

from __future__ import annotations

import re

import lightning.pytorch as pl
import torch

from rlkit.cli import build_cli
from rlkit.data.prompts import Prompt
from rlkit.rewards import FinalAnswer
from spine.helpers import short_args


class _Rollouts(pl.Callback):
    """Each rollout, with the greedy reward of each of its rows' prompts decoded by the policy itself (not the
    engine): the weights the rollout was generated with are the policy's at the start of its step."""

    def __init__(self) -> None:
        self.rollouts, self.greedy = [], []

    @torch.no_grad()
    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.rollouts.append(batch)
        self.greedy.append(torch.tensor([self._greedy_reward(module, batch, row) for row in range(len(batch))]))

    @staticmethod
    def _greedy_reward(module, rollout, row: int) -> float:
        width = rollout.input_ids.shape[1] - rollout.completion_mask.shape[1]
        prompt = rollout.input_ids[row, :width][rollout.attention_mask[row, :width].bool()]  # [P]
        model, tokenizer = module.policy.model, module.policy.tokenizer
        ids = prompt.unsqueeze(0)  # [1, P]
        for _ in range(rollout.max_new_tokens):  # argmax decoding, the whole sequence each step
            token = model(input_ids=ids).logits[0, -1].argmax()
            if token.item() == tokenizer.eos_token_id:
                break
            ids = torch.cat([ids, token.view(1, 1)], dim=1)  # [1, P + t]
        question = tokenizer.decode(prompt, skip_special_tokens=True)
        truth = str(sum(int(term) for term in re.findall(r"\d+", question)))
        completion = tokenizer.decode(ids[0, len(prompt) :], skip_special_tokens=True)
        return FinalAnswer()(completion, Prompt(question, ground_truth=truth))


def _fit(tmp_path, monkeypatch, *extra: str) -> _Rollouts:
    monkeypatch.chdir(tmp_path)
    args = short_args(tmp_path, "remax", "--trainer.max_steps=2", "--data.prompts_per_step=8", *extra)[1:]
    cli = build_cli(args, run=False)
    recorder = _Rollouts()
    cli.trainer.callbacks.append(recorder)
    cli.trainer.fit(cli.model, cli.datamodule)
    return recorder


def test_remax_rollouts_carry_the_greedy_reward_of_their_prompt(tmp_path, monkeypatch):
    recorder = _fit(tmp_path, monkeypatch)
    assert len(recorder.rollouts) == 2
    for rollout, greedy in zip(recorder.rollouts, recorder.greedy, strict=True):
        assert rollout.baselines is not None and rollout.baselines.shape == rollout.scores.shape
        # one baseline per prompt: every row of a group has its prompt's value
        for group in rollout.group_ids.unique():
            assert rollout.baselines[rollout.group_ids == group].unique().numel() == 1
        torch.testing.assert_close(rollout.baselines, greedy)
    # the warmed-up model (about 1 in 3 held-out questions greedily) answers some of the 16 prompts and not
    # others, so the comparison above is not between zeros
    baselines = torch.cat([r.baselines for r in recorder.rollouts])
    assert 0 < baselines.sum() < len(baselines), baselines


def test_an_advantage_without_greedy_baselines_decodes_none(tmp_path, monkeypatch):
    recorder = _fit(tmp_path, monkeypatch, "--model.advantage=LeaveOneOut")
    assert len(recorder.rollouts) == 2
    assert all(rollout.baselines is None for rollout in recorder.rollouts)
