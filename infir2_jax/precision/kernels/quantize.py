"""Fused FP8 quantization for Hopper (Pallas Mosaic GPU), with pure-jnp references.

Semantics: bit-identical to infir2_jax.precision.quantize (its docstring is the
authority; it refines the common contract); the shared rules (formats, floor, flush, abs_bits,
scale_from_amax) come from infir2_jax.precision.formats. Per tile, with floor = 2**-126:
  x     = f32(x); subnormal x (|x| < floor) become a signed zero
  amax  = max |x|, taken on the int32 bits (NaN propagates, above inf)
  s     = max(amax * RN32(1 / fmax), floor)          (a select: NaN stays)
  scale = s ("fp32") or 2**ceil(log2 s) from the exponent bits ("ue8m0")
  q     = fp8(clip(x * (1 / scale), -fmax, fmax))    (clip as selects, RNE cast)
For "ue8m0" this equals the contract's division form bit for bit; for "fp32" it
is the reciprocal form, which is what XLA runs for x / broadcast(s) anyway.

Shape legend: x [M, K]; 1x128 tiles along K give q [M, K], s [M, Kb]; the
token-axis tiles for wgrad are 1x128 tiles of x^T [K, M]: qT [K, M], sT [K, Mb];
128x128 blocks give q [M, K], s [Mb, Kb].

Kernel: one CTA per 128x128 block of x (one warpgroup, ~65 KB of shared memory,
so three CTAs share an SM and overlap their loads and stores). The block is read
once by TMA; rows are quantized from a normal register load of shared memory,
the token-axis tiles from a transposed load of the same buffer. Scales are
written K-block-major ([Kb, M], [Mb, K]), the layout the GEMM reads; the
returned [M, Kb] views are transposes that XLA cancels against the GEMM's.
"""
import functools
import os
from typing import NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from infir2_jax.precision import formats
from infir2_jax.precision.formats import abs_bits
from infir2_jax.precision.formats import scale_from_amax

TILE = 128
# How the kernels quantize a row once its scale is known (read when a kernel is traced):
#   "lean": on the GPU the clip is left to the saturating fp8 cast (quantize_values) and the
#           subnormal flush runs only for rows where it can change a code (flush_free_inv);
#           interpreted, the clip stays (XLA's convert does not saturate);
#   "full": the clip and the flush on every element, as the kernels did before session 27.
# Both give the reference's bits; benchmarks/quantize_backends.py times them side by side,
# benchmarks/train_step.py in the step ($INFIR2_KERNEL_QUANTIZE sets the default).
KERNEL_QUANTIZE = os.environ.get("INFIR2_KERNEL_QUANTIZE", "lean")


class RowQuantize(NamedTuple):
  """What a kernel's quantization of a row does besides the product and the cast."""
  clip: bool                 # clip to +-fmax before the cast
  flush_every_element: bool  # flush subnormals in every row (else only where it matters)


def _check_formats(fmt: str, scale_format: str):
  formats.get_format(fmt)
  formats.check_scale_format(scale_format)


def quantize_values(x32, inv, fmt: str, clip: bool = True, flush: bool = True):
  """fp8(clip(flush(x) * inv)); inv already broadcast to x's shape.

  clip=False leaves the clip to the cast: for the Mosaic GPU kernels, whose float32 -> fp8
  conversion is Hopper's saturating one (cvt.rn.satfinite: beyond +-fmax, inf included,
  gives +-fmax; NaN stays NaN), which is the clip. It saves three instructions an element
  (benchmarks/NOTES_kernels.md, session 27). XLA's convert (the reference, the kernels'
  interpreter) does not saturate, so they clip. With inv from the tile's own amax
  (scale_from_amax), |x| * inv exceeds fmax by more than the cast's rounding only in tiles
  whose "ue8m0" scale is capped (amax > fmax * cap, ~2.98e38).
  flush=False leaves the subnormal flush out, for an inv <= flush_free_inv(fmt)."""
  f = formats.get_format(fmt)
  y = (formats.flush_subnormals(x32) if flush else x32) * inv
  if not clip:
    return y.astype(f.dtype)
  fmax = np.float32(f.max)
  y = jnp.where(y > fmax, fmax, jnp.where(y < -fmax, -fmax, y))  # selects: NaN passes
  return y.astype(f.dtype)


