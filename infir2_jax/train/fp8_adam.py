"""Adam's step over FP8 moments (train/moments.py's fp8 codec) in one pass per tensor.

The reference path (moments.scale_by_adam_stored, kernel="reference") decodes each moment to
the param's shape, runs optax's Adam there and encodes the new moments again: on the GPU XLA
runs the decode, the group statistics, the range expansion and the re-quantization as
separate passes. Here each tensor is viewed once as rows of groups, [N, 128] (N = its
groups; a, k as [N, 1]), and the whole step is one function of a block of rows
(`adam_rows`): decode q, a, k of both moments -> float32; Adam's moments and direction;
each group's max and min-nonzero; k; re-encode. It runs either as jnp on the whole
[N, 128] view (`kernel="jnp"`: one reshape, one reduction per group statistic, for XLA to
fuse) or as a Pallas kernel, one program per block of rows (`kernel="pallas"`: Triton on
the GPU, interpret=True elsewhere).

Both are the reference's float32 ops in the reference's order, element by element, so on
the CPU they are bit-identical to it (tests/test_optim_moments.py). The padding of a last
axis that is not a multiple of 128 (1-D biases and norms) is masked back to zero before
the encode, as the reference's slice-and-re-pad does. Weight decay, the learning rate and
the param update stay with optax after this transform (step.py applies the updates): with
kernel="jnp" XLA fuses them into the same loop; with "pallas" they are one elementwise
fusion after the kernel.

Legend: N groups of a tensor (rows), R rows per Pallas block, GROUP = 128 lanes.
"""

import functools
import math

import jax
import jax.numpy as jnp
import optax
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

from infir2_jax.precision import formats
from infir2_jax.train import moments

KERNELS = ("jnp", "pallas", "reference")   # valid values of opt.moments_kernel
BLOCK_ROWS = 32                            # Pallas: most rows (groups) per program


def new_moments(g_NxG, m_parts, v_parts, *, b1, b2):
  """Adam's new float32 moments from the stored ones (optax's update_moment functions)."""
  m = optax.tree.update_moment(g_NxG, moments.decode_groups(*m_parts), b1, 1)
  v = optax.tree.update_moment_per_elem_norm(g_NxG, moments.decode_groups(*v_parts), b2, 2)
  return m, v


def direction_of(m, v, bias_corrections, *, eps, eps_root):
  """Adam's direction; optax.tree.bias_correction's divisions, their scalars given."""
  bc1, bc2 = bias_corrections
  return (m / bc1) / (jnp.sqrt(v / bc2 + eps_root) + eps)


def _masked(x, valid_NxG):
  """The reference re-pads the new moments with zeros (an inf moment decodes its padding to
  NaN otherwise)."""
  return x if valid_NxG is None else jnp.where(valid_NxG, x, 0.0)


def adam_rows(g_NxG, m_parts, v_parts, bias_corrections, valid_NxG, *, b1, b2, eps,
              eps_root):
  """One Adam step on rows of groups: (direction [N, GROUP], new m parts, new v parts).

  m_parts / v_parts: (q [N, GROUP] e4m3, a [N, 1], k [N, 1]); bias_corrections: optax's
  1 - b**count for b1 and b2 (float32 scalars); valid_NxG: None, or where the lanes hold
  elements (not the padding of a short last axis). Any leading axes work as N.
  """
  m, v = new_moments(g_NxG, m_parts, v_parts, b1=b1, b2=b2)
  direction = direction_of(m, v, bias_corrections, eps=eps, eps_root=eps_root)
  return (direction, moments.encode_groups(_masked(m, valid_NxG)),
          moments.encode_groups(_masked(v, valid_NxG)))


