"""Adam's step over FP8 moments (train/moments.py's fp8 codec) in one pass per tensor.

The reference path (moments.scale_by_adam_stored, kernel="reference") decodes each moment to
the param's shape, runs optax's Adam there and encodes the new moments again: on the GPU XLA
runs the decode, the group statistics, the range expansion and the re-quantization as
separate passes, with float32 moments in memory between them. Here each tensor is grouped
once ([..., G, 128]; a, k as [..., G, 1]) and the step is one function of a block of groups:
decode q, a, k of both moments -> float32; Adam's moments and direction; each group's max
and min-nonzero; k; re-encode. Two forms (opt.moments_kernel):

  jnp     `adam_rows_recomputed` on the whole tensor, for XLA to fuse. XLA:GPU cannot feed a
          reduction back into the loop that made it, so it is two fusions per tensor: the
          group ranges (reading g and q), then the encode with the direction, weight decay,
          learning rate and param update fused in (g, q and the param again): ~18 bytes a
          param with bf16 gradients, against optax's float32 AdamW's 26.
  pallas  `adam_rows` as a Pallas kernel over [N, 128] rows, one program per block of R
          rows (Triton on the GPU, interpret=True elsewhere): one pass for the moments and
          the direction; the param update is an XLA fusion after it, as optax applies
          updates outside the transform (step.py), ~22 bytes a param.

  auto    (the default) pallas where the step is lowered for CUDA, jnp elsewhere.

Both are the reference's float32 ops in the reference's order, element by element, so on
the CPU they are bit-identical to it (tests/test_fp8_adam.py). On the GPU the Triton kernel
computes the same formulas with the GPU's approximate log2, exp2, division and square root
(FAST_PTX): with libdevice's exactly rounded routines, which Pallas' Triton lowering calls
otherwise, the update is bound by instructions rather than memory (at 1.5B, session 20:
28.7 ms exact, 14.5 ms with FAST_PTX, optax's float32 AdamW 10.7); tests/test_fp8_adam_gpu.py
bounds the difference from the reference. A last axis that is not a multiple of 128 (1-D
biases and norms) is zero-padded to whole groups as the reference pads
it; the reference slices the padding off and pads again with zeros before it encodes, which
needs no mask here: a padded lane has q = 0 and g = 0, so it decodes to exactly 0 and stays
0 wherever its group's scale a is finite (where a is inf the group is NaN already).

Legend: N groups of a tensor (rows), R rows per Pallas block, GROUP = 128 lanes.
"""

import functools
import math

import jax
import jax.numpy as jnp
import optax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton
from jax.sharding import PartitionSpec as P

from infir2_jax.precision import formats
from infir2_jax.train import moments

KERNELS = ("auto", "jnp", "pallas", "reference")   # valid values of opt.moments_kernel
BLOCK_ROWS = 8     # Pallas: most rows (groups) per program (8: fastest of 8-64, session 20)


def new_moments(g_NxG, m_parts, v_parts, *, b1, b2, ops=moments.PRECISE):
  """Adam's new float32 moments from the stored ones (optax's update_moment functions)."""
  decode = lambda parts: moments.decode_groups(*parts, ops=ops)
  m = optax.tree.update_moment(g_NxG, decode(m_parts), b1, 1)
  v = optax.tree.update_moment_per_elem_norm(g_NxG, decode(v_parts), b2, 2)
  return m, v


def direction_of(m, v, bias_corrections, *, eps, eps_root, ops=moments.PRECISE):
  """Adam's direction; optax.tree.bias_correction's divisions, their scalars given."""
  bc1, bc2 = bias_corrections
  return ops.div(ops.div(m, bc1), ops.sqrt(ops.div(v, bc2) + eps_root) + eps)


