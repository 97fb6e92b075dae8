"""Qwen2 building blocks: Linear (its dot_general injected), RMSNorm, RoPE, the SwiGLU MLP.

Shape legend: B batch, L length, D model width, F MLP width, Dh head size.
"""

import functools
import os
from collections.abc import Callable
from typing import Any, Protocol

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from infir2_jax.model.axes import TOKEN_AXES, compute_axes
from infir2_jax.precision import swiglu
from infir2_jax.precision.cotangents import broadcast_like, cotangent_is_buffer
from infir2_jax.precision.normed import NormedInput, materialize
from infir2_jax.precision.per_shard import MlpAxes, ProjectionAxes

DotGeneral = Callable[..., jax.Array]


class DotGeneralFactory(Protocol):
  """The model's one precision hook: the dot_general of the projection at `path`.

  `path` is the projection's module path ("layers_0/self_attn/q_proj", "lm_head") and
  `axes` the logical axes of its operands (None where the product is not a Dense one, e.g.
  the tied LM head); the dot_general returned may use them to run per shard. Called inside
  the projection's compact method, so it may return a linen Module created on the spot (a
  child of that projection) as well as a plain function.
  """

  def __call__(self, path: str, axes: ProjectionAxes | None = None) -> DotGeneral: ...

  # Optional: `gated_mlp(path, axes: MlpAxes)` -> mlp(x, w_gate, w_up, w_down) or None, the
  # whole SwiGLU MLP at `path` as one op (precision.fused_mlp); the MLP uses it when given,
  # and hands it its norm's NormedInput when mlp.accepts_normed (precision.fused_norm).
  # Optional: `fused_qkv(path, axes: QkvAxes)` -> qkv(x, wq, wk, wv, biases=None) -> (q, k, v)
  # or None, the attention's three input projections (and their biases) as one product
  # (precision.fused_qkv); the attention hands it its norm's NormedInput when
  # qkv.accepts_normed (precision.fused_norm).


def default_dot_general_factory(path: str, axes: ProjectionAxes | None = None) -> DotGeneral:
  del path, axes
  return lax.dot_general


def module_path(module: nn.Module) -> str:
  return "/".join(str(p) for p in module.scope.path)


def dense_dimension_numbers(x: jax.Array):
  """x [..., K] . w [K, N]: the Dense contraction."""
  return (((x.ndim - 1,), (0,)), ((), ()))


def _compute_kernel(module: nn.Module, in_features: int):
  """The module's kernel param [in, out] (module.features, kernel_axes, init_std, dtypes),
  returned as its compute-dtype copy in its compute layout."""
  kernel = module.param(
      "kernel",
      nn.with_logical_partitioning(nn.initializers.normal(module.init_std), module.kernel_axes),
      (in_features, module.features), module.param_dtype)
  # The compute copy is gathered over fsdp right here (tensor split kept), so GSPMD moves
  # the weight, not the activations.
  return nn.with_logical_constraint(kernel.astype(module.dtype), compute_axes(module.kernel_axes))


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
    kernel = _compute_kernel(self, x.shape[-1])
    w_axes = compute_axes(self.kernel_axes)
    axes = None
    if x.ndim - 1 <= len(TOKEN_AXES):
      axes = ProjectionAxes(x=(*TOKEN_AXES[:x.ndim - 1], w_axes[0]), w=w_axes)
    dot_general = self.dot_general_factory(module_path(self), axes)
    y = dot_general(x.astype(self.dtype), kernel, dense_dimension_numbers(x), precision=None,
                    preferred_element_type=None)
    if self.use_bias:   # the bias's gradient summed in float32 (precision/cotangents.py)
      y = y + broadcast_like(_bias(self), y)
    return y


def _bias(module: nn.Module) -> jax.Array:
  """The module's bias param [out] (module.features, kernel_axes, param_dtype)."""
  return module.param(
      "bias", nn.with_logical_partitioning(nn.initializers.zeros, module.kernel_axes[1:]),
      (module.features,), module.param_dtype)


class LinearParams(nn.Module):
  """A Linear's params alone (same params, same names), for a product run elsewhere (the
  fused MLP, the fused q/k/v): (the kernel's compute-dtype copy, the bias or None)."""
  features: int
  kernel_axes: tuple[str, str]
  use_bias: bool = False
  dtype: Any = jnp.bfloat16
  param_dtype: Any = jnp.float32
  init_std: float = 0.02

  @nn.compact
  def __call__(self, in_features: int) -> tuple[jax.Array, jax.Array | None]:
    return _compute_kernel(self, in_features), (_bias(self) if self.use_bias else None)