def _tiles_along_last(x, fmt, scale_format):
  """Reference 1x128 tiles along the last axis of a 2-D x: (q, s [M, Kb])."""
  m, k = x.shape
  kb = -(-k // TILE)
  xf = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, kb * TILE - k))).reshape(m, kb, TILE)
  amax = lax.bitcast_convert_type(jnp.max(abs_bits(xf), axis=-1), jnp.float32)
  s = scale_from_amax(amax, fmt, scale_format)
  q = quantize_values(xf, (1.0 / s)[..., None], fmt)
  return q.reshape(m, kb * TILE)[:, :k], s


def quantize_tiles_reference(x, *, fmt="e4m3", scale_format="ue8m0", with_transpose=False):
  """Pure-jnp 1x128 tile quantization: (q, s) or (q, s, qT, sT); see module doc."""
  _check_formats(fmt, scale_format)
  if with_transpose and x.ndim != 2:
    raise ValueError(f"x.shape={x.shape}: with_transpose needs a 2-D [tokens, K] array")
  lead, k = x.shape[:-1], x.shape[-1]
  q, s = _tiles_along_last(x.reshape(-1, k), fmt, scale_format)
  q, s = q.reshape(*lead, k), s.reshape(*lead, s.shape[-1])
  if not with_transpose:
    return q, s
  return (q, s, *_tiles_along_last(x.T, fmt, scale_format))


def rms_normed_reference(h, inv, gamma):
  """The pre-norm block's normed operand, as model.layers.RMSNorm computes it from its row
  statistics: y = gamma * bf16(f32(h) * inv), the product in bf16 (rounded once).

  h [..., K] (the residual stream), inv [..., 1] float32 (1 / rms of each row:
  rsqrt(mean(h**2) + eps)), gamma [K] (the norm's scale, cast to h's dtype first)."""
  return gamma.astype(h.dtype) * (h.astype(jnp.float32) * inv).astype(h.dtype)


def quantize_normed_tiles_reference(h, inv, gamma, *, fmt="e4m3", scale_format="ue8m0",
                                    with_transpose=False):
  """quantize_tiles_reference of rms_normed_reference(h, inv, gamma): what
  quantize_normed_tiles computes without writing the normed operand."""
  return quantize_tiles_reference(rms_normed_reference(h, inv, gamma), fmt=fmt,
                                  scale_format=scale_format, with_transpose=with_transpose)


