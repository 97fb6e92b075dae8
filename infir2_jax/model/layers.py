"""Qwen2 building blocks: Linear (with the injected dot_general), RMSNorm, RoPE, attention, MLP.

Shape legend: B batch, L length, D model width, H query heads, K key/value heads, Dh head
size, F MLP width, V vocabulary.
"""

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from infir2_jax.sharded_gemm import projection
from infir2_jax.sharding import compute_axes

DotGeneral = Callable[..., jax.Array]
# Given a projection's module path ("layers_0/self_attn/q_proj", "lm_head"), returns the
# dot_general to use there. Called inside the projection's compact method, so it may return a
# linen Module created on the spot (a child of that projection) as well as a plain function.
DotGeneralFactory = Callable[[str], DotGeneral]


def default_dot_general_factory(path: str) -> DotGeneral:
  del path
  return lax.dot_general


def _path(module: nn.Module) -> str:
  return "/".join(str(p) for p in module.scope.path)


class Linear(nn.Module):
  """y = x @ W (+ b), W stored [in, out] in param_dtype, computed in dtype via the factory."""
  features: int
  kernel_axes: tuple[str, str]
  use_bias: bool = False
  dtype: Any = jnp.bfloat16
  param_dtype: Any = jnp.float32
  init_std: float = 0.02
  dot_general_factory: DotGeneralFactory = default_dot_general_factory

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    kernel = self.param(
        "kernel",
        nn.with_logical_partitioning(nn.initializers.normal(self.init_std), self.kernel_axes),
        (x.shape[-1], self.features), self.param_dtype)
    dot_general = self.dot_general_factory(_path(self))
    # The compute copy is gathered over fsdp right here (tensor split kept), so GSPMD moves
    # the weight, not the activations.
    kernel = nn.with_logical_constraint(kernel.astype(self.dtype), compute_axes(self.kernel_axes))
    y = projection(dot_general, x.astype(self.dtype), kernel, self.kernel_axes)
    if self.use_bias:
      bias = self.param(
          "bias", nn.with_logical_partitioning(nn.initializers.zeros, self.kernel_axes[1:]),
          (self.features,), self.param_dtype)
      y = y + bias.astype(y.dtype)
    return y


class RMSNorm(nn.Module):
  """Qwen2RMSNorm: normalise in float32, cast back, then scale."""
  eps: float = 1e-6
  dtype: Any = jnp.bfloat16
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
                       (x.shape[-1],), self.param_dtype)
    x32 = x.astype(jnp.float32)  # statistics in f32 regardless of the activation dtype
    y = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return scale.astype(self.dtype) * y.astype(self.dtype)


def rope_cos_sin(positions_BxL: jax.Array, head_dim: int, theta: float):
  """cos/sin tables [B, L, Dh] in float32, HF's layout (the half-frequencies repeated)."""
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  angles_BxLxHalf = positions_BxL.astype(jnp.float32)[..., None] * inv_freq
  angles_BxLxDh = jnp.concatenate([angles_BxLxHalf, angles_BxLxHalf], axis=-1)
  return jnp.cos(angles_BxLxDh), jnp.sin(angles_BxLxDh)


def apply_rope(x_BxLxNxDh: jax.Array, cos_BxLxDh: jax.Array, sin_BxLxDh: jax.Array):
  """Rotate-half RoPE (Qwen2/Llama convention), computed in float32."""
  x = x_BxLxNxDh.astype(jnp.float32)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  out = x * cos_BxLxDh[:, :, None, :] + rotated * sin_BxLxDh[:, :, None, :]
  return out.astype(x_BxLxNxDh.dtype)


def segment_mask(segment_ids_BxL: jax.Array) -> jax.Array:
  """[B, 1, L, L] boolean: query and key in the same packed segment (causality is separate).

  Passed with `is_causal=True`, so cuDNN's flash attention skips the blocks above the
  diagonal (half the work) and applies only this mask inside the causal triangle.
  """
  same_segment_BxLxL = segment_ids_BxL[:, :, None] == segment_ids_BxL[:, None, :]
  return same_segment_BxLxL[:, None]


