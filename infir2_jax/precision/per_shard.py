"""Shard-local FP8 GEMMs: a projection of a block-scaled recipe runs on every device's shard.

XLA partitions its own ops, but a Pallas kernel is an opaque custom call: under jit with
sharded operands the SPMD partitioner can only gather the operands and run the kernel whole
on every device (each GPU doing all the work, and K/V sharded unlike Q, which cuDNN attention
then refuses). Block and tile scaling (infir2: 1x128 tiles, 128x128 blocks) needs nothing
outside a shard when shards split on multiples of 128 (parallel.fp8_alignment checks it at
start-up), so the projection's dot_general runs inside `jax.shard_map`: tokens split like the
batch, the weight like its compute axes. Column-parallel projections (q, k, v, gate, up)
split N over tensor; row-parallel ones (o, down) split K, and their partial outputs are
summed over the tensor axis (Megatron's all-reduce). Both backends (Pallas and XLA) take
this path, so the CPU tests check the partitioning that the GPU kernels run under.

The layer passes its operands' logical axes (ProjectionAxes); the active logical-axis rules
(flax's nn.logical_axis_rules) and mesh turn them into PartitionSpecs at trace time.
Recipes whose scales span a whole row or tensor (fp8_rowwise, fp8_tensorwise) need
cross-shard maxima and stay with XLA's partitioner; so do bf16 projections, except the
fused q/k/v product (per_shard_qkv), whose concatenation of column-parallel weights must be
each device's own heads.
"""

import dataclasses
import math

import flax.linen as nn
import jax
from jax.sharding import PartitionSpec as P

from infir2_jax.precision.normed import NormedInput
from infir2_jax.precision.recipes import Recipe

MAX_LOCAL_TILE = 128


@dataclasses.dataclass(frozen=True)
class ProjectionAxes:
  """Logical axes of a projection y[..., N] = x[..., K] . w[K, N].

  Attributes:
    x: one name per dim of x, e.g. ("batch", "length", "act_embed").
    w: the names of the compute-dtype weight's [K, N], e.g. ("act_embed", "act_heads").
  """
  x: tuple[str | None, ...]
  w: tuple[str | None, str | None]


def shard_local(recipe: Recipe) -> bool:
  """True when every quantized operand of `recipe` has tiles of at most 128 x 128."""
  operands = [op for gemm in recipe.gemms().values() for op in (gemm.lhs, gemm.rhs)
              if op.quantized]
  return bool(operands) and all(
      op.tile is not None and all(0 < t <= MAX_LOCAL_TILE for t in op.tile)
      for op in operands)


def _mesh_axes(names) -> tuple:
  """PartitionSpec entries of logical names under the active rules."""
  return tuple(nn.logical_to_mesh_axes(tuple(names)))


def _ways(mesh, entry) -> int:
  if entry is None:
    return 1
  return math.prod(mesh.shape[a] for a in ((entry,) if isinstance(entry, str) else entry))


def _is_dense(lhs, dimension_numbers) -> bool:
  (lc, rc), (lb, rb) = dimension_numbers
  return (tuple(lc) == (lhs.ndim - 1,) and tuple(rc) == (0,) and not tuple(lb)
          and not tuple(rb))