def adam_rows_recomputed(g_NxG, m_parts, v_parts, bias_corrections, valid_NxG, *, b1, b2,
                         eps, eps_root):
  """adam_rows in the two passes XLA can fuse, without the float32 moments in memory
  (g_NxG in its own dtype, bf16 from the train step).

  XLA:GPU cannot broadcast a reduction's result back into the loop that made it, so the
  group ranges take a pass of their own. Left alone it writes the new float32 moments out
  of that pass (8 bytes a param) and reads them back to encode. Here the second pass
  recomputes them from the stored inputs instead (reading 1 byte a moment again), kept
  from being merged with the first by an optimization barrier on the inputs: the same ops
  on the same values, so the same bits.
  """
  f32 = lambda g: g.astype(jnp.float32)   # in both passes: no float32 copy of g either
  m, v = new_moments(f32(g_NxG), m_parts, v_parts, b1=b1, b2=b2)
  m_range = moments.flushed_range(_masked(m, valid_NxG))
  v_range = moments.flushed_range(_masked(v, valid_NxG))
  g_NxG, m_parts, v_parts = jax.lax.optimization_barrier((g_NxG, m_parts, v_parts))
  m, v = new_moments(f32(g_NxG), m_parts, v_parts, b1=b1, b2=b2)
  direction = direction_of(m, v, bias_corrections, eps=eps, eps_root=eps_root)
  encode = lambda x, rng: moments.encode_in_range(
      formats.flush_subnormals(_masked(x, valid_NxG)), *rng)
  return direction, encode(m, m_range), encode(v, v_range)


def bias_corrections(b1: float, b2: float, count_inc: jax.Array) -> jax.Array:
  """[1 - b1**count, 1 - b2**count] as optax.tree.bias_correction computes them."""
  return jnp.stack([(1 - b1**count_inc).astype(jnp.float32),
                    (1 - b2**count_inc).astype(jnp.float32)])


# --- the [N, GROUP] view of a tensor --------------------------------------------------------

def to_rows(x: jax.Array) -> jax.Array:
  """A param-shaped tensor -> [N, GROUP] (zero-padded last axis), one group per row."""
  return moments._grouped(x).reshape(-1, moments.GROUP)  # pylint: disable=protected-access


