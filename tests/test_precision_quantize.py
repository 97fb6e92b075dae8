"""quantize/dequantize: bit-exact against the float64 NumPy reference, edge cases, properties."""

import zlib

import hypothesis
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from infir2_jax.precision import dequantize, formats, quantize
from infir2_jax.precision.quantize import scale_shape
import precision_np_reference as ref

TILES = [(1, 128), (128, 128), (1, -1), None, (4, 32)]


def _nasty(shape, seed):
  """Normal data with outliers, an all-zero tile, subnormals, tiny normals, NaN and +-inf."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape).astype(np.float32)
  x.flat[rng.integers(0, x.size, 20)] *= 1000.0                   # outliers
  x[..., :128, :128] = 0.0                                        # all-zero tiles
  x[..., 0, :128] = 0.0
  x[..., 3, 130:150] = rng.choice([1e-40, -3e-39, 2e-45], 20)     # f32 subnormals
  x[..., 4, :128] = rng.standard_normal(128) * 1e-37              # tiny normal tile
  x[..., 5, 140] = -0.0
  x[..., 6, 200] = 448.0 * 2.0 ** -3                              # amax exactly fmax * 2^k
  x[..., 150, 7] = np.nan
  x[..., 160, 260] = np.inf
  x[..., 170, 131] = -np.inf
  return x


def _check(x, tile, fmt, scale_format):
  q, s = jax.jit(lambda v: quantize(v, tile, fmt, scale_format))(x)
  q_ref, s_ref = ref.quantize(np.asarray(x, np.float32), tile, fmt, scale_format)
  q, s = np.asarray(q), np.asarray(s)
  assert q.dtype == q_ref.dtype and q.shape == x.shape
  assert s.dtype == np.float32 and s.shape == s_ref.shape == scale_shape(x.shape, tile)
  # Scales: bit-identical (NaN where the reference has NaN; the NaN sign/payload is free).
  np.testing.assert_array_equal(np.isnan(s), np.isnan(s_ref))
  ok = ~np.isnan(s_ref)
  np.testing.assert_array_equal(s[ok].view(np.uint32), s_ref[ok].view(np.uint32))
  # q: identical bytes except NaNs, which must stay NaN.
  q64, qr64 = q.astype(np.float64), q_ref.astype(np.float64)
  np.testing.assert_array_equal(np.isnan(q64), np.isnan(qr64))
  ok = ~np.isnan(qr64)
  np.testing.assert_array_equal(q.view(np.uint8)[ok], q_ref.view(np.uint8)[ok])
  return q, s


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("fmt,scale_format", [("e4m3", "ue8m0"), ("e4m3", "fp32"),
                                              ("e5m2", "ue8m0")])
def test_bit_exact_vs_numpy(tile, fmt, scale_format):
  x = _nasty((2, 200, 300), seed=zlib.crc32(repr((tile, fmt, scale_format)).encode()))
  if tile is None:  # one scale: keep it finite so the values are checked too
    x = np.where(np.isfinite(x), x, 1.0).astype(np.float32)
  _check(x, tile, fmt, scale_format)


@pytest.mark.parametrize("tile", [(1, 128), (128, 128)])
def test_bit_exact_bf16_input_and_wide_range(tile):
  rng = np.random.default_rng(1)
  mags = 2.0 ** rng.integers(-40, 40, (130, 260))
  x = (rng.standard_normal((130, 260)) * mags).astype(ml_dtypes.bfloat16)
  _check(jnp.asarray(x), tile, "e4m3", "ue8m0")
  _check(jnp.asarray(x), tile, "e4m3", "fp32")


def test_fp32_scale_midpoints():
  # fp32 scales make x / scale inexact: values chosen near e4m3 rounding midpoints.
  rng = np.random.default_rng(2)
  base = rng.choice(np.arange(1, 16), (64, 256)) * 2.0 ** rng.integers(-6, 6, (64, 256))
  x = (base * (1 + rng.choice([-1, 1], (64, 256)) * 2.0 ** -5) * 1.37).astype(np.float32)
  _check(x, (1, 128), "e4m3", "fp32")
  _check(x, (1, 128), "e5m2", "fp32")


def test_special_values():
  x = np.ones((4, 256), np.float32)
  x[0, 5] = np.nan
  x[1, 7] = np.inf
  x[2, :128] = 0.0
  x[3, :128] = -1e-40          # negative subnormals: flush to -0
  q, s = jax.jit(lambda v: quantize(v, (1, 128)))(x)
  d = np.asarray(jax.jit(lambda q, s: dequantize(q, s, (1, 128), jnp.float32))(q, s))
  assert np.isnan(np.asarray(s)[0, 0]) and np.isnan(d[0, :128]).all()      # NaN -> NaN tile
  assert np.isinf(np.asarray(s)[1, 0]) and np.isnan(d[1, :128]).all()      # inf -> NaN tile
  assert np.asarray(s)[2, 0] == 2.0 ** -126 and (d[2, :128] == 0).all()   # zero tile: floor
  assert (np.asarray(q)[3, :128].view(np.uint8) == 0x80).all()            # signed zero
  assert np.isfinite(d[:, 128:]).all() and (d[:, 128:] == 1.0).all()       # other tiles exact


def test_dequantize_matches_reference():
  x = _nasty((2, 180, 270), seed=3)
  for tile, fmt, sf in [((1, 128), "e4m3", "fp32"), ((128, 128), "e5m2", "ue8m0")]:
    q, s = quantize(x, tile, fmt, sf)
    got = np.asarray(dequantize(q, s, tile, jnp.float32))
    want = ref.dequantize(np.asarray(q), np.asarray(s), tile).astype(np.float32)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    np.testing.assert_array_equal(got[ok], want[ok])
  # UE8M0 dequantization is exact in bf16.
  q, s = quantize(x, (1, 128), "e4m3", "ue8m0")
  as_bf16 = np.asarray(dequantize(q, s, (1, 128), jnp.bfloat16)).astype(np.float64)
  exact = ref.dequantize(np.asarray(q), np.asarray(s), (1, 128))
  ok = np.isfinite(exact)
  np.testing.assert_array_equal(as_bf16[ok], exact[ok])


def test_ue8m0_reciprocal_form_equals_division_form():
  # quantize() computes amax * RN(1/fmax) (what XLA runs anyway); after rounding up to a
  # power of two this must equal the contract's amax / fmax for EVERY float32 amax. The
  # map is scale invariant for normal results, so one whole binade [1, 2) is exhaustive,
  # and E5M2's 57344 = 1.75 * 2**15 behaves exactly like E4M3's 448 = 1.75 * 2**8.
  fmax = 448.0
  amax = ((127 << 23) | np.arange(2 ** 23, dtype=np.uint32)).view(np.float32)
  by_div = ref.pow2_ceil(ref.f32_div(amax, fmax))
  by_mul = ref.pow2_ceil(ref.f32_mul(amax, np.float32(1.0 / fmax)))
  np.testing.assert_array_equal(by_div, by_mul)


def test_reciprocal_exact_is_correctly_rounded():
  # Every significand once (one binade is exhaustive: the exponent only shifts), plus
  # the ends of the scale range and the special values.
  s = ((127 << 23) | np.arange(2 ** 23, dtype=np.uint32)).view(np.float32)
  ends = np.float32([2.0 ** -126, 3 * 2.0 ** -127, 2.0 ** 125, 1.75 * 2.0 ** 125])
  s = np.concatenate([s, ends])
  got = np.asarray(jax.jit(formats.reciprocal_exact)(s))
  np.testing.assert_array_equal(got.view(np.uint32), ref.f32_div(1.0, s).view(np.uint32))
  special = np.asarray(formats.reciprocal_exact(jnp.float32([np.inf, np.nan])))
  assert special[0] == 0 and np.isnan(special[1])


def test_reciprocal_pow2_is_the_correctly_rounded_reciprocal_of_every_ue8m0_scale():
  # every power of two a UE8M0 scale can be (the floor 2**-126 up past the E4M3 cap 2**119),
  # against float64's exact 1 / s and against reciprocal_exact, plus the special values
  s = np.float32(2.0) ** np.arange(-126, 127, dtype=np.float32)
  got = np.asarray(jax.jit(formats.reciprocal_pow2)(s))
  np.testing.assert_array_equal(got, (1.0 / s.astype(np.float64)).astype(np.float32))
  np.testing.assert_array_equal(got.view(np.uint32),
                                np.asarray(formats.reciprocal_exact(s)).view(np.uint32))
  special = np.asarray(formats.reciprocal_pow2(jnp.float32([np.inf, np.nan])))
  assert special[0] == 0 and np.isnan(special[1])


@pytest.mark.parametrize("shape,tile,want", [
    ((4, 8960), (1, 128), (4, 70)),
    ((3, 151936), (1, 128), (3, 1187)),
    ((151936, 64), (128, 128), (1187, 1)),
    ((200, 8960), (128, 128), (2, 70)),
    ((2, 5, 300), (1, 128), (2, 5, 3)),
    ((2, 5, 300), (1, -1), (2, 5, 1)),
    ((2, 5, 300), None, ()),
    ((130, 1), (128, 128), (2, 1)),
])
def test_scale_shapes(shape, tile, want):
  q, s = jax.eval_shape(lambda v: quantize(v, tile), jax.ShapeDtypeStruct(shape, jnp.bfloat16))
  assert q.shape == shape and q.dtype == jnp.float8_e4m3fn
  assert s.shape == want and s.dtype == jnp.float32


def test_real_odd_dims_run():
  x = jax.random.normal(jax.random.key(0), (3, 8960), jnp.bfloat16)
  _check(x, (1, 128), "e4m3", "ue8m0")


@pytest.mark.parametrize("bad,match", [
    (dict(tile=(0, 128)), "tile"), (dict(tile=(128,)), "tile"), (dict(tile=128), "tile"),
    (dict(fmt="e3m4"), "e3m4"), (dict(scale_format="e8m0"), "e8m0")])
def test_bad_arguments(bad, match):
  kwargs = dict(tile=(1, 128), fmt="e4m3", scale_format="ue8m0") | bad
  with pytest.raises(ValueError, match=match):
    quantize(jnp.ones((4, 4)), **kwargs)


def test_rank1_needs_tile_none():
  with pytest.raises(ValueError, match="rank"):
    quantize(jnp.ones((8,)), (1, 128))
  q, s = quantize(jnp.ones((8,)), None)
  assert s.shape == () and float(s) == 2.0 ** -8  # 1/448 rounded up to a power of two


def test_dequantize_rejects_wrong_scale_shape():
  q, s = quantize(jnp.ones((4, 256)), (1, 128))
  with pytest.raises(ValueError, match="scale.shape"):
    dequantize(q, s[:, :1], (1, 128))


_floats = st.floats(allow_nan=False, allow_infinity=False, width=32)


_jit_quantize = jax.jit(quantize, static_argnums=(1, 2, 3))


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(
    x=hnp.arrays(np.float32, st.sampled_from([(24, 40), (7, 33)]), elements=_floats),
    tile=st.sampled_from([(1, 8), (4, 4), (1, -1), None, (16, 16)]),
    fmt=st.sampled_from(["e4m3", "e5m2"]))
def test_property_ue8m0_pow2_and_in_range(x, tile, fmt):
  q, s = _jit_quantize(x, tile, fmt, "ue8m0")
  s = np.asarray(s, np.float64)
  mant, _ = np.frexp(s)
  assert (mant == 0.5).all(), "UE8M0 scales must be exact powers of two"
  assert (s >= 2.0 ** -126).all()
  fmax = ref.FMAX[fmt]
  full = ref.expand(s, tile, x.shape)
  x64 = np.where(np.abs(x) < 2.0 ** -126, 0.0, x.astype(np.float64))
  top = fmax * ref.UE8M0_CAP[fmt]      # above it, x saturates (the scale is capped)
  x64 = np.clip(x64, -top, top)
  assert (np.abs(x64 / full) <= fmax).all(), "|x / scale| must never exceed fmax"
  # Round-to-nearest error bound: half an ulp (relative) or half the subnormal step.
  d = np.asarray(q).astype(np.float64) * full
  rel, sub = (2.0 ** -4, 2.0 ** -10) if fmt == "e4m3" else (2.0 ** -3, 2.0 ** -17)
  assert (np.abs(d - x64) <= rel * np.abs(x64) + sub * full).all()
