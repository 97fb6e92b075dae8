"""The 1x128 tile quantizers of quantize.py and fused_quantize.py as Pallas Triton kernels.

Same contract, signatures, layouts, padding and errors as the Mosaic GPU kernels they
mirror (quantize_tiles, swiglu_quantize, swiglu_bwd_quantize); bit-identical to the
references in interpret mode (tests/test_quantize_triton.py). Design 2 of issue 33: plain
vectorized global loads and stores from many warps instead of TMA through shared memory.

Kernel: one program per [128 tokens, 128 columns] block of each output. It loads its bf16
input blocks, runs the producer in float32 (fused_quantize.swiglu_f32 / swiglu_bwd_f32, or
the identity), rounds to bf16 once, and quantizes each output block twice: rows (amax over
axis 1, the 1x128 tiles along K) and tokens (amax over axis 0), then stores q, the token
tiles transposed (qT, a transpose Triton makes through 16 KB of shared memory) and both
scale vectors K-block-major, as the Mosaic kernels write them. Outputs of a producer with
two results (the backward's dgate, dup) are written as the two halves of one [.., 2, ..]
view of each output array, so one program makes both from one read of dh, gate and up.

What Pallas Triton (jax 0.11.2) does here, found on CPU (interpret) and by compiling the
Triton IR for sm_90a: fp32 -> float8_e4m3fn / e5m2 casts lower (cvt.rn.satfinite; the
clip before it makes saturation moot), as do 2-D transposes of fp8 blocks, int32 max
reductions along either axis, bitcasts and shifts, and blocks with a squeezed (None) or
size-2 axis. Float division lowers to an approximate PTX division, so the scales'
reciprocals are formats.reciprocal_exact (integer long division, as precision/quantize.py):
exact for every scale, so q matches the reference bit for bit on the GPU too; the
producers' own exp and division stay as they are (the same last-ulp caveat as the Mosaic
kernels: fused_quantize.py's docstring). Block shapes must be powers of two: 128 is.

Shape legend: as quantize.py (x [M, K]; q [M, K], s [M, Kb]; qT [K, M], sT [K, Mb]) and
fused_quantize.py (gu [M, 2F], dh [M, F]); inside: n_out outputs of width F each.
"""
import dataclasses
import functools

import jax
from jax import lax
import jax.numpy as jnp

from infir2_jax.precision import formats
from infir2_jax.precision.kernels.fused_quantize import PRODUCERS, _half_width
from infir2_jax.precision.kernels.fused_quantize import check_swiglu_bwd_shapes
from infir2_jax.precision.kernels.quantize import TILE, quantize_values

KERNEL_NAME = "infir2_triton"


@dataclasses.dataclass(frozen=True)
class TritonConfig:
  """How the Triton kernels run (the numbers are the same whatever is chosen).

  Attributes:
    num_warps: warps per program (one 128x128 block). The default is picked from
      deviceless ptxas for sm_90a, not from timings (benchmarks/results/
      quantize_triton_deviceless_s23.json, registers at 8 / 16 / 32 warps): quantize
      128 / 76 / 59, swiglu 190 / 80 / 63, swiglu_bwd 255 (84 bytes spilled) / 128 / 64
      (4 bytes spilled). At 32 warps each kernel fits 32 warps per SM and
      has the fewest SASS instructions (2,952 / 3,344 / 6,488: under the ~6,700 past which
      session 18's kernel left the instruction cache; bwd at 16 warps has 8,200).
      benchmarks/quantize_backends.py times 8, 16 and 32 on the GPU.
  """
  num_warps: int = 32

  def __post_init__(self):
    if self.num_warps not in (1, 2, 4, 8, 16, 32):
      raise ValueError(f"TritonConfig.num_warps={self.num_warps}: a power of two <= 32")


DEFAULT_TRITON_CONFIG = TritonConfig()


def _identity_f32(x):
  return (x,)


_PRODUCERS = {"quantize": (_identity_f32, 1), **PRODUCERS}


def _scales_and_q(x32, axis: int, fmt: str, scale_format: str):
  """(q, s) of the 1x128 tiles of a [128, 128] f32 block along `axis` (1: rows, 0: columns)."""
  amax = lax.bitcast_convert_type(jnp.max(formats.abs_bits(x32), axis=axis), jnp.float32)
  s = formats.scale_from_amax(amax, fmt, scale_format)
  inv = formats.reciprocal_exact(s)
  return quantize_values(x32, inv[:, None] if axis == 1 else inv[None, :], fmt), s


