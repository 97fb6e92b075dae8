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

The fused step (apply_adamw; optim.make_apply picks it for kernel pallas / auto, and
train/step.py runs it): one kernel per param reads the raw gradient sum (bf16 from the
backward, float32 when micro-batches were summed), the float32 param and the moment parts,
and writes the new param and moments in place (input_output_aliases; the step donates its
state). Its scalars (Scalars): the bias corrections, the loss tokens, the global norm (one
reduction over the sums, fused by XLA, also the step's grad_norm) and the signed lr. In the
kernel: step.py's division, optax.clip_by_global_norm's select, Adam, add_decayed_weights
(decay-masked params), scale_by_learning_rate and apply_updates, in optax's order; the state
stays the optax chain's tree. On the CPU it equals the chain to float32 rounding, bit for bit
where XLA compiles the divisions by scalars alike (true_div; tests/test_fp8_adam.py).

Legend: N groups of a tensor (rows), R rows per Pallas block, GROUP = 128 lanes.
"""

import functools
import math
from typing import NamedTuple

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


def _as_f32(g: jax.Array) -> jax.Array:
  return g.astype(jnp.float32)


def adam_rows_recomputed(g_NxG, m_parts, v_parts, bias_corrections, *, b1, b2, eps,
                         eps_root, gradient=_as_f32):
  """adam_rows in the two passes XLA can fuse, without the float32 moments in memory
  (g_NxG in its own dtype, bf16 from the train step).

  XLA:GPU cannot broadcast a reduction's result back into the loop that made it, so the
  group ranges take a pass of their own. Left alone it writes the new float32 moments out
  of that pass (8 bytes a param) and reads them back to encode. Here the second pass
  recomputes them from the stored inputs instead (reading 1 byte a moment again), kept
  from being merged with the first by an optimization barrier on the inputs: the same ops
  on the same values, so the same bits. `gradient` makes the float32 gradient from g_NxG in
  both passes (no float32 copy of g either): a cast, or the fused step's gradient_of.
  """
  m, v = new_moments(gradient(g_NxG), m_parts, v_parts, b1=b1, b2=b2)
  m_range, v_range = moments.flushed_range(m), moments.flushed_range(v)
  g_NxG, m_parts, v_parts = jax.lax.optimization_barrier((g_NxG, m_parts, v_parts))
  m, v = new_moments(gradient(g_NxG), m_parts, v_parts, b1=b1, b2=b2)
  direction = direction_of(m, v, bias_corrections, eps=eps, eps_root=eps_root)
  encode = lambda x, rng: moments.encode_in_range(formats.flush_subnormals(x), *rng)
  return direction, encode(m, m_range), encode(v, v_range)


def bias_corrections(b1: float, b2: float, count_inc: jax.Array) -> jax.Array:
  """[1 - b1**count, 1 - b2**count] as optax.tree.bias_correction computes them."""
  return jnp.stack([(1 - b1**count_inc).astype(jnp.float32),
                    (1 - b2**count_inc).astype(jnp.float32)])


# --- the fused step: raw gradient sums in, new params and moments out ------------------------

class Scalars(NamedTuple):
  """The fused step's float32 scalars, one set for every param (a vector of SCALARS in the
  kernel: Triton's blocks are powers of two)."""
  bc1: jax.Array        # 1 - b1**count (optax.tree.bias_correction)
  bc2: jax.Array        # 1 - b2**count
  denom: jax.Array      # the step's loss tokens, max(num_tokens, 1) (train/step.py)
  g_norm: jax.Array     # the global norm of the gradients sum / denom
  lr: jax.Array         # the signed step size, -schedule(count) (optax.scale_by_learning_rate)


SCALARS = 8   # Scalars' 5, zero-padded to a power of two


def true_div(x: jax.Array, y: jax.Array) -> jax.Array:
  """x / y for a scalar y, kept a division: XLA:CPU turns x / broadcast(y) into x * (1 / y)
  in some programs (the interpreted kernel's loop) and not in others (the chain's division
  of the gradients in tests/test_fp8_adam.py), an ulp apart."""
  return x / jax.lax.optimization_barrier(jnp.broadcast_to(y, jnp.shape(x)))


def gradient_of(g_sum, denom, g_norm, *, max_norm: float, div=jnp.divide):
  """The gradient the chain's Adam sees, from the raw sum: train/step.py's float32 cast and
  division by the loss tokens, then optax.clip_by_global_norm (max_norm > 0; its ops in its
  order: keep t where g_norm < max_norm, else (t / g_norm) * max_norm). `div`: jnp's (the
  jnp form), true_div (the interpreted kernel) or the Triton kernel's ops.div (FAST_PTX: a
  reciprocal per program, a product per element)."""
  g = div(g_sum.astype(jnp.float32), denom)
  if not max_norm:
    return g
  return jnp.where(g_norm < max_norm, g, div(g, g_norm) * max_norm)


def applied(p, direction, lr, *, weight_decay: float):
  """The new param from Adam's direction: optax.add_decayed_weights (weight_decay 0 where
  the decay mask leaves the param out, as optax skips it), scale_by_learning_rate (lr
  signed) and apply_updates, in their order and dtypes."""
  u = direction + weight_decay * p if weight_decay else direction
  return (p + jnp.asarray(lr, u.dtype) * u).astype(p.dtype)


def adamw_rows(g_sum, p, m_parts, v_parts, scalars: Scalars, *, b1, b2, eps, eps_root,
               max_norm, weight_decay, ops=moments.PRECISE, div=jnp.divide):
  """adam_rows from the raw gradient sum to the new param: (new p, new m parts, new v)."""
  g = gradient_of(g_sum, scalars.denom, scalars.g_norm, max_norm=max_norm, div=div)
  direction, new_m, new_v = adam_rows(g, m_parts, v_parts, (scalars.bc1, scalars.bc2), b1=b1,
                                      b2=b2, eps=eps, eps_root=eps_root, ops=ops)
  return applied(p, direction, scalars.lr, weight_decay=weight_decay), new_m, new_v


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
  out = _rows_kernel(False, (g_NxG,), m_parts, v_parts, bcs, most_rows, interpret, hyper)
  return out[0], tuple(out[1:4]), tuple(out[4:7])


def _rows_kernel(fused: bool, lanes, m_parts, v_parts, scalars, most_rows, interpret, hyper):
  """The Pallas kernel over rows (fused: adamw_rows, else adam_rows): Triton where the step
  is lowered for CUDA (also ahead of time, on a CPU), interpreted elsewhere."""
  r = block_rows(lanes[0].shape[0], most_rows or BLOCK_ROWS)
  args = (*lanes, *m_parts, *v_parts, scalars)
  if interpret is None:
    return jax.lax.platform_dependent(
        *args, cuda=_jitted_triton_kernel(fused, r, tuple(sorted(hyper.items())), FAST_MATH,
                                          NUM_WARPS),
        default=functools.partial(_kernel_call, fused, r, True, hyper))
  return _kernel_call(fused, r, interpret, hyper, *args)


@functools.lru_cache(maxsize=None)
def _jitted_triton_kernel(fused: bool, r: int, hyper: tuple, fast_math: bool, num_warps: int):
  """_kernel_call as one jitted function: params of one shape (the same projection of every
  unrolled layer) share its jaxpr, so a step lowers the Triton kernel once per shape, not
  once per param (338 params at 1.5B unrolled). Only the CUDA branch: on the CPU the
  interpreted kernel stays inlined (a nested jit there moves the direction by an ulp)."""
  return jax.jit(functools.partial(_kernel_call, fused, r, False, dict(hyper),
                                   fast_math=fast_math, num_warps=num_warps))


def _adam_block(lanes, m_parts, v_parts, s_ref, ops, **hyper):
  """A block of scale_by_adam_fp8's step: (direction, new m parts, new v parts)."""
  (g,) = lanes
  return adam_rows(g.astype(jnp.float32), m_parts, v_parts, (s_ref[0], s_ref[1]), ops=ops,
                   **hyper)


def _adamw_block(lanes, m_parts, v_parts, s_ref, ops, interpret, **hyper):
  """A block of the fused step: (new param, new m parts, new v parts). Interpreted, the
  scalar divisions are true_div's (an XLA op Triton does not lower); in Triton, ops.div."""
  g_sum, p = lanes
  return adamw_rows(g_sum, p, m_parts, v_parts, Scalars(*(s_ref[i] for i in range(5))),
                    ops=ops, div=true_div if interpret else ops.div, **hyper)


def _kernel_call(fused: bool, r: int, interpret: bool, hyper: dict, *args,
                 fast_math: bool = False, num_warps: int | None = None):
  """args: the lanes ([N, GROUP]: g, or g and the param when fused), the 3 + 3 moment parts,
  the scalars. Out: the direction (or the new param), the new moment parts, written over
  the stored ones (and over the param when fused): the train step donates its state."""
  *lanes, qm, am, km, qv, av, kv, scalars = args
  n, n_in = lanes[0].shape[0], len(args)
  lanes_spec = pl.BlockSpec((r, moments.GROUP), lambda i: (i, 0))
  group_spec = pl.BlockSpec((r, 1), lambda i: (i, 0))
  scalar_spec = pl.BlockSpec(scalars.shape, lambda i: (0,))
  parts_specs = (lanes_spec, group_spec, group_spec)
  ops = FAST_PTX if fast_math else moments.PRECISE
  block = (functools.partial(_adamw_block, ops=ops, interpret=interpret, **hyper) if fused
           else functools.partial(_adam_block, ops=ops, **hyper))

  def kernel(*refs):
    ins, outs = refs[:n_in], refs[n_in:]
    load = lambda refs: tuple(ref[...] for ref in refs)
    lane_out, new_m, new_v = block(load(ins[:len(lanes)]), load(ins[-7:-4]), load(ins[-4:-1]),
                                   ins[-1])
    for ref, x in zip(outs, (lane_out, *new_m, *new_v)):
      ref[...] = x

  lane_out = lanes[-1] if fused else jax.ShapeDtypeStruct(lanes[0].shape, jnp.float32)
  parts_shapes = tuple(jax.ShapeDtypeStruct(p.shape, p.dtype) for p in (qm, am, km))
  aliases = {len(lanes) + j: 1 + j for j in range(6)}   # the moments, in place
  if fused:
    aliases[len(lanes) - 1] = 0                           # the param, in place
  return pl.pallas_call(
      kernel, grid=(n // r,),
      in_specs=[lanes_spec] * len(lanes) + [*parts_specs, *parts_specs, scalar_spec],
      out_specs=[lanes_spec, *parts_specs, *parts_specs],
      out_shape=[jax.ShapeDtypeStruct(lane_out.shape, lane_out.dtype), *parts_shapes,
                 *parts_shapes],
      input_output_aliases=aliases,
      compiler_params=None if interpret else pl_triton.CompilerParams(num_warps=num_warps),
      interpret=interpret, name="fp8_adamw" if fused else "fp8_adam")(*args)


def _per_shard(fn, n: int, in_rows, out_rows):
  """fn over rows split across every device of the current mesh (shard_map), so a kernel
  never makes XLA gather a sharded tensor; fn itself where there is no mesh of several
  devices or the rows do not split evenly. Rows are whole groups, so no group crosses a
  shard; the results are the same either way (each row is computed on its own).
  in_rows / out_rows: fn's arguments and results as trees of bools, True for [N, ...]
  arrays split by rows, False for what every device gets whole (the scalars)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1 or n % mesh.size:
    return fn
  spec = lambda split: P(mesh.axis_names) if split else P()
  return jax.shard_map(fn, mesh=mesh, in_specs=jax.tree.map(spec, in_rows),
                       out_specs=jax.tree.map(spec, out_rows), check_vma=False)


_PARTS_ROWS = ((True,) * 3, (True,) * 3)   # the m and v parts, split by rows


def _parts_as_rows(parts):
  """Moment parts (q param-shaped, a and k group-shaped) -> ([N, GROUP], [N, 1], [N, 1])."""
  return to_rows(parts[0]), parts[1].reshape(-1, 1), parts[2].reshape(-1, 1)


def _parts_from_rows(parts, shape):
  """The inverse of _parts_as_rows (also of the [..., G, GROUP] grouping of update_jnp)."""
  group = moments.group_shape(shape)
  return from_rows(parts[0], shape), parts[1].reshape(group), parts[2].reshape(group)


def update_leaf(kernel: str, g, m_parts, v_parts, bcs, **hyper):
  """One param's step in param-shaped arrays: (direction, new m parts, new v parts)."""
  if kernel == "auto":   # the Triton kernel where the step is lowered for CUDA, jnp elsewhere
    return jax.lax.platform_dependent(
        g, m_parts, v_parts, bcs, cuda=functools.partial(update_leaf, "pallas", **hyper),
        default=functools.partial(update_leaf, "jnp", **hyper))
  shape = jnp.shape(g)
  if kernel == "pallas":
    g_rows = to_rows(g)
    fn = _per_shard(functools.partial(update_pallas, **hyper), g_rows.shape[0],
                    (True, *_PARTS_ROWS, False), (True, *_PARTS_ROWS))
    direction, new_m, new_v = fn(g_rows, _parts_as_rows(m_parts), _parts_as_rows(v_parts), bcs)
  else:
    direction, new_m, new_v = update_jnp(g, m_parts, v_parts, bcs, **hyper)
  return (from_rows(direction, shape), _parts_from_rows(new_m, shape),
          _parts_from_rows(new_v, shape))


def apply_leaf(kernel: str, g_sum, p, m_parts, v_parts, scalars, *, max_norm, weight_decay,
               **hyper):
  """One param's fused step in param-shaped arrays: (new param, new m parts, new v parts).
  scalars: Scalars stacked and padded to SCALARS."""
  hyper.update(max_norm=max_norm, weight_decay=weight_decay)
  if kernel == "auto":   # the Triton kernel where the step is lowered for CUDA, jnp elsewhere
    return jax.lax.platform_dependent(
        g_sum, p, m_parts, v_parts, scalars,
        cuda=functools.partial(apply_leaf, "pallas", **hyper),
        default=functools.partial(apply_leaf, "jnp", **hyper))
  shape = jnp.shape(p)
  if kernel == "pallas":
    g_rows = to_rows(g_sum)
    fn = _per_shard(functools.partial(apply_pallas, **hyper), g_rows.shape[0],
                    (True, True, *_PARTS_ROWS, False), (True, *_PARTS_ROWS))
    new_p, new_m, new_v = fn(g_rows, to_rows(p), _parts_as_rows(m_parts),
                             _parts_as_rows(v_parts), scalars)
    return (from_rows(new_p, shape), _parts_from_rows(new_m, shape),
            _parts_from_rows(new_v, shape))
  return apply_jnp(g_sum, p, m_parts, v_parts, Scalars(*scalars[:5]), **hyper)


def apply_pallas(g_NxG, p_NxG, m_parts, v_parts, scalars, *, most_rows=None, interpret=None,
                 **hyper):
  """adamw_rows as a Pallas kernel over [N, GROUP] rows (g the raw sum, p the param)."""
  out = _rows_kernel(True, (g_NxG, p_NxG), m_parts, v_parts, scalars, most_rows, interpret,
                     hyper)
  return out[0], tuple(out[1:4]), tuple(out[4:7])


def apply_jnp(g_sum, p, m_parts, v_parts, scalars: Scalars, *, max_norm, weight_decay,
              **hyper):
  """The fused step for XLA to fuse: update_jnp with the gradient made from the raw sum in
  both of its passes, and the param update after it (fused into the encoding pass)."""
  gradient = functools.partial(gradient_of, denom=scalars.denom, g_norm=scalars.g_norm,
                               max_norm=max_norm)
  shape = jnp.shape(p)
  direction, new_m, new_v = update_jnp(g_sum, m_parts, v_parts, (scalars.bc1, scalars.bc2),
                                       gradient=gradient, **hyper)
  new_p = applied(p, from_rows(direction, shape), scalars.lr, weight_decay=weight_decay)
  return new_p, _parts_from_rows(new_m, shape), _parts_from_rows(new_v, shape)


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


def apply_adamw(kernel: str, grad_sums, params, state: moments.StoredAdamState, *, denom,
                g_norm, lr, max_norm: float, weight_decay: float, decay_mask, b1: float,
                b2: float, eps: float, eps_root: float = 0.0):
  """The whole AdamW step of opt.moments=fp8 in one pass per param (kernel "pallas", "auto"
  or "jnp"): (new params, scale_by_adam_fp8's new state).

  grad_sums: the backward's raw sums (bf16, or float32 accumulated over micro-batches);
  denom, g_norm (the global norm of grad_sums / denom), lr (signed, -schedule(count)):
  float32 scalars; max_norm: the clip's (0: none); weight_decay applied where decay_mask
  (a tree of bools like params) says. The numbers are those of train/step.py's division,
  clip_by_global_norm, scale_by_adam_fp8, add_decayed_weights, scale_by_learning_rate and
  apply_updates in a chain, without the float32 gradients or the direction in memory.
  """
  if kernel not in ("auto", "jnp", "pallas"):
    raise ValueError(f"the fused fp8 step runs kernel 'auto', 'jnp' or 'pallas', not {kernel!r}")
  count_inc = optax.safe_increment(state.count)
  bc1, bc2 = bias_corrections(b1, b2, count_inc)
  scalars = jnp.stack([bc1, bc2, *(jnp.asarray(x, jnp.float32) for x in (denom, g_norm, lr))])
  scalars = jnp.pad(scalars, (0, SCALARS - scalars.shape[0]))
  leaves, treedef = jax.tree.flatten(params)
  sums, masks = treedef.flatten_up_to(grad_sums), treedef.flatten_up_to(decay_mask)
  mu = [treedef.flatten_up_to(part) for part in state.mu]
  nu = [treedef.flatten_up_to(part) for part in state.nu]
  out = [apply_leaf(kernel, g, p, tuple(part[i] for part in mu), tuple(part[i] for part in nu),
                    scalars, max_norm=max_norm, weight_decay=weight_decay if masks[i] else 0.0,
                    b1=b1, b2=b2, eps=eps, eps_root=eps_root)
         for i, (g, p) in enumerate(zip(sums, leaves))]
  parts = lambda which: tuple(treedef.unflatten([o[which][j] for o in out]) for j in range(3))
  return (treedef.unflatten([o[0] for o in out]),
          moments.StoredAdamState(count_inc, parts(1), parts(2)))
