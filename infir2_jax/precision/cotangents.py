"""A mark on custom derivatives whose cotangents are buffers of their inputs' dtypes.

A `jax.custom_vjp` backward marked `cotangent_is_buffer` computes each float input's
cotangent whole and rounds it once to that input's dtype (as a GEMM rounds its output): the
FP8 projection (its wgrad GEMM writes dW in the weight's compute dtype), the fused FP8 MLP
(one wgrad GEMM for gate | up, one for down) and the fused LM head and loss. A param the model
casts to bf16 and passes straight into one of them then keeps its gradient in bf16 to the
optimizer, with no float32 copy of it (train/grads.py reads the mark).
"""

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