# How the embedding's backward sums the gradients of repeated tokens: "f32" (default) sorts
# the tokens and sums each one's rows in float32 ([tokens, D] of float32), rounded once (on
# a mesh of several devices the table form below: a sort would gather every device's
# tokens and rows); "f32_table" scatter-adds them into a float32 copy of the whole table
# (0.87 GiB at 1.5B on one device, live at the step's peak; sharded as the table is),
# rounded once; "autodiff" is jnp.take's own transpose, a scatter-add in the table's dtype
# (bf16 atomics on the GPU). INFIR2_EMBED_GRAD, for A/B runs.
EMBED_GRAD = os.environ.get("INFIR2_EMBED_GRAD", "f32")
EMBED_GRADS = ("f32", "f32_table", "autodiff")


def embed_lookup(table_VxD: jax.Array, tokens: jax.Array) -> jax.Array:
  """jnp.take(table_VxD, tokens, axis=0), the rows of the tokens, whose gradient for the
  table adds each token's rows in float32 and rounds the sums once (EMBED_GRAD).

  jnp.take's own transpose scatter-adds the cotangent rows in the table's dtype: a token
  seen n times in a bf16 step collects n bf16 roundings (and on the GPU bf16 atomics, 4.2 ms
  of a 1.5B step at 2 x 8192). Here the sums are float32 and one cast rounds them, so the
  table's cotangent is one buffer rounded once (marked cotangent_is_buffer: an untied
  table keeps its gradient in bf16 to the optimizer, train/grads.py)."""
  if EMBED_GRAD not in EMBED_GRADS:
    raise ValueError(f"INFIR2_EMBED_GRAD={EMBED_GRAD!r}: one of {EMBED_GRADS}")
  if EMBED_GRAD == "autodiff" or table_VxD.dtype == jnp.float32:
    return jnp.take(table_VxD, tokens, axis=0)
  mesh = jax.sharding.get_abstract_mesh()
  whole_table = EMBED_GRAD == "f32_table" or not (mesh.empty or mesh.size == 1)
  return _take_rows(table_VxD.shape[0], whole_table, table_VxD, tokens)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _take_rows(vocab: int, whole_table: bool, table_VxD, tokens):
  del vocab, whole_table
  return jnp.take(table_VxD, tokens, axis=0)


def _take_rows_fwd(vocab: int, whole_table: bool, table_VxD, tokens):
  del vocab, whole_table
  return jnp.take(table_VxD, tokens, axis=0), tokens


def _token_sums(vocab: int, tokens, rows):
  """The float32 sum of each distinct token's rows, scattered once into a table of zeros of
  the rows' dtype: tokens sorted, each run of one token a segment ([tokens, D] of float32,
  not [V, D]). Indices as jnp.take reads them: negative ones from the end, out-of-range
  ones (NaN rows forward) dropped."""
  t = tokens.reshape(-1)
  rows = rows.reshape(t.shape[0], -1)
  t = jnp.where(t < 0, t + vocab, t)
  t = jnp.where((t >= 0) & (t < vocab), t, vocab)          # out of range: past the table
  order = jnp.argsort(t, stable=True)
  t = t[order]
  first = jnp.concatenate([jnp.ones((1,), bool), t[1:] != t[:-1]])
  segment = jnp.cumsum(first.astype(jnp.int32)) - 1        # the run each sorted row is in
  sums = jax.ops.segment_sum(rows[order].astype(jnp.float32), segment,
                             num_segments=t.shape[0], indices_are_sorted=True)
  run_token = jnp.full(t.shape, vocab, t.dtype).at[segment].set(t)   # unused runs: dropped
  return jnp.zeros((vocab, rows.shape[-1]), rows.dtype).at[run_token].set(
      sums.astype(rows.dtype), mode="drop", unique_indices=True)


@cotangent_is_buffer
def _take_rows_bwd(vocab: int, whole_table: bool, tokens, g):
  """The float32 sums of each token's cotangent rows, rounded once (_token_sums, or with
  whole_table a float32 scatter-add into the whole table)."""
  if whole_table:
    sums = jnp.zeros((vocab, g.shape[-1]), jnp.float32).at[tokens].add(
        g.astype(jnp.float32), mode="drop").astype(g.dtype)
  else:
    sums = _token_sums(vocab, tokens, g)
  return sums, np.zeros(tokens.shape, jax.dtypes.float0)


_take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


