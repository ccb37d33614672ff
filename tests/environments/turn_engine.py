"""An engine whose turns are scripted texts and which records every context it is given and what it answered;
the tool and the plain-text environment the tests use."""

from rlkit.engines.base import Generation, RolloutEngine
from rlkit.environments import Environment, Observation


class RecordingEngine(RolloutEngine):
    """Answers ``script(context ids, seed) -> text``, tokenised without special tokens plus EOS (when the
    tokens fit ``max_new_tokens``); ``calls`` records ``(context, seed, answer tokens)`` of each sample,
    ``greedy`` the ``greedy`` flag of each ``generate`` call.

    Args:
        tokenizer: any Hugging Face tokenizer with an EOS token.
        script: ``(context ids, seed) -> text`` of one model turn.
        max_new_tokens: a longer answer is cut there (not finished).
    """

    def __init__(self, tokenizer, script, max_new_tokens: int = 64) -> None:
        self.tokenizer, self.script = tokenizer, script
        self.temperature, self.max_new_tokens = 1.0, max_new_tokens
        self.calls: list[tuple[list[int], int, list[int]]] = []
        self.greedy: list[bool] = []

    def start(self, checkpoint_dir, trust_remote_code=False):
        pass

    def generate(self, prompts, n, seed, greedy=False):
        seeds = seed if isinstance(seed, list) else [seed] * len(prompts)
        self.greedy.append(greedy)
        out = []
        for ids, s in zip(prompts, seeds, strict=True):
            row = []
            for _ in range(n):
                tokens = self.tokenizer(self.script(ids, s), add_special_tokens=False)["input_ids"]
                tokens = [*tokens, self.tokenizer.eos_token_id]
                finished = len(tokens) <= self.max_new_tokens
                tokens = tokens[: self.max_new_tokens]
                self.calls.append((list(ids), s, list(tokens)))
                row.append(Generation(tokens, [-0.5] * len(tokens), finished))
            out.append(row)
        return out

    def update_weights(self, named_tensors):
        pass


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first number.
        b: the second number.
    """
    return a + b


#: A model turn that calls ``add(2, 3)`` in the Hermes format.
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


class Retry(Environment):
    """Plain text: asks the model to answer its question again, so every episode has two model turns.

    Args:
        max_turns: model turns per episode.
        turn_reward: each turn's reward when it is the ground truth (0: no per-turn rewards).
    """

    def __init__(self, max_turns: int = 2, turn_reward: float = 0.0) -> None:
        self.max_turns, self.turn_reward = max_turns, turn_reward

    def reset(self, prompt):
        return prompt

    def step(self, state, text):
        reward = float(text.strip() == state.ground_truth) * self.turn_reward if self.turn_reward else None
        return Observation(text=" again: " + state.prompt, reward=reward)
