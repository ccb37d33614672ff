"""Episodes through the data module: one Rollout row per episode, environment tokens out of the loss (and of
the gradient), the reward on the final answer, ``episode/*`` stats; and the single-turn default unchanged."""

import math
import re

import pytest
import torch
from spine.helpers import EXPERIMENTS, event_files, run_rlkit, short_args
from turn_engine import RecordingEngine, add

from rlkit.algorithms.surrogate import PolicyLoss
from rlkit.components import GroupMean
from rlkit.components.advantage import AdvantageInputs
from rlkit.components.aggregation import StepTotals, TokenMean
from rlkit.components.clip import PPOClip
from rlkit.components.kl import K3
from rlkit.components.logprobs import token_log_probs
from rlkit.components.ratio import TokenRatio
from rlkit.data.batch import pad_left, pad_right
from rlkit.data.prompts import Prompt, PromptSource, encode_prompt
from rlkit.embedded.arithmetic import Arithmetic
from rlkit.embedded.model import build_tiny_checkpoint, build_tokenizer
from rlkit.engines.base import request_seed
from rlkit.engines.hf import HFEngine
from rlkit.environments import SingleTurn, ToolEnvironment
from rlkit.errors import ConfigError
from rlkit.rewards import ExactAnswer
from rlkit.rollouts.datamodule import RolloutDataModule
from rlkit.rollouts.source import EngineRequest
from rlkit.spine.loop import LossInputs
from rlkit.spine.metrics import StepMetrics
from rlkit.spine.policy import TokenScores


class Sums(PromptSource):
    """``What is a+b?`` for a few pairs, answered by the sum."""

    pairs = [(2, 3), (4, 4), (1, 6), (5, 2)]

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, index):
        a, b = self.pairs[index]
        return Prompt(f"What is {a}+{b}?", ground_truth=str(a + b))


def solver(tokenizer):
    """Sample 0 calls ``add`` with the question's numbers and answers its result; sample 1 guesses 0 at once."""

    def script(ids, seed):
        text = tokenizer.decode(ids)
        if "<tool_response>" in text:
            return re.findall(r"<tool_response>\n(\d+)", text)[-1]
        if seed in guessers:
            return "0"
        a, b = re.findall(r"What is (\d+)\+(\d+)\?", text)[-1]
        return f'<tool_call>\n{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>'

    guessers = set()
    script.guess = lambda seeds: guessers.update(request_seed(s, 0, 1) for s in seeds)
    return script


@pytest.fixture(scope="module")
def episodes(chat_tokenizer):
    script = solver(chat_tokenizer)
    data = RolloutDataModule(
        Sums(),
        RecordingEngine(chat_tokenizer, script),
        [ExactAnswer()],
        prompts_per_step=2,
        samples_per_prompt=2,
        chat_template=True,
        environment=ToolEnvironment([add], max_turns=3),
    )
    script.guess(data.schedule.sample_seeds(0, [0, 1]))
    data.attach(EngineRequest("unused", chat_tokenizer))
    return data.next_rollout()


def test_an_episode_is_one_row_with_the_environment_masked_out(episodes, chat_tokenizer):
    rollout, T = episodes, episodes.completion_mask.shape[1]
    completion = rollout.input_ids[:, -T:]  # [N, T]
    real = rollout.attention_mask[:, -T:].bool()  # [N, T] every completion token, model's and environment's
    environment = real & (rollout.completion_mask == 0)  # [N, T]
    assert rollout.scores.tolist() == [1.0, 0.0, 1.0, 0.0]  # the final answer is scored, not the episode's text
    for row in range(len(rollout)):
        env_text = chat_tokenizer.decode(completion[row][environment[row]].tolist())
        calls = row % 2 == 0
        assert ("<tool_response>" in env_text) == calls and (env_text == "") == (not calls)
        model_text = chat_tokenizer.decode(completion[row][rollout.completion_mask[row].bool()].tolist())
        assert ("<tool_call>" in model_text) == calls
    assert torch.all(rollout.engine_logprobs[environment] == 0) and torch.all(
        rollout.engine_logprobs[rollout.completion_mask.bool()] == -0.5
    )
    assert rollout.stats["episode/turns"] == 1.5 and rollout.stats["episode/tool_calls"] == 0.5
    assert rollout.stats["episode/tool_errors"] == 0.0 and rollout.stats["episode/budget_stops"] == 0.0
    assert rollout.stats["episode/length_model"] == rollout.completion_mask.sum().item() / 4
    assert rollout.stats["episode/length_environment"] == environment.sum().item() / 4 > 0