def shard_for_cudnn(q_BxLxHxDh, k_BxLxKxDh, v_BxLxKxDh, mask_Bx1xLxL):
  """Shardings cuDNN attention's SPMD partitioner accepts: q, k and v alike, mask by batch.

  Its partitioner requires identical PartitionSpecs for q, k and v (split on batch and heads
  only) and the mask split on batch only; left to propagation, K and V come out sharded
  otherwise and the compile fails ("Query, key and value should have same sharding"). Where
  the KV heads are replicated but the query heads split (tensor degree > KV heads), K and V
  are repeated to one head per query head first, as Megatron does. No-op without a mesh.
  """
  if nn.logical_to_mesh_axes(("act_heads",)) != nn.logical_to_mesh_axes(("act_kv_heads",)):
    groups = q_BxLxHxDh.shape[2] // k_BxLxKxDh.shape[2]
    k_BxLxKxDh = jnp.repeat(k_BxLxKxDh, groups, axis=2)
    v_BxLxKxDh = jnp.repeat(v_BxLxKxDh, groups, axis=2)
  qkv = tuple(nn.with_logical_constraint(t, ("batch", "length", "act_heads", None))
              for t in (q_BxLxHxDh, k_BxLxKxDh, v_BxLxKxDh))
  if mask_Bx1xLxL is not None:
    mask_Bx1xLxL = nn.with_logical_constraint(mask_Bx1xLxL, ("batch", None, None, None))
  return (*qkv, mask_Bx1xLxL)


class Attention(nn.Module):
  """Grouped-query self-attention with q/k/v biases; softmax in float32."""
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float
  qkv_bias: bool = True
  implementation: str | None = None   # None (XLA) or "cudnn"
  dtype: Any = jnp.bfloat16
  param_dtype: Any = jnp.float32
  init_std: float = 0.02
  dot_general_factory: DotGeneralFactory = default_dot_general_factory
  document_mask: bool = True          # attend within the packed segment only (else causal)

  @nn.compact
  def __call__(self, x_BxLxD, positions_BxL, segment_ids_BxL):
    batch, length, width = x_BxLxD.shape
    dense = lambda features, axes, bias, name: Linear(
        features, axes, bias, self.dtype, self.param_dtype, self.init_std,
        self.dot_general_factory, name=name)
    q = dense(self.num_heads * self.head_dim, ("embed", "heads"), self.qkv_bias, "q_proj")(x_BxLxD)
    k = dense(self.num_kv_heads * self.head_dim, ("embed", "kv_heads"), self.qkv_bias,
              "k_proj")(x_BxLxD)
    v = dense(self.num_kv_heads * self.head_dim, ("embed", "kv_heads"), self.qkv_bias,
              "v_proj")(x_BxLxD)
    q_BxLxHxDh = q.reshape(batch, length, self.num_heads, self.head_dim)
    k_BxLxKxDh = k.reshape(batch, length, self.num_kv_heads, self.head_dim)
    v_BxLxKxDh = v.reshape(batch, length, self.num_kv_heads, self.head_dim)
    q_BxLxHxDh = nn.with_logical_constraint(q_BxLxHxDh, ("batch", "length", "act_heads", None))

    cos, sin = rope_cos_sin(positions_BxL, self.head_dim, self.rope_theta)
    q_BxLxHxDh = apply_rope(q_BxLxHxDh, cos, sin)
    k_BxLxKxDh = apply_rope(k_BxLxKxDh, cos, sin)

    mask_Bx1xLxL = segment_mask(segment_ids_BxL) if self.document_mask else None
    if self.implementation == "cudnn":
      q_BxLxHxDh, k_BxLxKxDh, v_BxLxKxDh, mask_Bx1xLxL = shard_for_cudnn(
          q_BxLxHxDh, k_BxLxKxDh, v_BxLxKxDh, mask_Bx1xLxL)
    out_BxLxHxDh = jax.nn.dot_product_attention(
        q_BxLxHxDh, k_BxLxKxDh, v_BxLxKxDh, mask=mask_Bx1xLxL, is_causal=True,
        implementation=self.implementation)
    out_BxLxHDh = out_BxLxHxDh.reshape(batch, length, self.num_heads * self.head_dim)
    return dense(width, ("heads", "embed"), False, "o_proj")(out_BxLxHDh)


class MLP(nn.Module):
  """SwiGLU: down(silu(gate(x)) * up(x))."""
  intermediate_size: int
  dtype: Any = jnp.bfloat16
  param_dtype: Any = jnp.float32
  init_std: float = 0.02
  dot_general_factory: DotGeneralFactory = default_dot_general_factory

  @nn.compact
  def __call__(self, x_BxLxD):
    dense = lambda features, axes, name: Linear(
        features, axes, False, self.dtype, self.param_dtype, self.init_std,
        self.dot_general_factory, name=name)
    gate_BxLxF = dense(self.intermediate_size, ("embed", "mlp"), "gate_proj")(x_BxLxD)
    up_BxLxF = dense(self.intermediate_size, ("embed", "mlp"), "up_proj")(x_BxLxD)
    h_BxLxF = nn.silu(gate_BxLxF) * up_BxLxF
    h_BxLxF = nn.with_logical_constraint(h_BxLxF, ("batch", "length", "act_mlp"))
    return dense(x_BxLxD.shape[-1], ("mlp", "embed"), "down_proj")(h_BxLxF)
