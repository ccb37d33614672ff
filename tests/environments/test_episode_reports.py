"""What researchers look at: an episode's transcript with the environment's turns marked (the sample tables),
and the reward of the episodes that took each number of turns (``episode/reward_by_turns/<n>``)."""

import torch
from spine.helpers import random_rollout

from rlkit.environments import Episode
from rlkit.spine.metrics import StepMetrics
from rlkit.spine.reporting import group_sample, rollout_metrics


def test_the_transcript_marks_the_environments_turns(chat_tokenizer):
    """Model turns decoded as they are, each environment turn inside ⟦ ⟧, special tokens dropped."""
    encode = lambda text: chat_tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    first, observation, second = encode("8"), encode(",8+7="), [*encode("15"), chat_tokenizer.eos_token_id]
    episode = Episode(
        token_ids=first + observation + second,
        logprobs=[0.0] * (len(first) + len(observation) + len(second)),
        finished=True,
        model_mask=[True] * len(first) + [False] * len(observation) + [True] * len(second),
        turn_spans=[(0, len(first)), (len(first) + len(observation), len(first) + len(observation) + len(second))],
    )
    assert episode.transcript(chat_tokenizer) == "8⟦,8+7=⟧15"
    assert episode.turn_ids() == [0] * len(first) + [-1] * len(observation) + [1] * len(second)


def test_reward_by_turns_is_the_mean_reward_of_the_episodes_with_that_many_turns():
    """Rows of 1, 2, 2 and 3 model turns scoring 1, 0, 1 and 0.5: by turns 1 -> 1, 2 -> 0.5, 3 -> 0.5."""
    rollout = random_rollout(N=4, T=6)
    rollout.scores = torch.tensor([1.0, 0.0, 1.0, 0.5])
    rollout.turn_ids = torch.tensor(
        [[0, 0, -1, -1, -1, -1], [0, -1, 1, 1, -1, -1], [0, 0, -1, 1, -1, -1], [0, -1, 1, -1, 2, 2]]
    )  # [4, 6]
    metrics = StepMetrics()
    rollout_metrics(metrics, rollout)
    values = {k: v.item() for k, v in metrics.compute("episode/").items()}
    assert values == {"episode/reward_by_turns/1": 1.0, "episode/reward_by_turns/2": 0.5,
                      "episode/reward_by_turns/3": 0.5}  # fmt: skip
    single = random_rollout(N=4, T=6)  # no turn ids: a single-turn rollout logs none
    rollout_metrics(metrics, single)
    assert not metrics.compute("episode/")


def test_the_sample_table_shows_the_marked_episode():
    rollout = random_rollout(N=2, T=4)
    rollout.texts, rollout.prompt_texts = ["8⟦,8+7=⟧15", "9⟦,9+7=⟧16"], ["3+5=", "3+5="]
    rollout.scores = torch.tensor([1.0, 0.0])
    assert "| `8⟦,8+7=⟧15` |" in group_sample(rollout)