def per_shard(dot_general, axes: ProjectionAxes):
  """`dot_general` run inside shard_map on each device's shard of a Dense product.

  Per shard when a mesh of several devices is active, the product is x [..., K] . w [K, N]
  with x of len(axes.x) dims, and every split dimension divides evenly; otherwise one global
  call that XLA partitions (e.g. the one-row batch that traces init).
  """
  def call(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    whole = lambda x, w: dot_general(x, w, dimension_numbers, precision=precision,
                                     preferred_element_type=preferred_element_type)
    mesh = jax.sharding.get_abstract_mesh()
    if (mesh.empty or mesh.size == 1 or not _is_dense(lhs, dimension_numbers)
        or lhs.ndim != len(axes.x) or rhs.ndim != 2):
      return whole(lhs, rhs)
    *lead, _ = _mesh_axes(axes.x)
    k_axes, n_axes = _mesh_axes(axes.w)
    x_spec, w_spec, y_spec = P(*lead, k_axes), P(k_axes, n_axes), P(*lead, n_axes)
    dims = [*zip(lhs.shape, x_spec), *zip(rhs.shape, w_spec)]
    if any(size % _ways(mesh, entry) for size, entry in dims):
      return whole(lhs, rhs)

    # check_vma=False: a pallas_call does not carry shard_map's varying-axes types. The
    # transpose then sums each input's cotangent over the axes its spec leaves out: dW over
    # the batch axes (the gradient reduction), dX over tensor for column-parallel ones.
    shard = lambda f, out_spec: jax.shard_map(f, mesh=mesh, in_specs=(x_spec, w_spec),
                                              out_specs=out_spec, check_vma=False)
    if k_axes is None:
      return shard(whole, y_spec)(lhs, rhs)
    # Row-parallel: each shard's partial sum, stacked on a leading axis split like K, summed
    # by XLA (the forward all-reduce; its transpose is a broadcast, so the backward pass
    # needs no communication for dY, as in Megatron).
    partials = shard(lambda x, w: whole(x, w)[None], P(k_axes, *lead, n_axes))(lhs, rhs)
    return partials.sum(0, dtype=partials.dtype)

  call.recipe = getattr(dot_general, "recipe", None)
  return call


@dataclasses.dataclass(frozen=True)
class MlpAxes:
  """Logical axes of a gated MLP y[..., D] = mlp(x[..., D], w_gate/w_up [D, F], w_down [F, D]).

  Attributes:
    x: one name per dim of x, e.g. ("batch", "length", "act_embed").
    hidden: the compute axes of w_gate's [D, F], e.g. ("act_embed", "act_mlp").
  """
  x: tuple[str | None, ...]
  hidden: tuple[str | None, str | None]


def _rows_spec(x, rows_spec):
  """in_specs entry of the MLP's or the q/k/v product's x: rows_spec, or for a NormedInput
  rows_spec for h and inv (each row's 1 / rms lives with its row) and gamma whole (D is
  never split here)."""
  if isinstance(x, NormedInput):
    return NormedInput(rows_spec, rows_spec, P(None), x.dtype)
  return rows_spec


def per_shard_mlp(mlp, axes: MlpAxes):
  """`mlp` (x, w_gate, w_up, w_down) run inside shard_map on each device's shard: tokens
  split like the batch, F like its compute axis (Megatron: gate/up column-parallel, down
  row-parallel, its partial outputs summed over the tensor axis). x may be a NormedInput
  (precision/normed.py): h and inv split like x's tokens, gamma whole on every device. One
  global call when there is no mesh of several devices, x is not laid out as `axes` says,
  D is split, or a split does not divide evenly."""
  def call(x, wg, wu, wd):
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1 or x.ndim != len(axes.x):
      return mlp(x, wg, wu, wd)
    *lead, d_axes = _mesh_axes(axes.x)
    dk_axes, f_axes = _mesh_axes(axes.hidden)
    if d_axes is not None or dk_axes is not None:
      return mlp(x, wg, wu, wd)
    x_spec, w_spec, wd_spec = P(*lead, None), P(None, f_axes), P(f_axes, None)
    dims = [*zip(x.shape, x_spec), *zip(wg.shape, w_spec), *zip(wd.shape, wd_spec)]
    if any(size % _ways(mesh, entry) for size, entry in dims):
      return mlp(x, wg, wu, wd)
    shard = lambda f, out_spec: jax.shard_map(
        f, mesh=mesh, in_specs=(_rows_spec(x, x_spec), w_spec, w_spec, wd_spec),
        out_specs=out_spec, check_vma=False)
    if f_axes is None:
      return shard(mlp, x_spec)(x, wg, wu, wd)
    partials = shard(lambda *a: mlp(*a)[None], P(f_axes, *lead, None))(x, wg, wu, wd)
    return partials.sum(0, dtype=partials.dtype)

  call.recipe = getattr(mlp, "recipe", None)
  call.accepts_normed = getattr(mlp, "accepts_normed", False)
  return call


@dataclasses.dataclass(frozen=True)
class QkvAxes:
  """Logical axes of the q/k/v product (q, k, v)[..., N*] = qkv(x[..., D], wq, wk, wv).

  Attributes:
    x: one name per dim of x, e.g. ("batch", "length", "act_embed").
    q: the compute axes of wq's [D, Nq], e.g. ("act_embed", "act_heads").
    kv: the compute axes of wk's and wv's [D, Nk], e.g. ("act_embed", "act_kv_heads").
  """
  x: tuple[str | None, ...]
  q: tuple[str | None, str | None]
  kv: tuple[str | None, str | None]


def per_shard_qkv(qkv, axes: QkvAxes):
  """`qkv` (x, wq, wk, wv, biases=None) run inside shard_map on each device's shard: tokens
  split like the batch, each weight's N (and its bias) like its compute axis
  (column-parallel: each device concatenates its own heads of q, k and v). x may be a
  NormedInput, split as per_shard_mlp splits one. One global call when there is no mesh of
  several devices, x is not laid out as `axes` says, D is split, or a split does not divide
  evenly."""
  def call(x, wq, wk, wv, biases=None):
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1 or x.ndim != len(axes.x):
      return qkv(x, wq, wk, wv, biases=biases)
    *lead, d_axes = _mesh_axes(axes.x)
    dq_axes, q_axes = _mesh_axes(axes.q)
    dk_axes, kv_axes = _mesh_axes(axes.kv)
    if any(a is not None for a in (d_axes, dq_axes, dk_axes)):
      return qkv(x, wq, wk, wv, biases=biases)
    x_spec, wq_spec, wkv_spec = P(*lead, None), P(None, q_axes), P(None, kv_axes)
    dims = [*zip(x.shape, x_spec), *zip(wq.shape, wq_spec), *zip(wk.shape, wkv_spec),
            *zip(wv.shape, wkv_spec)]
    if any(size % _ways(mesh, entry) for size, entry in dims):
      return qkv(x, wq, wk, wv, biases=biases)
    out_specs = (P(*lead, q_axes), P(*lead, kv_axes), P(*lead, kv_axes))
    in_specs = (_rows_spec(x, x_spec), wq_spec, wkv_spec, wkv_spec,
                *((P(q_axes), P(kv_axes), P(kv_axes)) if biases is not None else ()))
    return jax.shard_map(lambda x, wq, wk, wv, *b: qkv(x, wq, wk, wv, biases=b or None),
                         mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)(x, wq, wk, wv, *(biases or ()))

  call.recipe = getattr(qkv, "recipe", None)
  call.accepts_normed = getattr(qkv, "accepts_normed", False)
  return call
