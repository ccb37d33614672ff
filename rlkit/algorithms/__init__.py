"""Algorithm families as LightningModules; named algorithms are YAML presets over them."""

from rlkit.algorithms.actor_critic import ActorCritic
from rlkit.algorithms.critic import Critic, SeparateCritic, ValueHead
from rlkit.algorithms.distillation import Distillation
from rlkit.algorithms.online_dpo import OnlineDPO
from rlkit.algorithms.policy_gradient import PolicyGradient

__all__ = ["ActorCritic", "Critic", "Distillation", "OnlineDPO", "PolicyGradient", "SeparateCritic", "ValueHead"]