def adam_rows(g_NxG, m_parts, v_parts, bias_corrections, *, b1, b2, eps, eps_root,
              ops=moments.PRECISE):
  """One Adam step on rows of groups: (direction [N, GROUP], new m parts, new v parts).

  m_parts / v_parts: (q [N, GROUP] e4m3, a [N, 1], k [N, 1]); bias_corrections: optax's
  1 - b**count for b1 and b2 (float32 scalars). Any leading axes work as N. `ops`: the
  float32 functions (moments.MathOps), the reference's unless the Triton kernel's FAST_PTX.
  """
  m, v = new_moments(g_NxG, m_parts, v_parts, b1=b1, b2=b2, ops=ops)
  direction = direction_of(m, v, bias_corrections, eps=eps, eps_root=eps_root, ops=ops)
  return direction, moments.encode_groups(m, ops), moments.encode_groups(v, ops)


def _ptx(instruction: str, *args: jax.Array) -> jax.Array:
  """One float32 PTX instruction applied elementwise inside a Triton kernel (args broadcast
  to one shape, as the inline assembly needs)."""
  args = jnp.broadcast_arrays(*(jnp.asarray(a, jnp.float32) for a in args))
  operands = ", ".join(f"${i + 1}" for i in range(len(args)))
  [out] = pl_triton.elementwise_inline_asm(
      f"{instruction} $0, {operands};", args=list(args),
      constraints=",".join(["=r"] + ["r"] * len(args)), pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(args[0].shape, jnp.float32)])
  return out


def _at_least_rank(y: jax.Array, rank: int) -> jax.Array:
  """A scalar as [1, ...] of `rank` axes (Triton's lowering broadcasts no rank-0 tensor)."""
  return jnp.reshape(y, (1,) * rank) if jnp.ndim(y) == 0 else y


# The GPU's approximate float32 instructions (PTX ISA: lg2/ex2 .approx, ~2 ulp, subnormals
# kept; rcp.approx, 1 ulp, subnormal results kept; sqrt.approx, ~1 ulp) in place of
# libdevice's exactly rounded routines, which Pallas' Triton lowering calls for
# jnp.log2/exp2/sqrt: the update is 4 log2, 4 exp2, 7 divisions and a square root per
# element, and with the exact forms it is bound by instructions, not memory
# (benchmarks/moments_update.py). A division is a multiplication by the divisor's
# reciprocal, taken at the divisor's own shape: once per group for the scale and exponent
# (a, k), once per program for the bias corrections, once per element for the direction.
FAST_PTX = moments.MathOps(
    log2=lambda x: _ptx("lg2.approx.f32", x),
    exp2=lambda x: _ptx("ex2.approx.f32", x),
    div=lambda x, y: x * _ptx("rcp.approx.f32", _at_least_rank(y, jnp.ndim(x))),
    sqrt=lambda x: _ptx("sqrt.approx.f32", x))
FAST_MATH = True   # Triton kernel: FAST_PTX (read when traced; the benchmark flips it)
NUM_WARPS = 4      # Triton kernel: warps per program (read when traced; the benchmark sweeps)


def adam_rows_recomputed(g_NxG, m_parts, v_parts, bias_corrections, *, b1, b2, eps,
                         eps_root):
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
  m_range, v_range = moments.flushed_range(m), moments.flushed_range(v)
  g_NxG, m_parts, v_parts = jax.lax.optimization_barrier((g_NxG, m_parts, v_parts))
  m, v = new_moments(f32(g_NxG), m_parts, v_parts, b1=b1, b2=b2)
  direction = direction_of(m, v, bias_corrections, eps=eps, eps_root=eps_root)
  encode = lambda x, rng: moments.encode_in_range(formats.flush_subnormals(x), *rng)
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
  """The inverse of to_rows (also of the [..., G, GROUP] grouping): padding sliced off."""
  groups = moments.group_shape(shape) or (1,)
  ungroup = moments._ungrouped  # pylint: disable=protected-access
  return ungroup(x_NxG.reshape(*groups, moments.GROUP), shape)


# --- the two forms ---------------------------------------------------------------------------

