"""An engine that answers from a script instead of a model: data-side tests without generation."""

from rlkit.engines.base import Generation, RolloutEngine


class ScriptedEngine(RolloutEngine):
    """Completion ``j`` of every prompt is ``answers(call, prompt_ids, j)`` (text), tokenised by characters.

    Args:
        tokenizer: the character-level tokenizer of ``rlkit.models.build_tokenizer``.
        answers: ``(call index, prompt ids, sample index, seed) -> text``.
    """

    def __init__(self, tokenizer, answers, max_new_tokens: int = 8) -> None:
        self.tokenizer, self.answers = tokenizer, answers
        self.temperature, self.max_new_tokens = 1.0, max_new_tokens
        self.calls = 0
        self.rollouts_ended = 0  # end_rollout calls: one per rollout, however many generate calls it made

    def start(self, checkpoint_dir, trust_remote_code=False):
        pass

    def generate(self, prompts, n, seed, greedy=False):
        seeds = seed if isinstance(seed, list) else [seed] * len(prompts)
        out = []
        for ids, s in zip(prompts, seeds, strict=True):
            row = []
            for j in range(n):
                text = self.answers(self.calls, ids, j, s)
                tokens = self.tokenizer.convert_tokens_to_ids(list(text))[: self.max_new_tokens]
                row.append(Generation(tokens, [0.0] * len(tokens), finished=len(text) <= self.max_new_tokens))
            out.append(row)
        self.calls += 1
        return out

    def end_rollout(self):
        self.rollouts_ended += 1

    def update_weights(self, named_tensors):
        pass