def _block_body(*refs, producer, n_in, n_out, fmt, scale_format, with_transpose,
                with_values):
  """One program: the producer on one 128x128 block of its inputs, each output quantized.

  Output refs (blocks): q [128, n_out, 128], s [n_out, 128], then with_transpose qT
  [n_out, 128, 128] and sT [n_out, 128], then with_values v [128, n_out, 128].
  """
  ins, outs = refs[:n_in], refs[n_in:]
  q_ref, s_ref, *rest = outs
  qt_ref, st_ref = rest[:2] if with_transpose else (None, None)
  v_ref = rest[-1] if with_values else None
  ys = producer(*(r[...].astype(jnp.float32) for r in ins))
  for j, y in enumerate(ys):
    value = y.astype(jnp.bfloat16)
    if with_values:
      v_ref[:, j, :] = value
    x32 = value.astype(jnp.float32)
    q, s = _scales_and_q(x32, 1, fmt, scale_format)
    q_ref[:, j, :] = q
    s_ref[j, :] = s
    if with_transpose:
      qt, st = _scales_and_q(x32, 0, fmt, scale_format)
      qt_ref[j, :, :] = qt.T
      st_ref[j, :] = st


def kernel_name(producer: str, m: int, width: int, with_transpose: bool = True) -> str:
  """The kernel's name in profiles: e.g. infir2_triton_quantize_t_16384x1536 (tiles plus
  token-axis tiles), infir2_triton_swiglu_16384x8960, infir2_triton_swiglu_bwd_16384x8960."""
  t = "_t" if producer == "quantize" and with_transpose else ""
  return f"{KERNEL_NAME}_{producer}{t}_{m}x{width}"