def quantize_blocks_reference(w, *, fmt="e4m3", scale_format="ue8m0", with_transpose=False):
  """Pure-jnp 128x128 block quantization of a 2-D w: (q, s [Rb, Cb]) [, q of w^T]."""
  _check_formats(fmt, scale_format)
  if w.ndim != 2:
    raise ValueError(f"w.shape={w.shape}: 128x128 blocks need a 2-D array")
  r, c = w.shape
  rb, cb = -(-r // TILE), -(-c // TILE)
  wf = jnp.pad(w.astype(jnp.float32), ((0, rb * TILE - r), (0, cb * TILE - c)))
  wf = wf.reshape(rb, TILE, cb, TILE)
  amax = lax.bitcast_convert_type(jnp.max(abs_bits(wf), axis=(1, 3)), jnp.float32)
  s = scale_from_amax(amax, fmt, scale_format)
  q = quantize_values(wf, (1.0 / s)[:, None, :, None], fmt)
  q = q.reshape(rb * TILE, cb * TILE)[:r, :c]
  return (q, s, q.T) if with_transpose else (q, s)


HALF = TILE // 2  # Registers hold 64 x 128 f32 at a time (64 per thread).


def smem_transforms(dtype):
  """TMA-friendly tiling and 128-byte swizzle of a [128, 128] buffer of `dtype`."""
  import jax.experimental.pallas.mosaic_gpu as plgpu
  tile = (8, 128 // jnp.dtype(dtype).itemsize)
  return (plgpu.TilingTransform(tile), plgpu.SwizzleTransform(128))


def load_half(ref, h: int, transposed: bool):
  """Rows [64h, 64h + 64) of a [128, 128] shared-memory block (of its transpose) as f32."""
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu
  view = ref.T if transposed else ref
  x = plgpu.load(view.at[pl.ds(h * HALF, HALF)], layout=plgpu.Layout.WGMMA,
                 optimized=not transposed)
  return x.astype(jnp.float32)


def row_amax(x):
  """max |x| of each row of a WGMMA-layout [64, 128] f32 array (on the int32 bits)."""
  import jax.experimental.pallas.mosaic_gpu as plgpu
  amax_bits = plgpu.layout_cast(jnp.max(abs_bits(x), axis=1), plgpu.Layout.WGMMA.reduce(1))
  return lax.bitcast_convert_type(amax_bits, jnp.float32)


def quantize_half(x, s, fmt: str, clip: bool = True):
  """fp8 of the rows of x with their row scales s (one per row); clip=False on the GPU,
  where the cast saturates (quantize_values)."""
  inv = lax.broadcast_in_dim(1.0 / s, x.shape, (0,))
  return quantize_values(x, inv, fmt, clip=clip)


def flush_free_inv(fmt: str) -> float:
  """The largest 1 / scale for which flushing float32 subnormals before the product changes
  no fp8 code: |x| < 2**-126 and inv <= this make |x * inv| <= half the format's smallest
  subnormal, which the cast rounds to a zero of x's sign, as the flushed x's would be
  (2**116 for E4M3, 2**109 for E5M2)."""
  tiny = float(ml_dtypes.finfo(formats.get_format(fmt).dtype).smallest_subnormal)
  return tiny / 2 / float(formats.SCALE_FLOOR)


def rows_need_flush(inv_rows, fmt: str):
  """Whether any row's 1 / scale is above flush_free_inv(fmt): a scalar for the warpgroup.
  Compared row by row before the max, so a NaN row (whose codes are NaN anyway) cannot hide
  another row's need. (The CPU cannot test the flush itself: XLA:CPU treats subnormal
  inputs as zero, so the GPU checks it, benchmarks/quantize_backends.py.)"""
  over = jnp.where(inv_rows > np.float32(flush_free_inv(fmt)), 1.0, 0.0)
  return jnp.max(over) > 0.5


def quantize_half_into(dst, x, s, fmt: str, body: RowQuantize):
  """dst[...] = quantize_half(x, s). Unless body.flush_every_element, the subnormal flush
  runs only where some row's 1 / s is above flush_free_inv (a tile of amax below ~2**-107;
  one branch for the warpgroup), where it can change a code; elsewhere it is left out, two
  instructions an element fewer."""
  import jax.experimental.pallas as pl
  if body.flush_every_element:
    dst[...] = quantize_half(x, s, fmt, body.clip)
    return
  inv_rows = 1.0 / s
  inv = lax.broadcast_in_dim(inv_rows, x.shape, (0,))
  needs_flush = rows_need_flush(inv_rows, fmt)

  @pl.when(needs_flush)
  def _():
    dst[...] = quantize_values(x, inv, fmt, clip=body.clip)

  @pl.when(jnp.logical_not(needs_flush))
  def _():
    dst[...] = quantize_values(x, inv, fmt, clip=body.clip, flush=False)


def quantize_block_tiles(src_smem, q_smem, s_smem, *, transposed, fmt, scale_format,
                         body: RowQuantize):
  """The 1x128 tiles of a [128, 128] bf16 block (or of its transpose), shared memory to
  shared memory: q_smem [128, 128] fp8 and s_smem [1, 128] f32, one scale per row.
  body: row_quantize(interpret)."""
  import jax.experimental.pallas as pl
  for h in range(2):
    x = load_half(src_smem, h, transposed)
    s = scale_from_amax(row_amax(x), fmt, scale_format)
    quantize_half_into(q_smem.at[pl.ds(h * HALF, HALF)], x, s, fmt, body)
    s_smem[0, pl.ds(h * HALF, HALF)] = s


def normalize_block(x_smem, inv_smem, gamma_smem):
  """x_smem [128, 128] bf16 <- gamma * bf16(x * inv) in place (rms_normed_reference), with
  inv_smem [128] the block's rows' 1 / rms and gamma_smem [128] its columns' scales (both
  float32; gamma holds bf16 values). The products are exact in float32 before each bf16
  rounding as in XLA's, so the block holds the normed operand's bf16 bits; commit_smem
  (a fence and a warpgroup barrier) makes them visible to the transposed loads after."""
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu
  gamma = plgpu.load(gamma_smem, layout=plgpu.Layout.WGMMA.reduce(0))
  for h in range(2):
    x = load_half(x_smem, h, False)
    inv = plgpu.load(inv_smem.at[pl.ds(h * HALF, HALF)], layout=plgpu.Layout.WGMMA.reduce(1))
    u = (x * lax.broadcast_in_dim(inv, x.shape, (0,))).astype(x_smem.dtype)
    y = u.astype(jnp.float32) * lax.broadcast_in_dim(gamma, x.shape, (1,))
    x_smem[pl.ds(h * HALF, HALF)] = y.astype(x_smem.dtype)
  plgpu.commit_smem()


def _kernel_body(x_gmem, *refs, fmt, scale_format, blocks, with_transpose,
                 body: RowQuantize, normed: bool = False):
  """One CTA quantizes one 128x128 block of x [M, K] (edge blocks via TMA OOB); body:
  row_quantize(interpret). normed: x is the residual stream h, and the next two inputs are
  inv [M] and gamma [K] (float32): the block quantized is gamma * bf16(h * inv)."""
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu

  mi, ki = lax.axis_index("m"), lax.axis_index("k")
  rows, cols = pl.ds(mi * TILE, TILE), pl.ds(ki * TILE, TILE)
  dtype = formats.get_format(fmt).dtype
  if normed:
    inv_gmem, gamma_gmem, *refs = refs
  q_gmem, s_gmem, *t_outs = refs

  def scoped(x_smem, q_smem, qt_smem, s_smem, st_smem, bar, *norm_smem):
    plgpu.copy_gmem_to_smem(x_gmem.at[rows, cols], x_smem, bar)
    if normed:
      inv_smem, gamma_smem = norm_smem
      plgpu.copy_gmem_to_smem(inv_gmem.at[rows], inv_smem, bar)
      plgpu.copy_gmem_to_smem(gamma_gmem.at[cols], gamma_smem, bar)
    plgpu.barrier_wait(bar)
    if normed:
      normalize_block(x_smem, *norm_smem)
    if blocks:
      amax = jnp.maximum(row_amax(load_half(x_smem, 0, False)),
                         row_amax(load_half(x_smem, 1, False)))
      s_block = scale_from_amax(jnp.maximum(amax, jnp.max(amax)), fmt, scale_format)
      for transposed, dst in ((False, q_smem), (True, qt_smem)):
        if transposed and not with_transpose:
          continue
        for h in range(2):
          dst[pl.ds(h * HALF, HALF)] = quantize_half(load_half(x_smem, h, transposed),
                                                     s_block, fmt, body.clip)
      s_smem[0, pl.ds(0, HALF)] = s_block
    else:
      quantize_block_tiles(x_smem, q_smem, s_smem, transposed=False, fmt=fmt,
                           scale_format=scale_format, body=body)
      if with_transpose:
        quantize_block_tiles(x_smem, qt_smem, st_smem, transposed=True, fmt=fmt,
                             scale_format=scale_format, body=body)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, q_gmem.at[rows, cols])
    if blocks:  # TMA writes >= 16 bytes: four copies of the block's scale.
      plgpu.copy_smem_to_gmem(s_smem.at[:, pl.ds(0, 4)], s_gmem.at[pl.ds(mi, 1), pl.ds(ki * 4, 4)])
    else:
      plgpu.copy_smem_to_gmem(s_smem, s_gmem.at[pl.ds(ki, 1), rows])
    if with_transpose:
      qt_gmem, st_gmem = t_outs
      plgpu.copy_smem_to_gmem(qt_smem, qt_gmem.at[cols, rows])
      if not blocks:
        plgpu.copy_smem_to_gmem(st_smem, st_gmem.at[pl.ds(mi, 1), cols])
    plgpu.wait_smem_to_gmem(0)

  pl.run_scoped(
      scoped,
      plgpu.SMEM((TILE, TILE), x_gmem.dtype, transforms=smem_transforms(x_gmem.dtype)),
      plgpu.SMEM((TILE, TILE), dtype, transforms=smem_transforms(dtype)),
      plgpu.SMEM((TILE, TILE) if with_transpose else (8, TILE), dtype,
                 transforms=smem_transforms(dtype)),
      plgpu.SMEM((1, TILE), jnp.float32),
      plgpu.SMEM((1, TILE), jnp.float32),
      plgpu.Barrier(num_arrivals=3 if normed else 1),
      *((plgpu.SMEM((TILE,), jnp.float32), plgpu.SMEM((TILE,), jnp.float32)) if normed
        else ()),
  )


def _round_up(a: int, b: int) -> int:
  return -(-a // b) * b


KERNEL_NAME = "infir2_quantize"


def quantize_kernel_name(shape, blocks: bool, with_transpose: bool, normed: bool = False) -> str:
  """The kernel's name in profiles: layout and (padded) shape, e.g.
  infir2_quantize_tiles_t_16384x1536 (1x128 tiles plus the token-axis tiles),
  infir2_quantize_normed_tiles_t_16384x1536 (the same of an RMSNorm's output)."""
  kind = "blocks" if blocks else ("normed_tiles" if normed else "tiles")
  return f"{KERNEL_NAME}_{kind}{'_t' if with_transpose else ''}_{shape[0]}x{shape[1]}"


def row_quantize(interpret: bool) -> RowQuantize:
  """The kernels' RowQuantize under KERNEL_QUANTIZE: "lean" clips only when interpreted
  (XLA's convert does not saturate) and flushes only where it matters; "full" does both
  everywhere."""
  if KERNEL_QUANTIZE not in ("lean", "full"):
    raise ValueError(f"KERNEL_QUANTIZE={KERNEL_QUANTIZE!r}: 'lean' or 'full'")
  full = KERNEL_QUANTIZE == "full"
  return RowQuantize(clip=bool(interpret) or full, flush_every_element=full)


@functools.lru_cache(maxsize=None)
def _quantize_kernel(out_type, grid, fmt, scale_format, blocks, with_transpose, interpret,
                     row: RowQuantize, normed: bool = False):
  """The jitted kernel of one static signature, built once (lowered once per program)."""
  import jax.experimental.pallas.mosaic_gpu as plgpu
  body = functools.partial(_kernel_body, fmt=fmt, scale_format=scale_format,
                           blocks=blocks, with_transpose=with_transpose, body=row,
                           normed=normed)
  return jax.jit(plgpu.kernel(
      body, out_type=out_type, grid=grid, grid_names=("m", "k"),
      kernel_name=quantize_kernel_name(out_type[0].shape, blocks, with_transpose, normed),
      interpret=plgpu.InterpretGPUParams() if interpret else None,
  ))


def _quantize_2d(x, *, fmt, scale_format, blocks, with_transpose, interpret, norm=None):
  """Runs the kernel on a 2-D bf16 x; returns the contract's layouts. norm: (inv [M],
  gamma [K]) float32 for the normed kernel (x is then the residual stream)."""
  _check_formats(fmt, scale_format)
  if x.ndim != 2:
    raise ValueError(f"x.shape={x.shape}: the kernel takes a 2-D array")
  if x.dtype != jnp.bfloat16:
    raise ValueError(f"x.dtype={x.dtype}: the kernel takes bfloat16 (use the reference)")
  m, k = x.shape
  # Whole 128x128 blocks (swizzled TMA needs whole tiles in every array): the
  # zero padding leaves every tile's amax unchanged and is sliced off (a padded row or
  # column of the normed operand is 0 * 0 = 0).
  mp, kp = _round_up(m, TILE), _round_up(k, TILE)
  xp = jnp.pad(x, ((0, mp - m), (0, kp - k))) if (mp, kp) != (m, k) else x
  inputs = [xp]
  if norm is not None:
    inv, gamma = norm
    inputs += [jnp.pad(inv, (0, mp - m)), jnp.pad(gamma, (0, kp - k))]
  mb, kb = -(-mp // TILE), -(-kp // TILE)
  dtype = formats.get_format(fmt).dtype
  f32 = jnp.float32
  out_type = [jax.ShapeDtypeStruct((mp, kp), dtype),
              jax.ShapeDtypeStruct((mb, 4 * kb) if blocks else (kb, mp), f32)]
  if with_transpose:
    out_type += [jax.ShapeDtypeStruct((kp, mp), dtype), jax.ShapeDtypeStruct((mb, kp), f32)]
  outs = _quantize_kernel(tuple(out_type), (mb, kb), fmt, scale_format, blocks, with_transpose,
                          interpret, row_quantize(interpret), norm is not None)(*inputs)
  q = outs[0][:m, :k]
  s = outs[1][:, ::4] if blocks else outs[1].T[:m]
  if blocks and with_transpose:
    return q, s, outs[2][:k, :m]
  if with_transpose:
    return q, s, outs[2][:k, :m], outs[3].T[:k]
  return q, s


def quantize_tiles(x, *, fmt="e4m3", scale_format="ue8m0", with_transpose=False,
                   interpret=False):
  """1x128 tile quantization in one read of x.

  Args:
    x: [..., K] bfloat16 (2-D [tokens, K] when with_transpose).
    fmt: "e4m3" or "e5m2".
    scale_format: "ue8m0" (power-of-two scales) or "fp32".
    with_transpose: also return the token-axis tiles (wgrad operand).
    interpret: run the Mosaic GPU interpreter (CPU).

  Returns:
    (q [..., K], s [..., Kb]) and, with_transpose, (qT [K, M], sT [K, Mb]).
  """
  _check_formats(fmt, scale_format)
  lead, k = _rows_of(x, "x", with_transpose)
  outs = _quantize_2d(x.reshape(-1, k), fmt=fmt, scale_format=scale_format, blocks=False,
                      with_transpose=with_transpose, interpret=interpret)
  return _with_lead(outs, lead, k)


def _rows_of(x, name: str, with_transpose: bool):
  """(leading dims, K) of a tile quantizer's [..., K] input, or the ValueError naming it."""
  if with_transpose and x.ndim != 2:
    raise ValueError(f"{name}.shape={x.shape}: with_transpose needs a 2-D [tokens, K] array")
  if x.ndim < 2:
    raise ValueError(f"{name}.shape={x.shape}: needs at least 2 dims")
  return x.shape[:-1], x.shape[-1]


def _with_lead(outs, lead, k):
  """_quantize_2d's (q, s[, qT, sT]) with q and s given back their leading dims."""
  q, s = outs[0].reshape(*lead, k), outs[1].reshape(*lead, outs[1].shape[-1])
  return (q, s, *outs[2:])


def _rounded_to(x, dtype):
  """x's values rounded to `dtype` (as x.astype(dtype) rounds them), held in float32.

  Not x.astype(dtype).astype(float32): with xla_allow_excess_precision (XLA's default),
  XLA:GPU folds that pair of converts away and passes x unrounded (session 30 measured it on
  the H100: the kernel then multiplied by the float32 gamma, and its FP8 codes differed from
  those of the norm's output). reduce_precision is an op of its own that no pass folds."""
  info = jnp.finfo(dtype)
  return lax.reduce_precision(x.astype(jnp.float32), exponent_bits=info.nexp,
                              mantissa_bits=info.nmant)


def quantize_normed_tiles(h, inv, gamma, *, fmt="e4m3", scale_format="ue8m0",
                          with_transpose=False, interpret=False):
  """quantize_tiles of an RMSNorm's output without writing it: the 1x128 tiles (and with
  with_transpose the token-axis tiles) of y = gamma * bf16(h * inv), rms_normed_reference's
  bits, from one read of h.

  Args:
    h: [..., K] bfloat16, the residual stream the norm reads (2-D [tokens, K] when
      with_transpose).
    inv: [..., 1] float32, each row's 1 / rms (rsqrt(mean(h**2) + eps), as the norm has it).
    gamma: [K], the norm's scale (rounded to bfloat16 first, as the norm does).
    fmt, scale_format, with_transpose, interpret: as quantize_tiles.

  Returns:
    quantize_tiles(rms_normed_reference(h, inv, gamma), ...)'s outputs, bit for bit.
  """
  _check_formats(fmt, scale_format)
  lead, k = _rows_of(h, "h", with_transpose)
  if inv.shape != (*lead, 1):
    raise ValueError(f"inv.shape={inv.shape}: needs {(*lead, 1)} (one 1 / rms per row of h)")
  if gamma.shape != (k,):
    raise ValueError(f"gamma.shape={gamma.shape}: needs ({k},) (one scale per column of h)")
  norm = (inv.reshape(-1).astype(jnp.float32), _rounded_to(gamma, h.dtype))
  outs = _quantize_2d(h.reshape(-1, k), fmt=fmt, scale_format=scale_format, blocks=False,
                      with_transpose=with_transpose, interpret=interpret, norm=norm)
  return _with_lead(outs, lead, k)


def quantize_blocks(w, *, fmt="e4m3", scale_format="ue8m0", with_transpose=False,
                    interpret=False):
  """128x128 block quantization of a 2-D bfloat16 w: (q, s [Rb, Cb]) [, qT].

  With with_transpose also returns q of w^T (the blocks are transpose-symmetric,
  so its scale grid is s.T).
  """
  if w.ndim != 2:
    raise ValueError(f"w.shape={w.shape}: 128x128 blocks need a 2-D array")
  return _quantize_2d(w, fmt=fmt, scale_format=scale_format, blocks=True,
                      with_transpose=with_transpose, interpret=interpret)
