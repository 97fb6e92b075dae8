"""Shard-local FP8 GEMMs: each projection of a block-scaled recipe runs on every device's shard.

XLA partitions its own ops, but a Pallas kernel is an opaque custom call: under jit with
sharded operands the SPMD partitioner can only gather the operands and run the kernel whole
on every device (each GPU doing all the work, and K/V sharded unlike Q, which cuDNN attention
then refuses). Block and tile scaling (infir2: 1x128 tiles, 128x128 blocks) needs nothing
outside a shard when shards split on multiples of 128 (sharding_fp8.check_fp8_alignment), so
the projection's dot_general runs inside `jax.shard_map`: tokens split like the batch, the
weight like its compute axes. Column-parallel projections (q, k, v, gate, up) split N over
tensor; row-parallel ones (o, down) split K, and their partial outputs are summed over the
tensor axis (Megatron's all-reduce). Both backends (Pallas and XLA) take this path, so the CPU
tests check the partitioning that the GPU kernels run under.

Recipes whose scales span a whole row or tensor (fp8_rowwise, fp8_tensorwise) need cross-shard
maxima and stay with XLA's partitioner; so do bf16 projections.
"""

import flax.linen as nn
import jax
from jax.sharding import PartitionSpec as P

from infir2_jax.sharding import as_axes, compute_axes, ways

MAX_LOCAL_TILE = 128


def shard_local(recipe) -> bool:
  """True when every quantized operand of `recipe` has tiles of at most 128 x 128."""
  operands = [op for gemm in recipe.gemms().values() for op in (gemm.lhs, gemm.rhs)
              if op.quantized]
  return bool(operands) and all(
      op.tile is not None and all(0 < t <= MAX_LOCAL_TILE for t in op.tile)
      for op in operands)


def _axes(name):
  """Mesh axes of one logical name under the active rules (None, a name or a tuple)."""
  return nn.logical_to_mesh_axes((name,))[0] if name else None


def projection(dot_general, x, kernel, kernel_axes: tuple[str, str]):
  """y = x @ kernel ([..., K] x [K, N]) through `dot_general`, per shard when that helps.

  Per shard (shard_map) when a mesh of several devices is active and dot_general carries a
  shard-local recipe (`dot_general.recipe`); otherwise one global call that XLA partitions.
  """
  dimension_numbers = (((x.ndim - 1,), (0,)), ((), ()))
  call = lambda x, w: dot_general(x, w, dimension_numbers, precision=None,
                                  preferred_element_type=None)
  mesh = jax.sharding.get_abstract_mesh()
  # A telemetry dot_general is a linen Module that sows statistics: it cannot run inside
  # shard_map (the sown values would leak out of its trace), so XLA partitions it.
  recipe = None if isinstance(dot_general, nn.Module) else getattr(dot_general, "recipe", None)
  if (mesh.empty or mesh.size == 1 or recipe is None or not shard_local(recipe)
      or x.ndim not in (2, 3)):
    return call(x, kernel)
  k_name, n_name = compute_axes(kernel_axes)
  batch, k_axes, n_axes = _axes("batch"), _axes(k_name), _axes(n_name)
  lead = (batch, _axes("length")) if x.ndim == 3 else (batch,)
  x_spec, w_spec, y_spec = P(*lead, k_axes), P(k_axes, n_axes), P(*lead, n_axes)
  dims = [*zip(x.shape, x_spec), *zip(kernel.shape, w_spec)]
  if any(size % ways(mesh, as_axes(axes)) for size, axes in dims):
    return call(x, kernel)  # e.g. the 1-row batch that traces init: XLA partitions it

  # check_vma=False: a pallas_call does not carry shard_map's varying-axes types. The
  # transpose then sums each input's cotangent over the axes its spec leaves out: dW over the
  # batch axes (the gradient reduction), dX over tensor for column-parallel projections.
  per_shard = lambda f, out_spec: jax.shard_map(f, mesh=mesh, in_specs=(x_spec, w_spec),
                                                out_specs=out_spec, check_vma=False)
  if not as_axes(k_axes):
    return per_shard(call, y_spec)(x, kernel)
  # Row-parallel: each shard's partial sum, stacked on a leading axis split like K, summed
  # by XLA (the forward all-reduce; its transpose is a broadcast, so the backward pass
  # needs no communication for dY, as in Megatron).
  partials = per_shard(lambda x, w: call(x, w)[None], P(k_axes, *lead, n_axes))(x, kernel)
  return partials.sum(0, dtype=partials.dtype)
