"""A finite input never quantizes to a value that dequantizes to inf (issue 23, item 9).

At the top of float32 a UE8M0 scale of 2**120 (E4M3) let x >= 248 * 2**120 round to
q = 256, and 256 * 2**120 = 2**128 is inf in float32 and bf16. The scale is capped at the
largest power of two with fmax * scale finite, in formats.scale_from_amax, which the XLA
quantizer and the Pallas kernels share.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from infir2_jax.precision import dequantize, formats, kernels, quantize

F32_MAX = float(np.finfo(np.float32).max)


def _top_of_float32(lowest: float, stride: int = 1) -> np.ndarray:
  """Every `stride`-th positive float32 from `lowest` to float32 max, then their negatives,
  as rows of 128 (one 1x128 tile per row, so each tile's amax is near its values)."""
  lo = int(np.float32(lowest).view(np.uint32))
  hi = int(np.float32(F32_MAX).view(np.uint32))
  bits = np.arange(lo, hi + 1, stride, dtype=np.uint32)
  bits = np.concatenate([bits, np.full((-len(bits)) % 128, hi, np.uint32)])
  x = bits.view(np.float32)
  return np.concatenate([x, -x]).reshape(-1, 128)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("scale_format", ["ue8m0", "fp32"])
def test_every_finite_top_value_dequantizes_finite(fmt, scale_format):
  """Every third float32 from 2.9e38 to float32 max (E4M3 overflowed from 3.2964854e38, E5M2
  from 3.1901472e38), per 1x128 tile and per tensor: float32 and bf16 dequantize finite, and
  within the format's rounding (or the saturation at fmax * cap) of x."""
  x = _top_of_float32(2.9e38, stride=3)
  q, s = jax.jit(lambda v: quantize(v, (1, 128), fmt, scale_format))(x)
  # bf16: inputs in bf16's range (|x| <= 3.3895e38); beyond it x itself is no bf16 value.
  in_bf16 = np.abs(x) <= float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)
  for dtype, where in ((jnp.float32, np.ones_like(in_bf16)), (jnp.bfloat16, in_bf16)):
    d = np.asarray(dequantize(q, s, (1, 128), dtype)).astype(np.float64)
    bad = where & ~np.isfinite(d)
    assert not bad.any(), (fmt, scale_format, dtype, x[bad][:3])
  d = np.asarray(dequantize(q, s, (1, 128), jnp.float32)).astype(np.float64)
  f = formats.get_format(fmt)
  top = f.max * f.max_pow2_scale if scale_format == "ue8m0" else F32_MAX
  want = np.clip(x.astype(np.float64), -top, top)
  rel = 2.0 ** -4 if fmt == "e4m3" else 2.0 ** -3  # half an ulp of 3 / 2 mantissa bits
  assert (np.abs(d - want) <= rel * np.abs(want)).all()
  q1, s1 = quantize(jnp.asarray(x[::97]), None, fmt, scale_format)     # one scale per tensor
  assert np.isfinite(np.asarray(dequantize(q1, s1, None, jnp.float32))).all()


def test_ue8m0_cap_is_the_largest_finite_power_of_two():
  """2**119 (E4M3) and 2**112 (E5M2): fmax * cap is finite, fmax * 2 * cap is not."""
  for fmt, e in (("e4m3", 119), ("e5m2", 112)):
    f = formats.get_format(fmt)
    assert f.max_pow2_scale == 2.0 ** e
    assert np.isfinite(np.float32(f.max) * np.float32(2.0 ** e))
    with np.errstate(over="ignore"):
      assert np.isinf(np.float32(f.max) * np.float32(2.0 ** (e + 1)))


def test_cap_changes_only_tiles_above_fmax_times_cap():
  """Below fmax * cap the scale is the plain power-of-two rounding; from there on the cap;
  inf and NaN amax keep their inf / NaN scale (the tile dequantizes to NaN, never finite)."""
  for fmt in ("e4m3", "e5m2"):
    f = formats.get_format(fmt)
    cap = f.max_pow2_scale
    amax = np.array([1.0, f.max * cap * (1 - 2.0 ** -20), np.nextafter(f.max * cap, np.inf),
                     F32_MAX, np.inf, np.nan], np.float32)
    s = np.asarray(jax.jit(lambda a: formats.scale_from_amax(a, fmt, "ue8m0"))(amax))
    plain = 2.0 ** np.ceil(np.log2(amax[:2].astype(np.float64) / f.max))
    np.testing.assert_array_equal(s[:2], plain)
    assert s[2] == s[3] == cap
    assert np.isinf(s[4]) and np.isnan(s[5])


def test_pallas_kernel_reference_and_interpreter_agree_at_the_top():
  """The kernels call the same scale rule: in the Mosaic GPU interpreter, bf16 inputs up to
  bf16 max (3.39e38) quantize bit-identically to the XLA path and dequantize finite."""
  bf16_max = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)
  rng = np.random.default_rng(0)
  x = rng.uniform(2.9e38, bf16_max, (128, 256)) * rng.choice([-1, 1], (128, 256))
  x[:, 128:] *= 1e-30                       # a second column of tiles far from the top
  x = jnp.asarray(x.astype(np.float32), jnp.bfloat16)
  q, s = kernels.quantize_tiles(x, fmt="e4m3", scale_format="ue8m0", interpret=True)
  rq, rs = quantize(x, (1, 128), "e4m3", "ue8m0")
  np.testing.assert_array_equal(np.asarray(s), np.asarray(rs))
  np.testing.assert_array_equal(np.asarray(q).view(np.uint8), np.asarray(rq).view(np.uint8))
  assert np.isfinite(np.asarray(dequantize(q, s, (1, 128), jnp.bfloat16),
                                np.float32)).all()