def test_environment_tokens_get_no_gradient(episodes):
    """Through the policy loss (PPO clip, token mean, a K3 KL and an entropy bonus), the gradient reaching
    the logits that predict an environment token is exactly 0; every model token's logits get one."""
    rollout, T = episodes, episodes.completion_mask.shape[1]
    N, L = rollout.input_ids.shape
    logits = torch.randn(N, L, 50, generator=torch.Generator().manual_seed(0), requires_grad=True)  # [N, P+T, V]
    targets = rollout.input_ids[:, -T:] % 50  # [N, T] ids folded into the small vocabulary
    predicting = logits[:, L - T - 1 : L - 1]  # [N, T, V] the positions that predict each completion token
    logprobs = token_log_probs(predicting, targets)  # [N, T]
    entropy = -(predicting.softmax(-1) * predicting.log_softmax(-1)).sum(-1)  # [N, T]
    mask = rollout.completion_mask  # [N, T]
    advantages, _ = GroupMean()(AdvantageInputs.from_scores(rollout.scores, mask, rollout.group_ids))  # [N, T]
    old = logprobs.detach() + 0.01 * torch.randn(N, T, generator=torch.Generator().manual_seed(1))  # [N, T]
    loss_fn = PolicyLoss(TokenRatio(), PPOClip(), TokenMean(), kl=K3(), kl_coef=0.1, entropy_coef=0.01)
    inputs = LossInputs(old_logprobs=old, advantages=advantages, ref_logprobs=old - 0.1)
    loss, _ = loss_fn(TokenScores(logprobs, entropy), inputs, mask, StepTotals.from_masks([mask]), StepMetrics())
    loss.backward()
    per_position = logits.grad[:, L - T - 1 : L - 1].abs().sum(-1)  # [N, T]
    environment = rollout.attention_mask[:, -T:].bool() & (rollout.completion_mask == 0)  # [N, T]
    assert environment.any() and torch.all(per_position[environment] == 0)
    assert torch.all(per_position[mask.bool()] > 0)


def test_the_dr_grpo_constant_is_the_whole_episode_budget(episodes, chat_tokenizer):
    """SeqMeanTokenSumNorm divides by ``Rollout.max_new_tokens``: for an episode that is the whole response
    budget (verl's multi-turn ``response_length``), not one turn's limit, which a row's own model tokens pass."""
    assert SingleTurn().response_budget(4) == 4
    assert ToolEnvironment([add], max_turns=3).response_budget(4) == 12  # no token budget: the most model tokens
    assert ToolEnvironment([add], max_turns=3, max_episode_tokens=10).response_budget(4) == 10
    assert episodes.max_new_tokens == 3 * 64  # RecordingEngine's per-turn limit 64, max_turns 3
    script = solver(chat_tokenizer)
    data = RolloutDataModule(Sums(), RecordingEngine(chat_tokenizer, script, max_new_tokens=25), [ExactAnswer()],
                             prompts_per_step=2, samples_per_prompt=2, chat_template=True,
                             environment=ToolEnvironment([add], max_turns=3, max_episode_tokens=90))  # fmt: skip
    script.guess(data.schedule.sample_seeds(0, [0, 1]))
    data.attach(EngineRequest("unused", chat_tokenizer))
    rollout = data.next_rollout()
    model_tokens = rollout.completion_mask.sum(-1)  # [N]
    assert rollout.max_new_tokens == 90 and model_tokens.max() > 25  # one row's model tokens pass one turn's limit


def test_single_turn_default_is_the_engine_call_it_always_was(tmp_path):
    """The default environment (and SingleTurn named explicitly) gives bitwise the Rollout built by hand from
    one ``engine.generate(ids, n=G, seed=prompt seeds)`` call, as the producer made it before environments."""
    checkpoint, tokenizer = str(build_tiny_checkpoint(tmp_path, seed=3)), build_tokenizer()

    def rollout(**kwargs):
        data = RolloutDataModule(
            Arithmetic(num_prompts=16),
            HFEngine(max_new_tokens=6),
            [ExactAnswer()],
            prompts_per_step=4,
            samples_per_prompt=3,
            seed=5,
            **kwargs,
        )
        data.attach(EngineRequest(checkpoint, tokenizer))
        return data, data.next_rollout()

    data, default = rollout()
    _, explicit = rollout(environment=SingleTurn())
    engine = HFEngine(max_new_tokens=6)
    engine.start(checkpoint)
    prompts = [data.prompts[i] for i in data.schedule.prompt_indices(0, 0)]
    ids = [encode_prompt(p, tokenizer) for p in prompts]
    generations = [
        g for row in engine.generate(ids, n=3, seed=data.schedule.sample_seeds(0, [0, 1, 2, 3])) for g in row
    ]
    completion = pad_right([g.token_ids for g in generations], tokenizer.pad_token_id, torch.long)  # [N, T]
    mask = pad_right([[1.0] * len(g.token_ids) for g in generations], 0.0, torch.float32)  # [N, T]
    prompt_ids = pad_left([p for p in ids for _ in range(3)], tokenizer.pad_token_id)  # [N, P]
    for made in (default, explicit):
        assert torch.equal(made.input_ids, torch.cat([prompt_ids, completion], 1))
        assert torch.equal(made.completion_mask, mask)
        assert torch.equal(made.attention_mask[:, prompt_ids.shape[1] :], mask.long())
        assert torch.equal(made.engine_logprobs, pad_right([g.logprobs for g in generations], 0.0, torch.float32))
        assert not any(name.startswith("episode/") for name in made.stats)
    assert torch.equal(default.attention_mask, explicit.attention_mask) and torch.equal(default.scores, explicit.scores)


