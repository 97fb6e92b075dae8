"""The model's logical axis names: on params, on key activations, and a weight's compute layout.

Params are annotated with PARAM_AXES names (nn.with_logical_partitioning), key activations
with ACTIVATION_AXES names (nn.with_logical_constraint). The model knows no mesh: the rules
that map these names onto mesh axes belong to the run (infir2_jax.parallel.mesh).
"""

from collections.abc import Sequence

PARAM_AXES = ("vocab", "embed", "heads", "kv_heads", "mlp", "norm")
ACTIVATION_AXES = ("batch", "length", "act_embed", "act_heads", "act_kv_heads", "act_mlp")

# Param logical axis -> the activation axis of the same feature dim: a kernel's layout while
# it is used (gathered over fsdp, still split over tensor).
COMPUTE_AXES = {"embed": "act_embed", "heads": "act_heads", "mlp": "act_mlp"}

# The leading dims of a projection's input x [batch, length, K].
TOKEN_AXES = ("batch", "length")


def compute_axes(param_axes: Sequence[str | None]) -> tuple[str | None, ...]:
  """Logical axes of a param's compute-dtype copy inside the layer that uses it.

  Constraining the bf16 kernel to these (nn.with_logical_constraint) makes FSDP an explicit
  all-gather right before the GEMM, with the tensor-parallel split kept; left to itself
  GSPMD may instead reshard the activations (an "involuntary full rematerialization").
  """
  return tuple(COMPUTE_AXES.get(a, a) if a else a for a in param_axes)
