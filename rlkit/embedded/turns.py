"""Running sums over several turns: the embedded multi-turn task, in plain text for the character model.

The prompt shows only the first two terms (``"3+5="``); the model answers their sum (``"8"``, then EOS),
and the environment reveals the next term after the model's own number (``",8+7="``), until every term is
added. An episode's row reads ``3+5=8<eos>,8+7=15<eos>``: the single-turn task's worked solution with the
later terms written by the environment, so the task cannot be solved in one turn (the terms after the
second are unknown until the environment writes them), and an early mistake carries into every later sum.
The final sum is the ground truth (``ExactAnswer`` on the last model turn).
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlkit.data.prompts import Prompt
from rlkit.embedded.chain import AdditionChain
from rlkit.environments.base import Environment, Observation, check_limits


class RevealedChain(AdditionChain):
    """:class:`~rlkit.embedded.chain.AdditionChain`'s questions with only the first two terms in the prompt.

    The rows, their splits (by the whole question's hash) and their arguments are AdditionChain's; a row's
    ``meta["terms"]`` holds every term for :class:`RunningSums`, and its ground truth is the final sum.
    """

    def __getitem__(self, index: int) -> Prompt:
        terms = list(self._rows[index])
        return Prompt(
            prompt=f"{terms[0]}+{terms[1]}=",
            ground_truth=str(sum(terms)),
            meta={"data_source": "revealed_chain", "terms": terms},
        )


def observation_text(running_sum: str, term: int) -> str:
    """What the environment writes after a model turn: the model's number, the next term and ``=``."""
    return f",{running_sum}+{term}="


class RunningSums(Environment):
    """Reveals a :class:`RevealedChain` row's next term after each running sum the model writes.

    A turn that is not a plain integer ends the episode (it is then scored as the answer, and fails).
    The running sum the model wrote is echoed as written, right or wrong, so the final answer depends on
    every turn.

    Args:
        max_turns: the most model turns (a question of ``k`` terms takes ``k - 1``).
        max_episode_tokens: see :class:`~rlkit.environments.base.Environment`; None: no budget.
        turn_reward: reward of each correct intermediate running sum (the final one is ``data.rewards``');
            0 gives none (the outcome alone).
    """

    def __init__(self, max_turns: int = 3, max_episode_tokens: int | None = None, turn_reward: float = 0.0) -> None:
        check_limits(max_turns, max_episode_tokens, type(self).__name__)
        self.max_turns = max_turns
        self.max_episode_tokens = max_episode_tokens
        self.turn_reward = turn_reward

    def reset(self, prompt: Prompt) -> dict:
        if "terms" not in prompt.meta:
            raise ValueError(
                f"RunningSums needs each prompt's terms in meta['terms'] and prompt {prompt.prompt!r} has none: "
                "use data.prompts=rlkit.embedded.RevealedChain"
            )
        return {"terms": list(prompt.meta["terms"]), "added": 2}

    def step(self, state: dict, text: str) -> Observation:
        terms, added = state["terms"], state["added"]
        written = text.strip()
        if not written.isdigit() or added == len(terms):  # not a number, or the final sum
            return Observation(done=True)
        correct = int(written) == sum(terms[:added])
        state["added"] = added + 1
        reward = (self.turn_reward if correct else 0.0) if self.turn_reward else None
        return Observation(text=observation_text(written, terms[added]), reward=reward)


def transcript_batch(prompts: list[Prompt], tokenizer) -> tuple[Tensor, Tensor]:
    """The worked episodes of ``prompts`` as the rollouts tokenise them, loss on the model's turns only.

    Row: the prompt (with BOS), then each correct running sum and EOS (labelled), with the environment's
    :func:`observation_text` between them (label ``-100``, as the episode's loss mask leaves it out).

    Returns:
        ``(input_ids [M, L], labels [M, L])``, right-padded, as :func:`rlkit.embedded.warmup.supervised_batch`.
    """
    rows: list[tuple[list[int], list[int]]] = []
    for prompt in prompts:
        terms = prompt.meta["terms"]
        ids = list(tokenizer(prompt.prompt)["input_ids"])
        labels = [-100] * len(ids)
        for added in range(2, len(terms) + 1):
            if added > 2:
                observed = tokenizer(
                    observation_text(str(sum(terms[: added - 1])), terms[added - 1]), add_special_tokens=False
                )["input_ids"]
                ids += observed
                labels += [-100] * len(observed)
            turn = [*tokenizer(str(sum(terms[:added])), add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
            ids += turn
            labels += turn
        rows.append((ids, labels))
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)  # [M, L]
    labels = torch.full((len(rows), width), -100, dtype=torch.long)  # [M, L]
    for i, (row, label) in enumerate(rows):
        input_ids[i, : len(row)] = torch.tensor(row)
        labels[i, : len(label)] = torch.tensor(label)
    return input_ids, labels
