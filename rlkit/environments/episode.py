"""Episodes: model turns and environment turns as one token row, with the loss mask on the model's tokens.

An episode's completion is ``turn 1 model tokens | environment tokens | turn 2 model tokens | ...``. Each
model turn is generated from exactly the tokens of the row so far (prompt and completion), and its tokens
are appended as the engine sampled them; an observation appends only its own tokens, rendered as the chat
template renders the next turn (:class:`TurnEncoder`). Nothing already in the row is ever re-tokenised, so
the row the trainer scores is token for token the text the model saw (verl's agent loop and SkyRL keep
token ids the same way, against re-encoding the chat history).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rlkit.data.prompts import Prompt, prompt_tools
from rlkit.engines.base import Generation, RolloutEngine, request_seed
from rlkit.environments.base import Environment, Observation
from rlkit.errors import ConfigError

#: Mark an environment turn in an episode's transcript (the sample tables): model turns read as decoded.
ENVIRONMENT_MARKS = ("⟦", "⟧")

#: Stands for a past assistant turn's text while the template renders what follows it (private-use code points).
_SENTINEL = "\ue000rlkit\ue001"


@dataclass
class Episode(Generation):
    """One episode as one completion (``token_ids``: model and environment tokens, in order).

    Attributes:
        model_mask: True on the tokens the model sampled, False on the environment's (same length).
        answer: the last model turn's text (special tokens dropped): what ``data.rewards`` score.
        turns: model turns taken.
        tool_calls: tool calls made (as the environment counted them).
        tool_errors: of those, calls answered by an error.
        budget_stops: 1 when an observation did not fit ``max_episode_tokens`` and ended the episode.
        turn_rewards: the environment's reward after each model turn (None where it gave none).
        turn_spans: ``(start, end)`` of each model turn in ``token_ids`` (for per-turn advantages).
    """

    model_mask: list[bool] = field(default_factory=list)
    answer: str = ""
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    budget_stops: int = 0
    turn_rewards: list[float | None] = field(default_factory=list)
    turn_spans: list[tuple[int, int]] = field(default_factory=list)

    def loss_mask(self) -> list[float]:
        return [1.0 if m else 0.0 for m in self.model_mask]

    @property
    def environment_reward(self) -> float:
        """The sum of the environment's per-turn rewards (0 when it gave none)."""
        return float(sum(r for r in self.turn_rewards if r is not None))

    def transcript(self, tokenizer) -> str:
        """The episode's text with each environment turn inside :data:`ENVIRONMENT_MARKS` (``8⟦,8+7=⟧15``),
        every part decoded apart, special tokens dropped: what the sample tables show."""
        opening, closing = ENVIRONMENT_MARKS
        decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        parts, done = [], 0
        for start, end in [*self.turn_spans, (len(self.token_ids), len(self.token_ids))]:
            if start > done:  # the environment's tokens before this model turn
                parts.append(opening + decode(self.token_ids[done:start]) + closing)
            parts.append(decode(self.token_ids[start:end]))
            done = end
        return "".join(parts)

    def turn_ids(self) -> list[int]:
        """The model turn (0, 1, ...) of each token of ``token_ids``, -1 on the environment's."""
        ids = [-1] * len(self.token_ids)
        for turn, (start, end) in enumerate(self.turn_spans):
            ids[start:end] = [turn] * (end - start)
        return ids

    def token_rewards(self, score: float) -> list[float]:
        """``score`` (the rewards' outcome plus :attr:`environment_reward`) spread over the tokens: each turn's
        environment reward on that turn's last model token, the rest on the episode's last model token."""
        rewards = [0.0] * len(self.token_ids)
        model = [i for i, sampled in enumerate(self.model_mask) if sampled]  # positions of the model's tokens
        if not model:
            return rewards
        for (_, end), reward in zip(self.turn_spans, self.turn_rewards, strict=True):
            if reward is not None:  # an empty turn (cut at the budget) gives none: it was truncated
                rewards[max((i for i in model if i < end), default=model[0])] += reward
        rewards[model[-1]] += score - self.environment_reward
        return rewards


def _template_text(tokenizer, messages: list[dict[str, Any]], tools, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt)


def check_tool_template(tokenizer, tools: list[dict[str, Any]]) -> None:
    """A chat template that ignores ``tools=`` cannot offer them: one ConfigError naming the fix."""
    messages = [{"role": "user", "content": "?"}]
    if getattr(tokenizer, "chat_template", None) is None or _template_text(
        tokenizer, messages, tools, True
    ) == _template_text(tokenizer, messages, None, True):
        raise ConfigError(
            "data.environment offers tools, but the tokenizer's chat template does not render tools= (none, or "
            "it ignores them): give the checkpoint a template that lists tools, e.g. Qwen2.5's or "
            "rlkit.chat_tokenizer.CHAT_TEMPLATE saved as chat_template.jinja, or use an environment without tools"
        )


