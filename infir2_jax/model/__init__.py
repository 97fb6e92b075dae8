"""The Qwen2/Qwen2.5 model: config, linen modules (training and cached decoding), params."""

from infir2_jax.model.config import ModelConfig
from infir2_jax.model.layers import DotGeneralFactory, default_dot_general_factory
from infir2_jax.model.params import abstract_params, init_params, param_shapes, projections
from infir2_jax.model.qwen2 import Qwen2

__all__ = ["ModelConfig", "Qwen2", "DotGeneralFactory", "default_dot_general_factory",
           "abstract_params", "init_params", "param_shapes", "projections"]
