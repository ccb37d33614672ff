"""The embedded demo: a task, a tiny model and its warm-up that need no GPU and no download.

Everything the CPU default (``configs/tasks/embedded.yaml``) runs on lives here, apart from the library:
the chained-addition task (:class:`AdditionChain`; the older single-digit :class:`Arithmetic`), its
multi-turn form (:class:`RevealedChain` prompts, the :class:`RunningSums` environment), the tiny
Llama and its character-level tokenizer, the supervised warm-up, and the cache of warmed-up checkpoints
(:class:`EmbeddedModel`, :class:`EmbeddedTeacher`, named in configs where a checkpoint directory would be).
Nothing outside this package imports it; a config that names the demo does.
"""

from rlkit.embedded.arithmetic import Arithmetic
from rlkit.embedded.cache import EmbeddedEpisodeModel, EmbeddedModel, EmbeddedTeacher, embedded_checkpoint
from rlkit.embedded.chain import AdditionChain
from rlkit.embedded.model import build_tiny_checkpoint, build_tokenizer
from rlkit.embedded.turns import RevealedChain, RunningSums

__all__ = [
    "AdditionChain",
    "Arithmetic",
    "EmbeddedEpisodeModel",
    "EmbeddedModel",
    "EmbeddedTeacher",
    "RevealedChain",
    "RunningSums",
    "build_tiny_checkpoint",
    "build_tokenizer",
    "embedded_checkpoint",
]