class TurnEncoder:
    """An observation's tokens as the chat template renders them after a model turn.

    Chat messages: the template renders a stand-in conversation ending in an assistant turn, once alone and
    once followed by the observation and the assistant's generation prompt; the text after the stand-in
    turn's content is the delta (with Qwen/ChatML ``<|im_end|>\\n<|im_start|>user\\n<tool_response>...``).
    The model's own end-of-turn token is already in the row, so the delta's leading copy of it is dropped
    (it stays when the turn was cut before it: the template closes the turn). Plain text (no template):
    the text's tokens, no special tokens added.

    Args:
        tokenizer: the policy's tokenizer.
        tools: the tool schemas the prompt was rendered with (some templates render them in every turn).
    """

    def __init__(self, tokenizer, tools: list[dict[str, Any]] | None = None) -> None:
        self.tokenizer = tokenizer
        self.tools = tools

    def encode(self, observation: Observation, model_tokens: list[int]) -> list[int]:
        if observation.messages is None:
            if observation.text is None:
                raise ValueError("an Observation that is not done needs messages or text to append")
            return list(self.tokenizer(observation.text, add_special_tokens=False)["input_ids"])
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ConfigError(
                "the environment answers with chat messages, but the tokenizer has no chat template: give the "
                "checkpoint one (chat_template.jinja), or have the environment return Observation(text=...)"
            )
        stand_in = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _SENTINEL}]
        before = _template_text(self.tokenizer, stand_in, self.tools, False)
        after = _template_text(self.tokenizer, stand_in + list(observation.messages), self.tools, True)
        cut = before.find(_SENTINEL) + len(_SENTINEL)
        if cut < len(_SENTINEL) or after[:cut] != before[:cut]:
            raise ConfigError(
                "the chat template renders an assistant turn differently once more turns follow, so an "
                "observation's tokens cannot be appended without re-encoding the episode: use a template that "
                "renders earlier turns unchanged (ChatML / Qwen2.5 do)"
            )
        delta = after[cut:]
        if model_tokens:
            last = self.tokenizer.decode(model_tokens[-1:])
            if last in self.tokenizer.all_special_tokens and delta.startswith(last):
                delta = delta[len(last) :]  # the model closed its turn itself
        return list(self.tokenizer(delta, add_special_tokens=False)["input_ids"])


@dataclass
class _Running:
    """An episode being played: its prompt, seed, environment state and the row so far."""

    prompt_index: int
    sample: int
    state: Any
    episode: Episode
    encoder: TurnEncoder
    done: bool = False


