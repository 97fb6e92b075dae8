"""How cotangents are summed and rounded: a float32 sum for broadcast params, and a mark on
custom derivatives whose cotangents are buffers of their inputs' dtypes.

`broadcast_like(v, like)` broadcasts a per-feature param (a bias, a norm's scale) in float32,
so that autodiff's transpose, the cotangent summed over the tokens, adds in float32. Broadcast
in bf16, the sum is a bf16 reduction, and XLA:GPU adds a bf16 reduction in bf16
(`add.rn.bf16` in the H200's PTX, session 31): every partial sum of 16,384 tokens rounds.
XLA:CPU computes in float32, so only the GPU lost the bits.

A `jax.custom_vjp` backward marked `cotangent_is_buffer` computes each float input's
cotangent whole and rounds it once to that input's dtype (as a GEMM rounds its output): the
FP8 projection (its wgrad GEMM writes dW in the weight's compute dtype), the fused FP8 MLP
(one wgrad GEMM for gate | up, one for down) and the fused LM head and loss. A param the model
casts to bf16 and passes straight into one of them then keeps its gradient in bf16 to the
optimizer, with no float32 copy of it (train/grads.py reads the mark).
"""

import jax
import jax.numpy as jnp


def broadcast_like(v: jax.Array, like: jax.Array) -> jax.Array:
  """v [..., N] broadcast to like's shape and rounded to its dtype, the same values as
  `v.astype(like.dtype)` broadcast, through float32. The gradient of v is then the float32
  sum of like-shaped cotangents, rounded once to v's dtype (see the module docstring)."""
  rounded = v.astype(like.dtype).astype(jnp.float32)
  return jnp.broadcast_to(rounded, like.shape).astype(like.dtype)


# The backwards' core functions (what JAX keeps as the custom_vjp_call's `bwd.f`).
_MARKED: set = set()


def cotangent_is_buffer(bwd):
  """Marks `bwd`, a jax.custom_vjp backward: see the module docstring. Returns it."""
  _MARKED.add(bwd)
  return bwd


def is_marked(eqn) -> bool:
  """Whether a custom_vjp_call equation's backward carries the mark."""
  bwd = eqn.params.get("bwd")
  return getattr(bwd, "f", None) in _MARKED   # lu.WrappedFun's core function
