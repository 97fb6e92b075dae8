"""Independent float64 NumPy reference of the FP8 tile quantization (used by the precision tests).

Written from the semantics in the common contract, not from infir2_jax.precision: an explicit
loop over tiles with slicing (no padding), exact power-of-two rounding via frexp, and IEEE
float32 division emulated as a float64 division rounded once to float32 (exact: 53 >= 2*24+2,
so the double rounding is innocuous). The fp8 cast is ml_dtypes' round-to-nearest-even from
that float32 value, i.e. the same two roundings the contract prescribes (f32 quotient, then
fp8), NOT a direct float64 -> fp8 rounding of the exact quotient (which can differ when the
f32 quotient lands on an fp8 rounding midpoint). For "fp32" scales it follows the
reciprocal form documented in infir2_jax/precision/quantize.py (s = amax * RN(1/fmax),
q = x * RN(1/s)), since XLA rewrites divisions by broadcast scalars into that form.
"""

import ml_dtypes
import numpy as np

FMAX = {"e4m3": 448.0, "e5m2": 57344.0}
FP8 = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}
TINY = 2.0 ** -126
# Largest UE8M0 scale: the largest 2**e with fmax * 2**e <= float32 max (1.75 * 2**127).
UE8M0_CAP = {"e4m3": 2.0 ** 119, "e5m2": 2.0 ** 112}


def tile_of(tile, shape):
  if tile is None:
    return None
  rows, cols = shape[-2:]
  return tuple(max(1, d if t == -1 else min(t, d)) for t, d in zip(tile, (rows, cols)))


def f32_div(a, b):
  with np.errstate(invalid="ignore", divide="ignore"):
    return np.asarray(np.asarray(a, np.float64) / np.asarray(b, np.float64), np.float32)


def pow2_ceil(s):
  """2**ceil(log2(s)) elementwise for s > 0 finite; NaN and inf pass through."""
  s = np.asarray(s, np.float64)
  out = s.copy()
  ok = np.isfinite(s)
  mant, exp = np.frexp(s[ok])                     # s = mant * 2**exp, mant in [0.5, 1)
  out[ok] = np.where(mant == 0.5, s[ok], np.ldexp(1.0, exp))
  return out


def f32_mul(a, b):
  """IEEE float32 product: the float64 product of two f32 values is exact, rounded once."""
  with np.errstate(invalid="ignore", over="ignore"):
    return np.asarray(np.asarray(a, np.float64) * np.asarray(b, np.float64), np.float32)


def scale_of(amax, fmt, scale_format):
  if scale_format == "ue8m0":  # the common contract's IEEE division form
    s = f32_div(amax, FMAX[fmt]).astype(np.float64)
  else:                        # reciprocal form (what XLA runs; see quantize.py)
    s = f32_mul(amax, np.float32(1.0 / FMAX[fmt])).astype(np.float64)
  s = np.where(s < TINY, TINY, s)                 # NaN fails the comparison: stays NaN
  if scale_format == "ue8m0":
    s = pow2_ceil(s)
    s = np.where(np.isfinite(s) & (s > UE8M0_CAP[fmt]), UE8M0_CAP[fmt], s)  # inf, NaN stay
  return s.astype(np.float32)


def quantize(x, tile, fmt="e4m3", scale_format="ue8m0"):
  """(q as an ml_dtypes fp8 array, scale float32) per the contract."""
  x = np.asarray(x, np.float64)
  x = np.where(np.abs(x) < TINY, np.copysign(0.0, x), x)   # subnormals flush to signed 0
  t = tile_of(tile, x.shape)
  if t is None:
    amax = np.max(np.abs(x))
    scale = scale_of(amax, fmt, scale_format)
    scale_full = np.broadcast_to(scale, x.shape)
  else:
    rows, cols = x.shape[-2:]
    rt, ct = -(-rows // t[0]), -(-cols // t[1])
    scale = np.zeros(x.shape[:-2] + (rt, ct), np.float32)
    scale_full = np.zeros(x.shape, np.float32)
    for i in range(rt):
      for j in range(ct):
        rs, cs = slice(i * t[0], (i + 1) * t[0]), slice(j * t[1], (j + 1) * t[1])
        amax = np.max(np.abs(x[..., rs, cs]), axis=(-2, -1))   # np.max propagates NaN
        scale[..., i, j] = scale_of(amax, fmt, scale_format)
        scale_full[..., rs, cs] = scale[..., i, j][..., None, None]
  if scale_format == "ue8m0":
    y = f32_div(x, scale_full).astype(np.float64)
  else:
    y = f32_mul(x, f32_div(1.0, scale_full)).astype(np.float64)
  y = np.clip(y, -FMAX[fmt], FMAX[fmt])           # NaN stays NaN
  q = y.astype(np.float32).astype(FP8[fmt])
  return q, scale


def expand(scale, tile, shape):
  t = tile_of(tile, shape)
  if t is None:
    return np.broadcast_to(np.asarray(scale, np.float64), shape)
  s = np.repeat(np.repeat(np.asarray(scale, np.float64), t[0], axis=-2), t[1], axis=-1)
  return s[..., :shape[-2], :shape[-1]]


def dequantize(q, scale, tile):
  """float64 values q * scale (exact: <= 4 + 24 significant bits)."""
  q64 = np.asarray(q).astype(np.float64)
  with np.errstate(invalid="ignore"):
    return q64 * expand(scale, tile, q64.shape)


def qdq(x, spec):
  """x through the OperandSpec-like (fmt, tile, scale_format) in float64; fmt None = as is."""
  fmt, tile, scale_format = spec
  if fmt is None:
    return np.asarray(x, np.float64)
  q, s = quantize(x, tile, fmt, scale_format)
  return dequantize(q, s, tile)


def stats(x, spec):
  """[amax, flush_frac, snr_db] of x quantized per spec, in float64."""
  x = np.asarray(x, np.float64)
  amax = np.max(np.abs(x))
  if spec[0] is None:
    return np.array([amax, 0.0, np.inf])
  q, s = quantize(x, spec[1], spec[0], spec[2])
  nonzero = x != 0
  flushed = nonzero & (np.asarray(q).astype(np.float64) == 0)
  frac = flushed.sum() / max(nonzero.sum(), 1)
  noise = np.sum((x - dequantize(q, s, spec[1])) ** 2)
  snr = np.inf if noise == 0 else 10 * np.log10(np.sum(x * x) / noise)
  return np.array([amax, frac, snr])