def update_jnp(g, m_parts, v_parts, bcs, **hyper):
  """adam_rows on a whole tensor grouped once as [..., G, GROUP] (its leading axes kept, so
  XLA shards it as it shards the param), for XLA to fuse."""
  g_grouped = moments._grouped(g)  # pylint: disable=protected-access  (float32 in the passes)
  stats = lambda x: x.reshape(*g_grouped.shape[:-1], 1)
  grouped = lambda parts: (moments._grouped(parts[0]),  # pylint: disable=protected-access
                           stats(parts[1]), stats(parts[2]))
  return adam_rows_recomputed(g_grouped, grouped(m_parts), grouped(v_parts),
                              (bcs[0], bcs[1]), **hyper)


def block_rows(n: int, most: int = BLOCK_ROWS) -> int:
  """The largest power of two <= `most` that divides n: blocks tile the rows exactly."""
  return math.gcd(n, 1 << (most.bit_length() - 1))


def update_pallas(g_NxG, m_parts, v_parts, bcs, *, most_rows=None, interpret=None, **hyper):
  """adam_rows as a Pallas kernel: one program per block of R rows (groups); most_rows
  defaults to BLOCK_ROWS as it is when traced (benchmarks/moments_update.py sweeps it)."""
  r = block_rows(g_NxG.shape[0], most_rows or BLOCK_ROWS)
  args = (g_NxG, *m_parts, *v_parts, bcs)
  if interpret is None:   # Triton where it is lowered for CUDA (also ahead of time, on a CPU)
    out = jax.lax.platform_dependent(
        *args, cuda=_jitted_triton_kernel(r, tuple(sorted(hyper.items())), FAST_MATH,
                                          NUM_WARPS),
        default=functools.partial(_kernel_call, r, True, hyper))
  else:
    out = _kernel_call(r, interpret, hyper, *args)
  return out[0], tuple(out[1:4]), tuple(out[4:7])


@functools.lru_cache(maxsize=None)
def _jitted_triton_kernel(r: int, hyper: tuple, fast_math: bool, num_warps: int):
  """_kernel_call as one jitted function: params of one shape (the same projection of every
  unrolled layer) share its jaxpr, so a step lowers the Triton kernel once per shape, not
  once per param (338 params at 1.5B unrolled). Only the CUDA branch: on the CPU the
  interpreted kernel stays inlined (a nested jit there moves the direction by an ulp)."""
  return jax.jit(functools.partial(_kernel_call, r, False, dict(hyper), fast_math=fast_math,
                                   num_warps=num_warps))


