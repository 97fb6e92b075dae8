"""A pre-norm block's operand before it is materialized: the RMSNorm fused into its consumer.

A pre-norm block reads y = gamma * bf16(h * inv) (model.layers.RMSNorm: h the residual
stream, inv = rsqrt(mean(h**2) + eps) per row, gamma the norm's scale) only to quantize it
for its first GEMMs. Written out, y costs one write and one read of a bf16 [tokens, D]
tensor per norm per layer (~2 x 50 MB at 1.5B and 16k tokens) between two kernels that
could be one. So the norm may hand over NormedInput(h, inv, gamma) instead of y
(precision.fused_norm), and the consumer (the fused MLP, or the FP8 dot_general of the fused
q|k|v product) quantizes it directly:

  forward   h, inv [M, 1], gamma -> (y 1x128 tiles, y^T token tiles)   one read of h, no y
            (dot_general.quantize_normed_rows: kernels.quantize_normed_tiles on Hopper;
            elsewhere y is made and quantized by XLA, quantize_rows: the same bits)
  backward  dy = the consumer's dx  ->  (dh, dinv, dgamma)              normed_vjp: autodiff
            of y's formula, so the gradients are those of the unfused model's product; dinv
            flows on to inv's own (autodiff) formula, as RMSNorm's does
This module holds the operand and its formulas; its quantizer lives with the others in
dot_general.py, which imports it (so that the FP8 dot_general can take one).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from infir2_jax.precision.cotangents import broadcast_like


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NormedInput:
  """The operand gamma * bf16(h * inv) of a pre-norm block, not yet materialized.

  h [..., D] float32: the residual stream as the norm reads it (f32 of a tensor in `dtype`,
  so the kernel's bf16 h is exactly the stream: XLA folds the widening and narrowing away);
  inv [..., 1] float32 each row's 1 / rms; gamma [D] the norm's scale (the float32 param;
  rounded to `dtype` as RMSNorm does); dtype the compute dtype y is rounded to (static).

  h enters in float32 so that its cotangent leaves in float32: RMSNorm's autodiff adds the
  product's and the row statistics' contributions to dh in float32 and rounds once to the
  stream's dtype, and so does the fused path (a bf16 h would round the product's part on its
  own first). A pytree: it passes through jit, custom_vjp and shard_map. Its shape, ndim and
  dtype are those of the operand it stands for, so code that only sizes x takes either."""
  h: jax.Array
  inv: jax.Array
  gamma: jax.Array
  dtype: np.dtype = dataclasses.field(metadata=dict(static=True))

  @property
  def shape(self) -> tuple[int, ...]:
    return self.h.shape

  @property
  def ndim(self) -> int:
    return self.h.ndim


def materialize(n: NormedInput) -> jax.Array:
  """y = gamma * bf16(h * inv) in n.dtype, as RMSNorm computes it (the unfused path)."""
  y = (n.h * n.inv).astype(n.dtype)
  return broadcast_like(n.gamma, y) * y   # dgamma summed in float32 (cotangents.py)


def stream(n: NormedInput) -> jax.Array:
  """The residual stream h in the compute dtype (what the kernel reads; exact)."""
  return n.h.astype(n.dtype)


def as_residual(n: NormedInput) -> NormedInput:
  """n to keep for the backward: h in the compute dtype (half the bytes of float32's)."""
  return dataclasses.replace(n, h=stream(n))


def from_residual(n: NormedInput) -> NormedInput:
  """as_residual's inverse (exact: h was a tensor in the compute dtype)."""
  return dataclasses.replace(n, h=n.h.astype(jnp.float32))


def normed_vjp(n: NormedInput, dy: jax.Array) -> NormedInput:
  """The cotangents (dh, dinv, dgamma) of y = materialize(n) for dy, each in its input's
  dtype (float32): autodiff of y's formula, so exactly what jax.grad through RMSNorm's
  product gives (dinv then reaches h through inv's formula outside, as in RMSNorm, and the
  two parts of dh add in float32 before the stream's one rounding)."""
  _, vjp = jax.vjp(lambda h, inv, gamma: materialize(dataclasses.replace(
      n, h=h, inv=inv, gamma=gamma)), n.h, n.inv, n.gamma)
  dh, dinv, dgamma = vjp(dy)
  return dataclasses.replace(n, h=dh, inv=dinv, gamma=dgamma)
