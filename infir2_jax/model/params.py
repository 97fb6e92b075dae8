"""The one place that traces the model for its parameters: init, abstract shapes, projections."""

import functools
from typing import Any

import flax.linen as nn
import flax.traverse_util
import jax
import jax.numpy as jnp

from infir2_jax.model.axes import compute_axes
from infir2_jax.model.config import ModelConfig
from infir2_jax.model.qwen2 import Qwen2


def init_params(model: nn.Module, rng: jax.Array) -> Any:
  """Boxed (LogicallyPartitioned) params of `model`; the shapes do not depend on the batch,
  so one token traces the init. Jitted: called eagerly, the init would run (and compile) the
  forward op by op."""
  return jax.jit(model.init)(rng, jnp.zeros((1, 1), jnp.int32))["params"]


def abstract_params(model_cfg: ModelConfig) -> Any:
  """The boxed params as ShapeDtypeStructs (jax.eval_shape: nothing is allocated)."""
  return jax.eval_shape(functools.partial(init_params, Qwen2(model_cfg)), jax.random.key(0))


def param_shapes(model_cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
  """{"layers_0/mlp/up_proj/kernel": shape, ...} of every param."""
  flat = flax.traverse_util.flatten_dict(nn.unbox(abstract_params(model_cfg)), sep="/")
  return {path: tuple(leaf.shape) for path, leaf in flat.items()}


def projections(model_cfg: ModelConfig) -> list[tuple[str, tuple[int, int], tuple]]:
  """[(path, (K, N), (K axis, N axis))] of every projection y = x W, the axes being those of
  W's compute copy (model.axes.compute_axes); the tied LM head is W^T = the embedding."""
  flat = flax.traverse_util.flatten_dict(abstract_params(model_cfg), sep="/")
  out = []
  for path, leaf in flat.items():
    if path.endswith("/kernel"):
      out.append((path[:-len("/kernel")], tuple(leaf.value.shape), compute_axes(leaf.names)))
    elif path == "embed_tokens/embedding" and model_cfg.tie_embeddings:
      (v, d), (v_axis, d_axis) = leaf.value.shape, leaf.names
      out.append(("lm_head", (d, v), compute_axes((d_axis, v_axis))))
  return out