def test_multi_turn_settings_that_do_not_fit_are_config_errors(chat_tokenizer):
    env = ToolEnvironment([add])
    engine = HFEngine()
    # episodes run ahead of training too (tests/data/test_async_rollouts.py)
    RolloutDataModule(Sums(), engine, [ExactAnswer()], prompts_per_step=2, max_staleness=1, environment=env,
                      chat_template=True)  # fmt: skip
    with pytest.raises(ConfigError, match="episodes .* do not carry across their turns yet: set data.partial"):
        RolloutDataModule(Sums(), engine, [ExactAnswer()], prompts_per_step=2, max_staleness=1, environment=env,
                          chat_template=True, async_schedule="free", partial_rollouts=True)  # fmt: skip
    # plain-text prompts without the template cannot show the tools
    with pytest.raises(ConfigError, match="offers tools, which only the chat template shows the model, and these"):
        RolloutDataModule(Sums(), engine, [ExactAnswer()], prompts_per_step=2, environment=env)

    def tool_data(**settings) -> RolloutDataModule:
        engine = RecordingEngine(chat_tokenizer, None)
        return RolloutDataModule(Sums(), engine, [ExactAnswer()], prompts_per_step=2, chat_template=True,
                                 environment=env, **settings)  # fmt: skip

    # the prompt length limit counts the tools' system turn
    short = tool_data(max_prompt_length=40)
    assert len(encode_prompt(Sums()[0], chat_tokenizer, True)) < 40
    with pytest.raises(
        ConfigError, match=r"prompts are longer than data.max_prompt_length=40 .*the longest \d+ tokens"
    ):
        short.attach(EngineRequest("unused", chat_tokenizer))


def test_a_greedy_baseline_is_one_greedy_episode_per_prompt(chat_tokenizer):
    """ReMax with episodes: each prompt's baseline is the reward of a whole greedy episode (here the greedy
    policy calls the tool and answers right, the sampled one guesses 0 at once), with its environment reward."""

    class GreedySolves(RecordingEngine):
        def generate(self, prompts, n, seed, greedy=False):
            self.solve = greedy
            return super().generate(prompts, n, seed, greedy)

    solve = solver(chat_tokenizer)
    engine = GreedySolves(chat_tokenizer, lambda ids, seed: solve(ids, seed) if engine.solve else "0")
    data = RolloutDataModule(Sums(), engine, [ExactAnswer()], prompts_per_step=2, samples_per_prompt=2,
                             chat_template=True, environment=ToolEnvironment([add], max_turns=3))  # fmt: skip
    data.attach(EngineRequest("unused", chat_tokenizer, greedy_baselines=True))
    rollout = data.next_rollout()
    assert rollout.scores.tolist() == [0.0] * 4  # the sampled episodes: one wrong turn each
    assert rollout.baselines.tolist() == [1.0] * 4  # the greedy ones: a tool call, then the right sum
    # one sampled call (turn 1 of 4 episodes), then the greedy episodes' two turns
    assert engine.greedy == [False, True, True]


def test_the_environment_is_chosen_by_class_path():
    from rlkit.cli import build_cli

    base = [f"--config={EXPERIMENTS / 'drgrpo.yaml'}", "--trainer.max_steps=1"]
    assert type(build_cli(base, run=False).datamodule.environment) is SingleTurn  # the default
    chosen = [
        "--data.chat_template=true",  # tools are shown by the chat template
        "--data.environment=ToolEnvironment",
        "--data.environment.init_args.tools=[turn_engine.add]",  # a function by its import path
        "--data.environment.init_args.max_turns=2",
    ]
    environment = build_cli([*base, *chosen], run=False).datamodule.environment
    assert (
        isinstance(environment, ToolEnvironment) and environment.max_turns == 2 and list(environment.tools) == ["add"]
    )


def test_a_multi_turn_run_trains_through_rlkit_fit(tmp_path):
    """The real command with a plain-text environment on the embedded task: two model turns per episode,
    the environment's tokens in every row, ``episode/*`` in TensorBoard, a finite loss."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    args = short_args(tmp_path, "drgrpo", "--trainer.max_steps=2", "--data.environment=environments.turn_engine.Retry")
    result = run_rlkit(args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    [events] = event_files(tmp_path / "runs")
    accumulator = EventAccumulator(str(events.parent), size_guidance={"scalars": 0})
    accumulator.Reload()
    scalar = lambda tag: [e.value for e in accumulator.Scalars(tag)]  # noqa: E731
    assert scalar("episode/turns") == [2.0, 2.0]
    assert all(v > 0 for v in scalar("episode/length_environment"))
    assert all(math.isfinite(v) for v in scalar("loss/policy"))