def _kernel_call(r: int, interpret: bool, hyper: dict, g_NxG, qm, am, km, qv, av, kv, bcs,
                 fast_math: bool = False, num_warps: int | None = None):
  n = g_NxG.shape[0]
  lanes_spec = pl.BlockSpec((r, moments.GROUP), lambda i: (i, 0))
  group_spec = pl.BlockSpec((r, 1), lambda i: (i, 0))
  scalar_spec = pl.BlockSpec((2,), lambda i: (0,))
  parts_specs = (lanes_spec, group_spec, group_spec)

  ops = FAST_PTX if fast_math else moments.PRECISE

  def kernel(g_ref, qm_ref, am_ref, km_ref, qv_ref, av_ref, kv_ref, bc_ref,
             d_out, qm_out, am_out, km_out, qv_out, av_out, kv_out):
    direction, new_m, new_v = adam_rows(
        g_ref[...].astype(jnp.float32), (qm_ref[...], am_ref[...], km_ref[...]),
        (qv_ref[...], av_ref[...], kv_ref[...]), (bc_ref[0], bc_ref[1]), ops=ops, **hyper)
    d_out[...] = direction
    for ref, x in zip((qm_out, am_out, km_out, qv_out, av_out, kv_out), (*new_m, *new_v)):
      ref[...] = x

  parts_shapes = tuple(jax.ShapeDtypeStruct(p.shape, p.dtype) for p in (qm, am, km))
  return pl.pallas_call(
      kernel, grid=(n // r,),
      in_specs=[lanes_spec, *parts_specs, *parts_specs, scalar_spec],
      out_specs=[lanes_spec, *parts_specs, *parts_specs],
      out_shape=[jax.ShapeDtypeStruct(g_NxG.shape, jnp.float32), *parts_shapes,
                 *parts_shapes],
      # The moments are rewritten in place (the train step donates the state).
      input_output_aliases={1: 1, 2: 2, 3: 3, 4: 4, 5: 5, 6: 6},
      compiler_params=None if interpret else pl_triton.CompilerParams(num_warps=num_warps),
      interpret=interpret, name="fp8_adam")(g_NxG, qm, am, km, qv, av, kv, bcs)


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
  return jax.shard_map(fn, mesh=mesh, in_specs=specs,
                       out_specs=(rows, (rows,) * 3, (rows,) * 3), check_vma=False)


def update_leaf(kernel: str, g, m_parts, v_parts, bcs, **hyper):
  """One param's step in param-shaped arrays: (direction, new m parts, new v parts)."""
  if kernel == "auto":   # the Triton kernel where the step is lowered for CUDA, jnp elsewhere
    return jax.lax.platform_dependent(
        g, m_parts, v_parts, bcs, cuda=functools.partial(update_leaf, "pallas", **hyper),
        default=functools.partial(update_leaf, "jnp", **hyper))
  shape = jnp.shape(g)
  if kernel == "pallas":
    stats = lambda x: x.reshape(-1, 1)
    rows = lambda parts: (to_rows(parts[0]), stats(parts[1]), stats(parts[2]))
    g_rows = to_rows(g)
    fn = _per_shard(functools.partial(update_pallas, **hyper), g_rows.shape[0])
    direction, new_m, new_v = fn(g_rows, rows(m_parts), rows(v_parts), bcs)
  else:
    direction, new_m, new_v = update_jnp(g, m_parts, v_parts, bcs, **hyper)
  group = moments.group_shape(shape)
  back = lambda parts: (from_rows(parts[0], shape), parts[1].reshape(group),
                        parts[2].reshape(group))
  return from_rows(direction, shape), back(new_m), back(new_v)


def scale_by_adam_fp8(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                      eps_root: float = 0.0, kernel: str = "jnp"
                      ) -> optax.GradientTransformation:
  """moments.scale_by_adam_stored(moments="fp8") with each tensor's step in one pass
  (kernel "jnp", "pallas" or "auto": pallas on the GPU, jnp elsewhere; "reference" is
  scale_by_adam_stored itself): the same state tree (a checkpoint of any restores in the
  others) and, on the CPU, the same numbers."""
  if kernel not in KERNELS:
    raise ValueError(f"opt.moments_kernel={kernel!r}; valid: {list(KERNELS)}")
  if kernel == "reference":
    return moments.scale_by_adam_stored(b1, b2, eps, eps_root, moments="fp8")
  init_fn = moments.init_of(moments.get_codec("fp8"))

  def update_fn(updates, state, params=None):
    del params
    count_inc = optax.safe_increment(state.count)
    bcs = bias_corrections(b1, b2, count_inc)
    leaves, treedef = jax.tree.flatten(updates)
    mu = [jax.tree.leaves(part) for part in state.mu]
    nu = [jax.tree.leaves(part) for part in state.nu]
    out = [update_leaf(kernel, g, tuple(p[i] for p in mu),
                                tuple(p[i] for p in nu), bcs, b1=b1, b2=b2, eps=eps,
                                eps_root=eps_root)
           for i, g in enumerate(leaves)]
    parts = lambda which: tuple(treedef.unflatten([o[which][j] for o in out])
                                for j in range(3))
    return (treedef.unflatten([o[0] for o in out]),
            moments.StoredAdamState(count_inc, parts(1), parts(2)))

  return optax.GradientTransformation(init_fn, update_fn)