def _call(producer, sources, fb, interpret, fmt, scale_format, with_transpose, with_values,
          config, *arrays):
  """pallas_call over the (mb, fb) grid of 128x128 blocks; arrays' token axis whole tiles.
  sources: (array index, column-block offset) of each producer argument's block."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as pl_triton
  fn, n_out = _PRODUCERS[producer]
  m = arrays[0].shape[0]
  mb, f = m // TILE, fb * TILE
  dtype = formats.get_format(fmt).dtype
  f32 = jnp.float32
  in_specs = [pl.BlockSpec((TILE, TILE), lambda i, j, o=o: (i, j + o)) for _, o in sources]
  rows_spec = pl.BlockSpec((TILE, n_out, TILE), lambda i, j: (i, 0, j))
  out_specs = [rows_spec, pl.BlockSpec((n_out, None, TILE), lambda i, j: (0, j, i))]
  out_shape = [jax.ShapeDtypeStruct((m, n_out, f), dtype),
               jax.ShapeDtypeStruct((n_out, fb, m), f32)]
  if with_transpose:
    out_specs += [pl.BlockSpec((n_out, TILE, TILE), lambda i, j: (0, j, i)),
                  pl.BlockSpec((None, n_out, TILE), lambda i, j: (i, 0, j))]
    out_shape += [jax.ShapeDtypeStruct((n_out, f, m), dtype),
                  jax.ShapeDtypeStruct((mb, n_out, f), f32)]
  if with_values:
    out_specs.append(rows_spec)
    out_shape.append(jax.ShapeDtypeStruct((m, n_out, f), jnp.bfloat16))
  body = functools.partial(_block_body, producer=fn, n_in=len(sources), n_out=n_out, fmt=fmt,
                           scale_format=scale_format, with_transpose=with_transpose,
                           with_values=with_values)
  outs = pl.pallas_call(
      body, grid=(mb, fb), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      compiler_params=None if interpret else pl_triton.CompilerParams(
          num_warps=config.num_warps, num_stages=1),
      interpret=interpret, name=kernel_name(producer, m, f, with_transpose),
  )(*(arrays[a] for a, _ in sources))
  # Free reshapes: [M, n_out, F] is [M, n_out F]; [n_out, fb, M] is [n_out fb, M]; ...
  width = n_out * f
  q, s_KbxM = outs[0].reshape(m, width), outs[1].reshape(width // TILE, m)
  result = [q, s_KbxM]
  if with_transpose:
    result += [outs[2].reshape(width, m), outs[3].reshape(mb, width)]
  if with_values:
    result.append(outs[-1].reshape(m, width))
  return tuple(result)


@functools.lru_cache(maxsize=None)
def _jitted_triton(producer, sources, fb, fmt, scale_format, with_transpose, with_values,
                   config):
  """The Triton branch as one jitted function per static signature (lowered once per shape)."""
  return jax.jit(functools.partial(_call, producer, sources, fb, False, fmt, scale_format,
                                   with_transpose, with_values, config))


def _dispatch(producer, arrays, sources, fb, *, fmt, scale_format, with_transpose,
              with_values, interpret, config):
  """interpret None: Triton where lowered for CUDA (also ahead of time on a CPU host), the
  interpreter elsewhere (fp8_adam.py's pattern); True / False force one."""
  static = (producer, sources, fb, fmt, scale_format, with_transpose, with_values, config)
  if interpret is None:
    return lax.platform_dependent(
        *arrays, cuda=_jitted_triton(*static),
        default=functools.partial(_call, producer, sources, fb, True, fmt, scale_format,
                                  with_transpose, with_values, config))
  if interpret:
    return _call(producer, sources, fb, True, *static[3:], *arrays)
  return _jitted_triton(*static)(*arrays)


def _check(fmt, scale_format, arrays):
  formats.get_format(fmt)
  formats.check_scale_format(scale_format)
  for a in arrays:
    if a.dtype != jnp.bfloat16:
      raise ValueError(f"the kernel takes bfloat16 inputs (use the reference), got "
                       f"{a.dtype}{a.shape}")


def _round_up(a: int, b: int = TILE) -> int:
  return -(-a // b) * b


def quantize_tiles_triton(x, *, fmt="e4m3", scale_format="ue8m0", with_transpose=False,
                          interpret=None, config: TritonConfig = DEFAULT_TRITON_CONFIG):
  """quantize.quantize_tiles as a Triton kernel: (q [..., K], s [..., Kb]) and, with_transpose,
  (qT [K, M], sT [K, Mb]) of a bfloat16 x [..., K] (2-D [tokens, K] when with_transpose)."""
  if with_transpose and x.ndim != 2:
    raise ValueError(f"x.shape={x.shape}: with_transpose needs a 2-D [tokens, K] array")
  if x.ndim < 2:
    raise ValueError(f"x.shape={x.shape}: needs at least 2 dims")
  _check(fmt, scale_format, [x])
  lead, k = x.shape[:-1], x.shape[-1]
  x2 = x.reshape(-1, k)
  m = x2.shape[0]
  # Whole 128x128 blocks, as the Mosaic kernel: zero padding leaves every amax unchanged.
  mp, kp = _round_up(m), _round_up(k)
  if (mp, kp) != (m, k):
    x2 = jnp.pad(x2, ((0, mp - m), (0, kp - k)))
  outs = _dispatch("quantize", (x2,), ((0, 0),), kp // TILE, fmt=fmt,
                   scale_format=scale_format, with_transpose=with_transpose,
                   with_values=False, interpret=interpret, config=config)
  q, s = outs[0][:m, :k], outs[1].T[:m]
  q, s = q.reshape(*lead, k), s.reshape(*lead, s.shape[-1])
  if not with_transpose:
    return q, s
  return q, s, outs[2][:k, :m], outs[3].T[:k]


def _fused(producer, arrays, sources, f, *, fmt, scale_format, interpret, with_values,
           config):
  """Pads the token axis to whole tiles, runs the kernel, returns the contract's layouts."""
  _check(fmt, scale_format, arrays)
  if f % TILE:
    raise ValueError(f"fused quantization needs the MLP width F={f} to be a multiple of "
                     f"{TILE} (whole 1x128 tiles in each of gate and up)")
  m = arrays[0].shape[0]
  mp = _round_up(m)
  if mp != m:  # zero rows quantize to zero and are sliced off
    arrays = tuple(jnp.pad(a, ((0, mp - m), (0, 0))) for a in arrays)
  q, s_KbxM, qt, st_MbxK, *values = _dispatch(
      producer, tuple(arrays), sources, f // TILE, fmt=fmt, scale_format=scale_format,
      with_transpose=True, with_values=with_values, interpret=interpret, config=config)
  return (q[:m], s_KbxM.T[:m], qt[:, :m], st_MbxK.T, *(v[:m] for v in values))


def swiglu_quantize_triton(gu_Mx2F, *, fmt="e4m3", scale_format="ue8m0", interpret=None,
                           with_values=False, config: TritonConfig = DEFAULT_TRITON_CONFIG):
  """fused_quantize.swiglu_quantize as a Triton kernel: (q, s, qT, sT) of h [M, F] =
  swiglu(gu) (with_values: and h itself, as the kernel computed it)."""
  f = _half_width(gu_Mx2F)
  return _fused("swiglu", (gu_Mx2F,), ((0, 0), (0, f // TILE)), f, fmt=fmt,
                scale_format=scale_format, interpret=interpret, with_values=with_values,
                config=config)


def swiglu_bwd_quantize_triton(dh_MxF, gu_Mx2F, *, fmt="e4m3", scale_format="ue8m0",
                               interpret=None, with_values=False,
                               config: TritonConfig = DEFAULT_TRITON_CONFIG):
  """fused_quantize.swiglu_bwd_quantize as a Triton kernel: (q, s, qT, sT) of dgu [M, 2F]
  (with_values: and dgu itself, as the kernel computed it)."""
  f = check_swiglu_bwd_shapes(dh_MxF, gu_Mx2F)
  return _fused("swiglu_bwd", (dh_MxF, gu_Mx2F), ((0, 0), (1, 0), (1, f // TILE)), f,
                fmt=fmt, scale_format=scale_format, interpret=interpret,
                with_values=with_values, config=config)
