"""Algorithm families as LightningModules; named algorithms are YAML presets over them."""

from rlkit.algorithms.distillation import Distillation
from rlkit.algorithms.policy_gradient import PolicyGradient

__all__ = ["Distillation", "PolicyGradient"]