def from_rows(x_NxG: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  groups = moments.group_shape(shape) or (1,)
  return moments._ungrouped(x_NxG.reshape(*groups, moments.GROUP), shape)  # pylint: disable=protected-access


def valid_lanes(shape: tuple[int, ...], rows: jax.Array, lanes: jax.Array):
  """Where rows x lanes (row and lane indices, broadcastable) hold elements of a tensor of
  `shape`; None when its last axis is a multiple of GROUP (no padding)."""
  cols = shape[-1] if shape else 1
  groups = -(-cols // moments.GROUP)
  if groups * moments.GROUP == cols:
    return None
  return (rows % groups) * moments.GROUP + lanes < cols


# --- the two forms ---------------------------------------------------------------------------

def update_jnp(g, m_parts, v_parts, bcs, shape, **hyper):
  """adam_rows on a whole tensor grouped once as [..., G, GROUP] (its leading axes kept, so
  XLA shards it as it shards the param), for XLA to fuse."""
  g_grouped = moments._grouped(g)  # pylint: disable=protected-access  (float32 in the passes)
  stats = lambda x: x.reshape(*g_grouped.shape[:-1], 1)
  grouped = lambda parts: (moments._grouped(parts[0]), stats(parts[1]), stats(parts[2]))  # pylint: disable=protected-access
  groups = g_grouped.shape[-2]
  valid = valid_lanes(shape, jax.lax.broadcasted_iota(jnp.int32, (groups, 1), 0),
                      jax.lax.broadcasted_iota(jnp.int32, (1, moments.GROUP), 1))
  return adam_rows_recomputed(g_grouped, grouped(m_parts), grouped(v_parts),
                              (bcs[0], bcs[1]), valid, **hyper)


def block_rows(n: int, most: int = BLOCK_ROWS) -> int:
  """The largest power of two <= `most` that divides n: blocks tile the rows exactly."""
  return math.gcd(n, 1 << (most.bit_length() - 1))


def update_pallas(g_NxG, m_parts, v_parts, bcs, shape, *, most_rows=BLOCK_ROWS,
                  interpret=None, **hyper):
  """adam_rows as a Pallas kernel: one program per block of R rows (groups)."""
  n = g_NxG.shape[0]
  r = block_rows(n, most_rows)
  lanes_spec = pl.BlockSpec((r, moments.GROUP), lambda i: (i, 0))
  group_spec = pl.BlockSpec((r, 1), lambda i: (i, 0))
  scalar_spec = pl.BlockSpec((2,), lambda i: (0,))
  parts_specs = (lanes_spec, group_spec, group_spec)

  def kernel(g_ref, qm_ref, am_ref, km_ref, qv_ref, av_ref, kv_ref, bc_ref,
             d_out, qm_out, am_out, km_out, qv_out, av_out, kv_out):
    rows = pl.program_id(0) * r + jax.lax.broadcasted_iota(jnp.int32, (r, 1), 0)
    valid = valid_lanes(shape, rows, jax.lax.broadcasted_iota(jnp.int32, (1, moments.GROUP), 1))
    direction, new_m, new_v = adam_rows(
        g_ref[...].astype(jnp.float32), (qm_ref[...], am_ref[...], km_ref[...]),
        (qv_ref[...], av_ref[...], kv_ref[...]), (bc_ref[0], bc_ref[1]), valid, **hyper)
    d_out[...] = direction
    for ref, x in zip((qm_out, am_out, km_out, qv_out, av_out, kv_out), (*new_m, *new_v)):
      ref[...] = x

  parts_shapes = tuple(jax.ShapeDtypeStruct(p.shape, p.dtype) for p in m_parts)
  call = lambda interpret: pl.pallas_call(
      kernel, grid=(n // r,),
      in_specs=[lanes_spec, *parts_specs, *parts_specs, scalar_spec],
      out_specs=[lanes_spec, *parts_specs, *parts_specs],
      out_shape=[jax.ShapeDtypeStruct(g_NxG.shape, jnp.float32), *parts_shapes,
                 *parts_shapes],
      # The moments are rewritten in place (the train step donates the state).
      input_output_aliases={1: 1, 2: 2, 3: 3, 4: 4, 5: 5, 6: 6},
      interpret=interpret, name="fp8_adam")
  args = (g_NxG, *m_parts, *v_parts, bcs)
  if interpret is None:   # Triton where it is lowered for CUDA (also ahead of time, on a CPU)
    out = jax.lax.platform_dependent(*args, cuda=call(False), default=call(True))
  else:
    out = call(interpret)(*args)
  return out[0], tuple(out[1:4]), tuple(out[4:7])


def _per_shard(fn, n: int):
  """fn over rows split across every device of the current mesh (shard_map), so a kernel
  never makes XLA gather a sharded tensor; fn itself where there is no mesh of several
  devices or the rows do not split evenly. Rows are whole groups, so no group crosses a
  shard; the results are the same either way (each row is computed on its own)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1 or n % mesh.size:
    return fn
  rows = P(mesh.axis_names)
  specs = ((rows, (rows,) * 3, (rows,) * 3, P()))
  return jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=(rows, (rows,) * 3, (rows,) * 3),
                       check_vma=False)


def update_leaf(kernel: str, g, m_parts, v_parts, bcs, **hyper):
  """One param's step in param-shaped arrays: (direction, new m parts, new v parts)."""
  shape = jnp.shape(g)
  if kernel == "pallas":
    stats = lambda x: x.reshape(-1, 1)
    rows = lambda parts: (to_rows(parts[0]), stats(parts[1]), stats(parts[2]))
    g_rows = to_rows(g)
    fn = _per_shard(functools.partial(update_pallas, shape=shape, **hyper), g_rows.shape[0])
    direction, new_m, new_v = fn(g_rows, rows(m_parts), rows(v_parts), bcs)
  else:
    direction, new_m, new_v = update_jnp(g, m_parts, v_parts, bcs, shape, **hyper)
  group = moments.group_shape(shape)
  back = lambda parts: (from_rows(parts[0], shape), parts[1].reshape(group),
                        parts[2].reshape(group))
  return from_rows(direction, shape), back(new_m), back(new_v)