class EpisodeRunner:
    """Plays the ``n`` episodes of each prompt, one engine call per turn for every episode still running.

    The calls go through one :meth:`~rlkit.engines.base.RolloutEngine.session` per :meth:`run`, so an engine
    that can continues each episode from the previous turn's cache (``HFEngine(reuse_kv_cache=True)``).

    Turn ``t`` of sample ``j`` is sampled with ``request_seed(prompt seed, t, j)`` (the engine then derives its
    own stream from it), so an episode's tokens depend on ``(prompt seed, sample, turn)`` and the weights,
    never on which other episodes share the call: exact on resume, and the same under data parallelism.

    Args:
        environment: the episodes' environment.
        engine: the generation engine, started.
        tokenizer: the policy's tokenizer (decodes model turns; renders observations).
    """

    def __init__(self, environment: Environment, engine: RolloutEngine, tokenizer) -> None:
        self.environment = environment
        self.engine = engine
        self.tokenizer = tokenizer
        self._encoders: dict[str, TurnEncoder] = {}
        self.encoder_for(environment.tool_schemas())  # the environment's tools: the template checked now

    def encoder_for(self, tools: list[dict[str, Any]] | None) -> TurnEncoder:
        """The observations' encoder for episodes offered ``tools`` (the environment's, or a prompt's own), its
        chat template checked to render them the first time they are seen."""
        key = json.dumps(tools, sort_keys=True, default=str)
        if key not in self._encoders:
            if tools:
                check_tool_template(self.tokenizer, tools)
            self._encoders[key] = TurnEncoder(self.tokenizer, tools)
        return self._encoders[key]

    def run(
        self, prompts: list[Prompt], ids: list[list[int]], n: int, seeds: list[int], greedy: bool = False
    ) -> list[list[Episode]]:
        """``result[i][j]``: episode ``j`` of prompt ``i`` (tokenised as ``ids[i]``, seeded by ``seeds[i]``);
        ``greedy=True`` decodes every model turn greedily (held-out validation)."""
        env, budget = self.environment, self.environment.max_episode_tokens
        tools = env.tool_schemas()
        encoders = [self.encoder_for(prompt_tools(prompt, tools)) for prompt in prompts]
        running = [
            _Running(i, j, env.reset(prompt), Episode([], [], False), encoders[i])
            for i, prompt in enumerate(prompts)
            for j in range(n)
        ]
        with self.engine.session() as generator:  # HFEngine(reuse_kv_cache=True): turns continue the KV cache
            for turn in range(env.max_turns):
                active = [r for r in running if not r.done]
                if not active:
                    break
                contexts = [ids[r.prompt_index] + r.episode.token_ids for r in active]
                turn_seeds = [request_seed(seeds[r.prompt_index], turn, r.sample) for r in active]
                generations = generator.generate(contexts, n=1, seed=turn_seeds, greedy=greedy)
                for r, [generation] in zip(active, generations, strict=True):
                    self._model_turn(r, generation, turn + 1 == env.max_turns, budget)
        groups = [running[i * n : (i + 1) * n] for i in range(len(prompts))]
        for group in groups:  # rewards scored over a prompt's episodes together (verifiers' group rubrics)
            rewards = env.score_group([r.state for r in group])
            for r, reward in zip(group, rewards or [None] * len(group), strict=True):
                if reward is not None:
                    last = r.episode.turn_rewards[-1]
                    r.episode.turn_rewards[-1] = reward if last is None else last + reward
        return [[r.episode for r in group] for group in groups]

    def _model_turn(self, r: _Running, generation: Generation, last_turn: bool, budget: int | None) -> None:
        """Append one model turn, ask the environment, and append its answer or end the episode."""
        e = r.episode
        tokens, logprobs, finished = generation.token_ids, generation.logprobs, generation.finished
        if budget is not None and len(e.token_ids) + len(tokens) > budget:  # cut at the budget: truncated
            room = budget - len(e.token_ids)
            tokens, logprobs, finished = tokens[:room], logprobs[:room], False
        e.turn_spans.append((len(e.token_ids), len(e.token_ids) + len(tokens)))
        e.token_ids += tokens
        e.logprobs += logprobs
        e.model_mask += [True] * len(tokens)
        e.turns += 1
        e.answer = self.tokenizer.decode(tokens, skip_special_tokens=True)
        r.done = True  # unless the environment answers and its answer fits
        if not finished:  # cut at max_new_tokens or the budget: the episode is truncated
            e.turn_rewards.append(None)
            return
        observation = self.environment.step(r.state, e.answer)
        e.tool_calls += observation.tool_calls
        e.tool_errors += observation.tool_errors
        e.turn_rewards.append(observation.reward)
        if observation.done:
            e.finished = True
            return
        if last_turn:  # max_turns: the model would never read the answer; the episode is truncated
            return
        appended = r.encoder.encode(observation, tokens)
        if budget is not None and len(e.token_ids) + len(appended) >= budget:  # no room left for the model
            e.budget_stops = 1
            return
        e.token_ids += appended
        e.logprobs += [0.0] * len(appended)
        e.model_mask += [False] * len(appended)
        r.done = False


def episode_stats(episodes: list[Episode]) -> Mapping[str, float]:
    """Means over a step's episodes: ``episode/turns``, ``episode/tool_calls``, ``episode/tool_errors``,
    ``episode/length_model``, ``episode/length_environment`` (tokens), ``episode/budget_stops`` and
    ``episode/environment_reward`` (the sum of an episode's per-turn rewards: ``reward/mean`` less it is the
    outcome that ``data.rewards`` gave)."""
    count = max(len(episodes), 1)
    model = sum(sum(e.model_mask) for e in episodes)
    return {
        "episode/turns": sum(e.turns for e in episodes) / count,
        "episode/tool_calls": sum(e.tool_calls for e in episodes) / count,
        "episode/tool_errors": sum(e.tool_errors for e in episodes) / count,
        "episode/length_model": model / count,
        "episode/length_environment": (sum(len(e.model_mask) for e in episodes) - model) / count,
        "episode/budget_stops": sum(e.budget_stops for e in episodes) / count,
        "episode/environment_reward": sum(e.environment_reward for e in episodes) / count,
    }
