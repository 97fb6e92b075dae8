"""Qwen2/Qwen2.5 model: config and linen modules."""

from infir2_jax.model.config import ModelConfig
from infir2_jax.model.layers import DotGeneralFactory, default_dot_general_factory
from infir2_jax.model.qwen2 import Qwen2

__all__ = ["ModelConfig", "Qwen2", "DotGeneralFactory", "default_dot_general_factory"]