class RMSNorm(nn.Module):
  """Qwen2RMSNorm: normalise in float32, cast back, then scale.

  deferred=True returns NormedInput(f32(x), inv, scale, dtype) instead (precision/
  normed.py): the same y, not yet computed, for a consumer that quantizes it straight from x
  (the fused MLP or q/k/v product with precision.fused_norm); x must then be in the norm's
  dtype (the kernel reads x itself)."""
  eps: float = 1e-6
  dtype: Any = jnp.bfloat16
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array, deferred: bool = False) -> "jax.Array | NormedInput":
    scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
                       (x.shape[-1],), self.param_dtype)
    x32 = x.astype(jnp.float32)  # statistics in f32 regardless of the activation dtype
    inv = lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    if deferred:
      if x.dtype != jnp.dtype(self.dtype):
        raise ValueError(f"RMSNorm(deferred=True) takes x in its dtype {jnp.dtype(self.dtype)}, "
                         f"got {x.dtype}")
      return NormedInput(x32, inv, scale, jnp.dtype(self.dtype))
    y = (x32 * inv).astype(self.dtype)
    return broadcast_like(scale, y) * y   # its gradient summed in float32 (cotangents.py)


# Where RoPE's cos/sin tables are made: "once" (default) per model call, shared by every
# layer, with the save-dots remat policies keeping the attention's inputs; "per_layer" is
# the form before session 31 (each layer makes its own, and a remat'd layer's backward makes
# them and applies RoPE again). INFIR2_ROPE, for A/B runs.
ROPE = os.environ.get("INFIR2_ROPE", "once")
ROPES = ("once", "per_layer")


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


class MLP(nn.Module):
  """SwiGLU: down(silu(gate(x)) * up(x)), silu and the product in float32 (precision.swiglu).

  When the factory offers a fused MLP for this path (block-scaled FP8 recipes), the three
  projections run as that one op; the params (gate_proj, up_proj, down_proj kernels) are the
  same either way. x may be a pre-norm's NormedInput (RMSNorm(deferred=True)): the fused op
  takes it as it is where it accepts_normed (takes_normed), anything else gets it
  materialized, the norm's y bit for bit."""
  intermediate_size: int
  dtype: Any = jnp.bfloat16
  param_dtype: Any = jnp.float32
  init_std: float = 0.02
  dot_general_factory: DotGeneralFactory = default_dot_general_factory

  @nn.nowrap
  def _fused_op(self, ndim: int):
    """The factory's fused MLP for this path and an x of `ndim` dims, or None."""
    if not hasattr(self.dot_general_factory, "gated_mlp") or ndim - 1 > len(TOKEN_AXES):
      return None
    hidden_axes = compute_axes(("embed", "mlp"))
    axes = MlpAxes(x=(*TOKEN_AXES[:ndim - 1], hidden_axes[0]), hidden=hidden_axes)
    return self.dot_general_factory.gated_mlp(module_path(self), axes)

  def takes_normed(self, ndim: int) -> bool:
    """Whether an x of `ndim` dims should come as its norm's NormedInput: the fused op runs
    here and accepts one (precision.fused_norm)."""
    return getattr(self._fused_op(ndim), "accepts_normed", False)

  @nn.compact
  def __call__(self, x_BxLxD: "jax.Array | NormedInput"):
    normed = isinstance(x_BxLxD, NormedInput)
    if normed and not self.takes_normed(x_BxLxD.ndim):
      x_BxLxD, normed = materialize(x_BxLxD), False
    width, hidden = x_BxLxD.shape[-1], self.intermediate_size
    fused = self._fused_op(x_BxLxD.ndim)
    if fused is not None:
      kernel = lambda features, axes, name, fan_in: LinearParams(
          features, axes, False, self.dtype, self.param_dtype, self.init_std,
          name=name)(fan_in)[0]
      w_gate = kernel(hidden, ("embed", "mlp"), "gate_proj", width)
      w_up = kernel(hidden, ("embed", "mlp"), "up_proj", width)
      w_down = kernel(width, ("mlp", "embed"), "down_proj", hidden)
      return fused(x_BxLxD if normed else x_BxLxD.astype(self.dtype), w_gate, w_up, w_down)

    def dense(features, axes, name):
      return Linear(features, axes, dtype=self.dtype, param_dtype=self.param_dtype,
                    init_std=self.init_std, dot_general_factory=self.dot_general_factory,
                    name=name)
    gate_BxLxF = dense(hidden, ("embed", "mlp"), "gate_proj")(x_BxLxD)
    up_BxLxF = dense(hidden, ("embed", "mlp"), "up_proj")(x_BxLxD)
    h_BxLxF = swiglu(gate_BxLxF, up_BxLxF)
    h_BxLxF = nn.with_logical_constraint(h_BxLxF, ("batch", "length", "act_mlp"))
    return dense(width, ("mlp", "embed"), "down_proj")(h_BxLxF)
