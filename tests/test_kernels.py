"""CPU tests of infir2_jax.precision.kernels: interpret-mode runs, Hopper lowering, references.

The Mosaic GPU interpreter runs the real kernel bodies on CPU; lowering for an
abstract H100 catches shared-memory overflow and unsupported primitives (not
ptxas: registers and spills are only seen on the GPU, see benchmarks/).
"""
import ast
import dataclasses
import importlib
import json
import os

import jax
from jax import lax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from infir2_jax.precision import formats
from infir2_jax.precision import kernels
from infir2_jax.precision.kernels import gemm
from infir2_jax.precision.kernels import gemm_body
from infir2_jax.precision.kernels import quantize
from infir2_jax.precision.kernels import tuning

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def _operands(m, n, k, kind, seed=0, a_dtype=E4M3, b_dtype=E4M3):
  """Random fp8 operands with random power-of-two scales (exact in any order)."""
  r = np.random.default_rng(seed)
  a = jnp.asarray(r.standard_normal((m, k)) * 8, jnp.float32).astype(a_dtype)
  b = jnp.asarray(r.standard_normal((n, k)) * 8, jnp.float32).astype(b_dtype)
  kb = -(-k // 128)
  sa = jnp.asarray(2.0 ** r.integers(-6, 6, (m, kb)), jnp.float32)
  rows = n if kind == "row" else -(-n // 128)
  sb = jnp.asarray(2.0 ** r.integers(-6, 6, (rows, kb)), jnp.float32)
  return a, sa, b, sb


def _numpy_f64(a, sa, b, sb):
  """Independent float64 reference: dequantize both operands, one matmul."""
  (m, k), n = a.shape, b.shape[0]
  a64 = np.asarray(a.astype(jnp.float32), np.float64)
  b64 = np.asarray(b.astype(jnp.float32), np.float64)
  col = np.arange(k) // 128
  sa64 = np.asarray(sa, np.float64)[:, col]
  sb_rows = np.asarray(sb, np.float64)
  if sb_rows.shape[0] != n:  # 128x128 blocks
    sb_rows = sb_rows[np.arange(n) // 128]
  return (a64 * sa64) @ (b64 * sb_rows[:, col]).T


def _rel_err(out, ref):
  out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
  return np.linalg.norm(out - ref) / np.linalg.norm(ref)


@pytest.mark.parametrize("kind", ["block", "row"])
def test_reference_matches_float64(kind):
  args = _operands(136, 264, 392, kind)
  out = gemm.block_scaled_matmul_reference(*args, out_dtype=jnp.float32)
  assert _rel_err(out, _numpy_f64(*args)) < 1e-6


@pytest.mark.parametrize("m,n,k,kind,config", [
    (144, 200, 392, "block", tuning.TuningConfig(max_concurrent_steps=2)),
    (136, 72, 264, "row", tuning.TuningConfig(max_concurrent_steps=2)),
    (264, 136, 264, "block", tuning.TuningConfig(max_concurrent_steps=3)),
    (72, 264, 136, "row", tuning.TuningConfig(max_concurrent_steps=2, tile_n=192)),
    (136, 72, 648, "row", tuning.TuningConfig(max_concurrent_steps=2, split_k=3)),
    (136, 200, 264, "block", tuning.TuningConfig(max_concurrent_steps=2, epi_n=64)),
    # Three compute warpgroups (192-row CTA tiles; M tails inside the last one), and one.
    (200, 200, 264, "block", tuning.TuningConfig(max_concurrent_steps=2, compute_wgs=3)),
    (1000, 72, 392, "row", tuning.TuningConfig(max_concurrent_steps=4, compute_wgs=3,
                                             cross_tile=True)),
    (136, 72, 648, "row", tuning.TuningConfig(max_concurrent_steps=2, compute_wgs=3, split_k=3)),
    (136, 200, 264, "block", tuning.TuningConfig(max_concurrent_steps=2, compute_wgs=1)),
    (1000, 264, 392, "block", tuning.TuningConfig(max_concurrent_steps=2, compute_wgs=3,
                                                cross_tile=False)),  # 18 tiles on 4 CTAs
    # One pipeline across each CTA's tiles (the interpreter has 4 CTAs): 2, 4 and 6 K
    # blocks per tile, 3 or 4 tiles per CTA, tails on every axis.
    (520, 264, 256, "block", tuning.TuningConfig(max_concurrent_steps=4, cross_tile=True)),
    (1000, 200, 392, "row", tuning.TuningConfig(max_concurrent_steps=6, cross_tile=True)),
    (520, 264, 768, "block", tuning.TuningConfig(max_concurrent_steps=2, cross_tile=True,
                                               epi_n=64)),
    # A split that does not divide the 7 K blocks: the last split's second block lies past K.
    (136, 72, 840, "row", tuning.TuningConfig(max_concurrent_steps=2, split_k=4)),
    # One staging buffer per warpgroup, reused by every chunk of every tile of a CTA.
    (520, 200, 264, "block", tuning.TuningConfig(max_concurrent_steps=2, epi_n=64)),
])
def test_gemm_interpret_with_tails(m, n, k, kind, config):
  args = _operands(m, n, k, kind, seed=m + n)
  ref = _numpy_f64(*args)
  out = kernels.block_scaled_matmul(*args, out_dtype=jnp.float32, config=config, interpret=True)
  assert out.shape == (m, n) and out.dtype == jnp.float32
  assert _rel_err(out, ref) < 1e-6


@pytest.mark.parametrize("kind", ["block", "row"])
def test_kernel_scales_layout_and_entry_point(kind):
  """kernel_scales: A's scales transposed, B's one per row (a block's repeated over its 128
  rows); matmul_kernel_scales on them gives block_scaled_matmul's output bit for bit."""
  m, n, k = 136, 264, 392
  args = _operands(m, n, k, kind, seed=7)
  a, sa, b, sb = args
  scales = kernels.kernel_scales(*args)
  assert scales.kind == kind
  np.testing.assert_array_equal(np.asarray(scales.sa_KbxM), np.asarray(sa).T)
  rows = np.asarray(sb) if kind == "row" else np.asarray(sb)[np.arange(n) // 128]
  np.testing.assert_array_equal(np.asarray(scales.sb_KbxN), rows.T)
  config = tuning.TuningConfig(max_concurrent_steps=2)
  out = kernels.matmul_kernel_scales(a, b, scales, out_dtype=jnp.float32, config=config,
                                     interpret=True)
  want = kernels.block_scaled_matmul(*args, out_dtype=jnp.float32, config=config,
                                     interpret=True)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
  assert _rel_err(out, _numpy_f64(*args)) < 1e-6


@pytest.mark.parametrize("m, n, k, kind, config", [
    (72, 264, 392, "row", tuning.TuningConfig(max_concurrent_steps=2, tile_n=192)),
    (200, 200, 264, "block", tuning.TuningConfig(max_concurrent_steps=2, compute_wgs=3)),
])
def test_gemm_scales_first_gives_the_same_bits(m, n, k, kind, config):
  """Loading the K block's scales before its wgmma (TuningConfig.scales_first) moves
  instructions, not arithmetic: the output equals the default kernel's bit for bit."""
  import dataclasses
  args = _operands(m, n, k, kind, seed=m + k)
  want = kernels.block_scaled_matmul(*args, out_dtype=jnp.float32, config=config, interpret=True)
  got = kernels.block_scaled_matmul(*args, out_dtype=jnp.float32, interpret=True,
                                    config=dataclasses.replace(config, scales_first=True))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert _rel_err(got, _numpy_f64(*args)) < 1e-6


def test_matmul_kernel_scales_rejects_bad_scales():
  a, sa, b, sb = _operands(128, 256, 384, "block")
  scales = kernels.kernel_scales(a, sa, b, sb)
  with pytest.raises(ValueError, match=r"KernelScales.sa_KbxM: float32\[128, 3\], expected"
                                       r" float32\[3, 128\]"):
    kernels.matmul_kernel_scales(a, b, kernels.KernelScales(scales.sa_KbxM.T, scales.sb_KbxN,
                                                            "block"))
  with pytest.raises(ValueError, match="KernelScales.sb_KbxN: bfloat16"):
    kernels.matmul_kernel_scales(a, b, kernels.KernelScales(
        scales.sa_KbxM, scales.sb_KbxN.astype(jnp.bfloat16), "block"))
  with pytest.raises(ValueError, match="contraction mismatch"):
    kernels.matmul_kernel_scales(a, b[:, :256], scales)
  with pytest.raises(ValueError, match="kind"):
    kernels.matmul_kernel_scales(a, b, kernels.KernelScales(scales.sa_KbxM, scales.sb_KbxN,
                                                            "tile"))


def test_gemm_interpret_mixed_fp8_bf16_out():
  args = _operands(128, 128, 256, "block", seed=3, a_dtype=E4M3, b_dtype=E5M2)
  out = kernels.block_scaled_matmul(*args, interpret=True)
  assert out.dtype == jnp.bfloat16
  assert _rel_err(out, _numpy_f64(*args)) < 1e-2


def test_gemm_rejects_bad_operands():
  a, sa, b, sb = _operands(128, 128, 256, "block")
  with pytest.raises(ValueError, match="contraction"):
    kernels.block_scaled_matmul(a, sa, b[:, :128], sb)
  with pytest.raises(ValueError, match="b_scale"):
    kernels.block_scaled_matmul(a, sa, b, sb[:, :1])
  with pytest.raises(ValueError, match="float8"):
    kernels.block_scaled_matmul(a.astype(jnp.bfloat16), sa, b, sb)
  with pytest.raises(ValueError, match="out_dtype"):
    kernels.block_scaled_matmul(a, sa, b, sb, out_dtype=jnp.float16)
  with pytest.raises(ValueError, match="tile_n"):
    tuning.TuningConfig(tile_n=100)
  with pytest.raises(ValueError, match="compute_wgs"):
    tuning.TuningConfig(compute_wgs=4)


def test_supports_and_available_on_cpu():
  assert not kernels.available()  # no Hopper GPU here
  assert kernels.supports(16384, 1536, 8960, E4M3, E4M3, (12, 70))
  assert kernels.supports(1536, 8960, 16384, E4M3, E5M2, (8960, 128))
  assert not kernels.supports(128, 128, 128, jnp.bfloat16, E4M3, (1, 1))
  assert not kernels.supports(128, 256, 128, E4M3, E4M3, (3, 1))
  assert not kernels.supports(128, 128, 128, E4M3, E4M3, (1, 1), jnp.float16)


def _special_input(m, k, seed=0):
  """bf16 data over many magnitudes, with zero tiles, subnormals, NaN and inf."""
  r = np.random.default_rng(seed)
  x = r.standard_normal((m, k)).astype(np.float32) * np.exp(r.uniform(-20, 20, (m, 1)))
  x = x.astype(np.float32)
  x[0, :5] = 0
  x[:128, 128:256] = 0
  x[1, :128] = 1e-39  # subnormal tile (flushed to zero)
  x[1, 3] = 2e-38
  x[m - 1, k - 1] = np.nan
  x[2, 7] = -np.inf
  x[4, 9] = np.nan   # a NaN row beside the subnormal one: its NaN scale must not hide row 1's flush
  if m > 3 and k >= 128:   # a tile whose ue8m0 scale is capped: it saturates at +-fmax * cap
    x[3, :128] = np.linspace(-3.35e38, 3.35e38, 128)
  return jnp.asarray(x, jnp.bfloat16)


def _bit_equal(a, b):
  a = np.asarray(jnp.asarray(a, jnp.float32))
  b = np.asarray(jnp.asarray(b, jnp.float32))
  return a.shape == b.shape and bool(np.all((a == b) | (np.isnan(a) & np.isnan(b))))


@pytest.mark.parametrize("m,k,fmt,scale_format,with_transpose", [
    (256, 384, "e4m3", "ue8m0", True),
    (200, 312, "e5m2", "fp32", True),
    (136, 264, "e4m3", "fp32", False),
])
def test_quantize_tiles_interpret_bit_identical(m, k, fmt, scale_format, with_transpose):
  x = _special_input(m, k)
  out = kernels.quantize_tiles(x, fmt=fmt, scale_format=scale_format,
                               with_transpose=with_transpose, interpret=True)
  ref = kernels.quantize_tiles_reference(x, fmt=fmt, scale_format=scale_format,
                                         with_transpose=with_transpose)
  assert len(out) == len(ref) == (4 if with_transpose else 2)
  for o, r in zip(out, ref):
    assert o.dtype == r.dtype and _bit_equal(o, r)


def _norm_inputs(m, k, seed=0):
  """(h, inv, gamma) of an RMSNorm: h with rows over many magnitudes, a few wide channels,
  zero and NaN entries; inv its rows' 1 / rms (a NaN row's is NaN, a zero row's large);
  gamma over 0.05..3 with a negative and a zero entry."""
  r = np.random.default_rng(seed)
  h = r.standard_normal((m, k)).astype(np.float32) * np.exp(r.uniform(-8, 8, (m, 1)))
  h[:, r.random(k) < 0.02] *= 40
  h[0] = 0
  h[m - 1, k - 1] = np.nan
  h = jnp.asarray(h, jnp.bfloat16)
  h32 = h.astype(jnp.float32)
  inv = lax.rsqrt(jnp.mean(h32 * h32, axis=-1, keepdims=True) + 1e-6)
  gamma = r.uniform(0.05, 3.0, k).astype(np.float32)
  gamma[1], gamma[2] = -0.7, 0.0
  return h, inv, jnp.asarray(gamma)


@pytest.mark.parametrize("m,k,fmt,scale_format,with_transpose", [
    (256, 384, "e4m3", "ue8m0", True),
    (200, 312, "e5m2", "fp32", True),
    (136, 264, "e4m3", "ue8m0", False),
])
def test_quantize_normed_tiles_interpret_bit_identical(m, k, fmt, scale_format,
                                                       with_transpose):
  """The normed kernel's tiles (and token-axis tiles) of gamma * bf16(h * inv) equal the
  reference quantizer's of the normed operand written out in bf16, computed op by op (no
  fusion that could keep excess precision); the norm changes the codes (the kernel does
  not just quantize h)."""
  h, inv, gamma = _norm_inputs(m, k)
  kw = dict(fmt=fmt, scale_format=scale_format, with_transpose=with_transpose)
  out = kernels.quantize_normed_tiles(h, inv, gamma, interpret=True, **kw)
  y = gamma.astype(jnp.bfloat16) * (h.astype(jnp.float32) * inv).astype(jnp.bfloat16)
  assert _bit_equal(y, quantize.rms_normed_reference(h, inv, gamma))
  ref = kernels.quantize_tiles_reference(y, **kw)
  assert len(out) == len(ref) == (4 if with_transpose else 2)
  for o, r in zip(out, ref):
    assert o.dtype == r.dtype and _bit_equal(o, r)
  plain = kernels.quantize_tiles_reference(h, **kw)
  assert not _bit_equal(out[0], plain[0]) and not _bit_equal(out[1], plain[1])
  # leading dims as quantize_tiles takes them
  if not with_transpose:
    q3, s3 = kernels.quantize_normed_tiles(h.reshape(2, m // 2, k), inv.reshape(2, m // 2, 1),
                                           gamma, interpret=True, **kw)
    assert _bit_equal(q3.reshape(m, k), out[0]) and _bit_equal(s3.reshape(m, -1), out[1])


def test_normed_kernels_gamma_rounds_as_a_bf16_cast():
  """The normed kernel's gamma is rounded by reduce_precision (a convert pair would be folded
  away by XLA:GPU): the same values as numpy's (ml_dtypes') cast to bfloat16, over normal,
  subnormal, tie, overflowing and non-finite float32 inputs, jitted and not."""
  r = np.random.default_rng(0)
  with np.errstate(over="ignore"):   # some of these overflow float32 on purpose: +-inf
    x = (r.standard_normal(20000) * np.exp2(r.integers(-140, 128, 20000))).astype(np.float32)
  ties = np.array([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 3.3895314e38, 2**-133],
                  np.float32)
  x = np.concatenate([x, ties, np.array([np.nan, np.inf, -np.inf, 0.0, -0.0], np.float32)])
  want = x.astype(ml_dtypes.bfloat16).astype(np.float32)
  for f in (quantize._rounded_to, jax.jit(quantize._rounded_to, static_argnums=1)):
    got = np.asarray(f(jnp.asarray(x), jnp.bfloat16))
    assert np.array_equal(got, want, equal_nan=True)
    assert np.array_equal(np.signbit(got), np.signbit(want))


def test_quantize_normed_tiles_rejects_bad_input():
  h, inv, gamma = _norm_inputs(128, 256)
  with pytest.raises(ValueError, match=r"inv.shape=\(128,\): needs \(128, 1\)"):
    kernels.quantize_normed_tiles(h, inv[:, 0], gamma)
  with pytest.raises(ValueError, match=r"gamma.shape=\(128,\): needs \(256,\)"):
    kernels.quantize_normed_tiles(h, inv, gamma[:128])
  with pytest.raises(ValueError, match="2-D"):
    kernels.quantize_normed_tiles(h.reshape(2, 64, 256), inv.reshape(2, 64, 1), gamma,
                                  with_transpose=True)
  with pytest.raises(ValueError, match="bfloat16"):
    kernels.quantize_normed_tiles(h.astype(jnp.float32), inv, gamma)


@pytest.mark.parametrize("fmt,scale_format", [("e4m3", "ue8m0"), ("e4m3", "fp32")])
def test_quantize_blocks_interpret_bit_identical(fmt, scale_format):
  w = _special_input(200, 312, seed=1)
  q, s, qt = kernels.quantize_blocks(w, fmt=fmt, scale_format=scale_format,
                                     with_transpose=True, interpret=True)
  rq, rs = kernels.quantize_blocks_reference(w, fmt=fmt, scale_format=scale_format)
  assert _bit_equal(q, rq) and _bit_equal(s, rs) and _bit_equal(qt, rq.T)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("scale_format", ["ue8m0", "fp32"])
def test_the_clip_the_gpu_kernels_leave_to_the_cast_matters_only_in_capped_tiles(
    fmt, scale_format):
  """On the GPU the kernels leave quantize_values' clip to the saturating fp8 cast. With
  every bf16 bit pattern as a tile's amax and the tile's largest elements (+-amax, whose
  products are the largest) and smaller ones, XLA's non-saturating cast of the unclipped
  product equals the clipped fp8 bit for bit (NaN, inf, subnormals and zeros included)
  except in tiles whose "ue8m0" scale is capped, where only the clip (or a saturating
  cast) gives +-fmax: what tests/test_kernels_gpu.py checks on the device (_special_input
  has such a tile)."""
  every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(ml_dtypes.bfloat16)
  amax_bits = formats.abs_bits(jnp.asarray(every, jnp.float32))
  amax = jax.lax.bitcast_convert_type(amax_bits, jnp.float32)
  scale = formats.scale_from_amax(amax, fmt, scale_format)
  inv = jnp.broadcast_to((1.0 / scale)[:, None], (every.size, 4))
  x = jnp.asarray(every, jnp.float32)[:, None] * jnp.asarray([1, -1, 0.75, -0.5], jnp.float32)
  clipped = np.asarray(quantize.quantize_values(x, inv, fmt), np.float32)
  unclipped = np.asarray(quantize.quantize_values(x, inv, fmt, clip=False), np.float32)
  same = (clipped == unclipped) | (np.isnan(clipped) & np.isnan(unclipped))
  capped = np.asarray(scale) == formats.get_format(fmt).max_pow2_scale
  assert same[~capped].all()
  if scale_format == "ue8m0":
    assert not same[capped].all()          # the capped tiles do need the clip
  fmax = formats.get_format(fmt).max
  np.testing.assert_array_equal(np.abs(clipped[capped & ~same[:, 0]][:, :2]), fmax)


def test_a_row_needs_the_flush_only_where_its_scale_lets_a_subnormal_reach_a_code():
  """quantize.rows_need_flush: true where some row's 1 / scale passes flush_free_inv (2**116
  E4M3, 2**109 E5M2), a NaN row hiding nothing; and at that bound the largest subnormal's
  product rounds to zero in the format, one binade above it does not."""
  need = lambda inv, fmt="e4m3": bool(quantize.rows_need_flush(jnp.asarray(inv, jnp.float32),
                                                               fmt))
  assert np.log2(quantize.flush_free_inv("e4m3")) == 116
  assert np.log2(quantize.flush_free_inv("e5m2")) == 109
  assert not need([1.0, 2.0**116, 0.0])   # 0: an infinite scale (inv is never above 2**126)
  assert need([1.0, 2.0**117]) and need([np.nan, 2.0**126]) and not need([np.nan, 1.0])
  assert need([2.0**110], "e5m2") and not need([2.0**110], "e4m3")
  largest_subnormal = np.float32(np.nextafter(np.float32(2.0**-126), np.float32(0)))
  for fmt, dtype in (("e4m3", ml_dtypes.float8_e4m3fn), ("e5m2", ml_dtypes.float8_e5m2)):
    bound = np.float32(quantize.flush_free_inv(fmt))
    assert float((largest_subnormal * bound).astype(dtype)) == 0.0
    assert float((largest_subnormal * bound * 2).astype(dtype)) != 0.0


def test_quantize_reference_semantics_numpy():
  """The reference against a float64-free numpy re-derivation of the contract."""
  x = _special_input(128, 256, seed=2)
  q, s = kernels.quantize_tiles_reference(x)
  xf = np.asarray(x.astype(jnp.float32)).reshape(128, 2, 128)
  with np.errstate(invalid="ignore"):
    xf = np.where(np.abs(xf) < np.finfo(np.float32).tiny, xf * 0, xf)
    amax = np.max(np.abs(xf), axis=-1)  # numpy max propagates NaN
    s_ref = np.maximum(amax * np.float32(1 / 448), np.finfo(np.float32).tiny)
    pow2 = np.exp2(np.ceil(np.log2(s_ref.astype(np.float64)))).astype(np.float32)
    s_ref = np.where(np.isfinite(s_ref), np.minimum(pow2, np.float32(2.0**119)), s_ref)  # cap
    y = np.clip(xf * (np.float32(1) / s_ref)[..., None], -448, 448)
  assert _bit_equal(s, s_ref)
  assert _bit_equal(q, y.astype(ml_dtypes.float8_e4m3fn).reshape(128, 256))


def test_quantize_matches_precision_module():
  pq = importlib.import_module("infir2_jax.precision.quantize")
  x = _special_input(200, 264, seed=4)
  for fmt, sf in (("e4m3", "ue8m0"), ("e5m2", "fp32")):
    q, s, qt, st = kernels.quantize_tiles_reference(x, fmt=fmt, scale_format=sf,
                                                    with_transpose=True)
    pq_q, pq_s = pq.quantize(x, (1, 128), fmt, sf)
    pt_q, pt_s = pq.quantize(x.T, (1, 128), fmt, sf)
    assert _bit_equal(q, pq_q) and _bit_equal(s, pq_s)
    assert _bit_equal(qt, pt_q) and _bit_equal(st, pt_s)
    bq, bs = kernels.quantize_blocks_reference(x, fmt=fmt, scale_format=sf)
    pb_q, pb_s = pq.quantize(x, (128, 128), fmt, sf)
    assert _bit_equal(bq, pb_q) and _bit_equal(bs, pb_s)


def _round_up_pow2_uint32(s):
  """The former XLA-side rounding (uint32 bits, NaN by isnan), as an independent reference."""
  bits = s.view(np.uint32)
  exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).astype(np.uint32)
  return np.where(np.isnan(s), s, (exponent << 23).view(np.float32))


def test_scale_rounding_is_the_uint32_rounding_on_every_normal_inf_and_nan():
  """formats.round_up_pow2 (int32 ops, the ones that lower in Mosaic GPU) equals the uint32
  formula bit for bit: every mantissa of one binade, then every exponent with edge mantissas,
  +inf and NaNs with payloads and either sign."""
  binade = (np.arange(1 << 23, dtype=np.uint32) | np.uint32(127 << 23)).view(np.float32)
  exponents = np.arange(1, 255, dtype=np.uint32)[:, None] << 23
  mantissas = np.array([0, 1, 2, 0x400000, 0x7FFFFE, 0x7FFFFF], np.uint32)[None, :]
  edges = (exponents | mantissas).ravel().view(np.float32)
  special = np.array([0x7F800000, 0x7FC00000, 0x7F800001, 0xFFC00001, 0x7FFFFFFF],
                     np.uint32).view(np.float32)
  for s in (binade, edges, special):
    got = np.asarray(jax.jit(formats.round_up_pow2)(jnp.asarray(s)))
    np.testing.assert_array_equal(got.view(np.uint32), _round_up_pow2_uint32(s).view(np.uint32))


def test_kernels_share_the_format_rules_of_precision_formats():
  """One owner: the kernels' quantizer calls precision.formats' rules, and the kernels import
  nothing of the package but precision.formats and their own modules."""
  assert quantize.scale_from_amax is formats.scale_from_amax
  assert quantize.abs_bits is formats.abs_bits
  assert not hasattr(quantize, "FORMATS") and not hasattr(quantize, "SCALE_FORMATS")
  pq = importlib.import_module("infir2_jax.precision.quantize")
  assert pq.abs_bits is formats.abs_bits
  folder = os.path.dirname(kernels.__file__)
  for name in sorted(os.listdir(folder)):
    if not name.endswith(".py"):
      continue
    with open(os.path.join(folder, name)) as f:
      tree = ast.parse(f.read())
    imported = [n.module if isinstance(n, ast.ImportFrom) else a.name
                for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in (n.names if isinstance(n, ast.Import) else [n])]
    ours = [m for m in imported if m and m.startswith("infir2_jax")]
    for module in ours:
      assert module in ("infir2_jax.precision", "infir2_jax.precision.formats") or \
          module.startswith("infir2_jax.precision.kernels"), (name, module)
    for node in ast.walk(tree):  # "from infir2_jax.precision import X": X must be formats
      if isinstance(node, ast.ImportFrom) and node.module == "infir2_jax.precision":
        assert [a.name for a in node.names] == ["formats"], (name, ast.dump(node))


def test_quantize_rejects_bad_input():
  x = jnp.ones((128, 128), jnp.bfloat16)
  with pytest.raises(ValueError, match="unknown FP8 format 'e3m4'"):
    kernels.quantize_tiles(x, fmt="e3m4")
  with pytest.raises(ValueError, match="unknown scale format 'e8m0'"):
    kernels.quantize_blocks(x, scale_format="e8m0")
  with pytest.raises(ValueError, match="bfloat16"):
    kernels.quantize_tiles(x.astype(jnp.float32))
  with pytest.raises(ValueError, match="2-D"):
    kernels.quantize_tiles(jnp.ones((2, 64, 128), jnp.bfloat16), with_transpose=True)


# --- Lowering for Hopper (abstract H100): shared memory and primitive coverage. ---

def _lower_on_h100(f, *specs):
  mesh = jax.sharding.AbstractMesh(
      (1,), ("x",), abstract_device=jax.sharding.AbstractDevice(
          device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu"))
  with jax.sharding.use_abstract_mesh(mesh):
    return jax.jit(f).trace(*specs).lower(lowering_platforms=("cuda",))


def _gemm_specs(m, n, k, kind):
  kb = -(-k // 128)
  rows = n if kind == "row" else -(-n // 128)
  return (jax.ShapeDtypeStruct((m, k), E4M3), jax.ShapeDtypeStruct((m, kb), jnp.float32),
          jax.ShapeDtypeStruct((n, k), E4M3), jax.ShapeDtypeStruct((rows, kb), jnp.float32))


LOWERING_CONFIGS = [
    tuning.DEFAULT_CONFIG,
    tuning.TuningConfig(max_concurrent_steps=5),
    tuning.TuningConfig(tile_n=192, max_concurrent_steps=4),
    tuning.TuningConfig(compute_wgs=3, max_concurrent_steps=6, epi_n=64),
    tuning.TuningConfig(compute_wgs=1, max_concurrent_steps=6, epi_n=128),
    tuning.TuningConfig(tile_n=192, max_concurrent_steps=4, scales_first=True),
]


@pytest.mark.parametrize("config", LOWERING_CONFIGS, ids=str)
def test_gemm_lowers_for_hopper(config):
  for shape, kind, out_dtype in (((8192, 8192, 8192), "block", jnp.bfloat16),
                                 ((1536, 256, 16384), "row", jnp.float32),  # split-K
                                 ((1000, 1544, 1000), "block", jnp.bfloat16)):
    f = lambda *a: kernels.block_scaled_matmul(*a, out_dtype=out_dtype, config=config)
    text = _lower_on_h100(f, *_gemm_specs(*shape, kind)).as_text()
    assert "mosaic_gpu" in text
    # The kernel is named after its padded problem and config (profiles give in-step rates).
    m, n, k = shape
    named = gemm.parse_gemm_kernel_name(text)
    assert named is not None and named["tile_n"] == config.tile_n, named
    assert (named["m"], named["n"], named["k"]) == (-(-m // 8) * 8, -(-n // 64) * 64,
                                                  -(-k // 128) * 128), (shape, named)
    assert named["split_k"] >= (2 if shape == (1536, 256, 16384) else 1)


def _xla_ops(text):
  """The stablehlo ops of a lowered module's main function, custom calls aside."""
  import re
  return {op for op in re.findall(r"= stablehlo\.(\w+)", text) if op != "custom_call"}


def test_kernel_layout_scales_need_no_xla_ops_on_aligned_shapes():
  """With scales in the kernel's layout an aligned GEMM lowers to the custom call alone;
  block_scaled_matmul adds the layout ops (a transpose, and a broadcast for 128x128 blocks)
  that cost 1-2 us each on the H200 (benchmarks/NOTES_kernels.md)."""
  m, n, k = 16384, 1536, 256
  specs = _gemm_specs(m, n, k, "block")
  kb = k // 128
  native = (specs[0], specs[2], kernels.KernelScales(
      jax.ShapeDtypeStruct((kb, m), jnp.float32), jax.ShapeDtypeStruct((kb, n), jnp.float32),
      "block"))
  text = _lower_on_h100(lambda a, b, s: kernels.matmul_kernel_scales(a, b, s), *native).as_text()
  # [1, M, N] -> [M, N] is a reshape that XLA makes a bitcast (no kernel).
  assert "mosaic_gpu" in text and _xla_ops(text) <= {"reshape"}, _xla_ops(text)
  text = _lower_on_h100(lambda *a: kernels.block_scaled_matmul(*a), *specs).as_text()
  assert "transpose" in _xla_ops(text)


def test_cross_tile_pipeline_rule():
  """Auto (None) carries the pipeline across tiles on short K, or where the depth does not
  shrink; forcing it where it cannot work names the reason."""
  resolve = tuning.resolve_cross_tile
  k_dgrad = resolve(tuning.DEFAULT_CONFIG, work_items=128 * 12, ctas=132, k_steps=2)
  assert k_dgrad.cross_tile and k_dgrad.max_concurrent_steps == 2
  fprop = resolve(tuning.DEFAULT_CONFIG, work_items=128 * 70, ctas=132, k_steps=12)
  assert fprop.cross_tile and fprop.max_concurrent_steps == 6
  # 8192^3: 64 K blocks; carrying it would cut the depth from 6 to 4 stages.
  square = resolve(tuning.DEFAULT_CONFIG, work_items=64 * 64, ctas=132, k_steps=64)
  assert not square.cross_tile and square.max_concurrent_steps == 6
  few_tiles = resolve(tuning.DEFAULT_CONFIG, work_items=200, ctas=132, k_steps=12)
  assert not few_tiles.cross_tile
  assert not resolve(tuning.DEFAULT_CONFIG, 5000, 132, 1).cross_tile  # K = 128
  off = resolve(tuning.TuningConfig(cross_tile=False), 5000, 132, 12)
  assert not off.cross_tile and off.max_concurrent_steps == 4
  with pytest.raises(ValueError, match="2 tiles per CTA"):
    resolve(tuning.TuningConfig(cross_tile=True), work_items=200, ctas=132, k_steps=12)


def test_split_k_rule():
  """Explicit splits need not divide the K blocks (the last one overhangs K), but none may be
  empty; the cost model picks dividing splits only (a ragged one measured slower)."""
  assert tuning.split_k_blocks(128, 5) == 26  # 4 x 26 + 24
  assert tuning.split_k_blocks(7, 4) == 2
  with pytest.raises(ValueError, match="last split empty"):
    tuning.split_k_blocks(6, 4)  # 2 blocks per split: the 4th gets none
  kv_wgrad = tuning.choose_split_k(1536, 256, 16384, tuning.DEFAULT_CONFIG, num_sms=132)
  assert kv_wgrad == 4  # 96 work items of 32 K blocks: one round on 132 SMs
  assert tuning.choose_split_k(8192, 8192, 8192, tuning.DEFAULT_CONFIG, num_sms=132) == 1


def test_fit_stages_widens_the_epilogue_where_it_fits_and_caps_the_depth():
  whole = tuning.fit_stages(tuning.TuningConfig(tile_n=192, max_concurrent_steps=2),
                            jnp.bfloat16)
  assert (whole.epi_n, whole.max_concurrent_steps) == (192, 2)
  assert tuning.fit_stages(tuning.DEFAULT_CONFIG, jnp.bfloat16).max_concurrent_steps == 6
  # Three compute warpgroups: 192-row A tiles leave room for 4 stages of 6.
  three = dataclasses.replace(tuning.DEFAULT_CONFIG, compute_wgs=3)
  assert tuning.fit_stages(three, jnp.bfloat16).max_concurrent_steps == 4
  # Without an epi_n, a tile too wide for a deep pipeline gets a narrower epilogue.
  narrowed = tuning.fit_stages(tuning.TuningConfig(tile_n=256, max_concurrent_steps=5),
                               jnp.float32)
  assert (narrowed.epi_n, narrowed.max_concurrent_steps) == (32, 4)


def test_gemm_cross_tile_lowers_for_hopper(monkeypatch):
  """The 1.5B's k/v dgrad (K=256), gate fprop and k fprop (K=1536) build with the carried
  pipeline; k fprop's 256 tiles go to 128 CTAs of two (not 132, 8 of them with one)."""
  seen = []
  resolve = gemm.resolve_cross_tile
  monkeypatch.setattr(gemm, "resolve_cross_tile",
                      lambda *a: (seen.append(resolve(*a)), seen[-1])[1])
  for shape in ((16384, 1536, 256), (16384, 8960, 1536), (16384, 256, 1536)):
    text = _lower_on_h100(lambda *a: gemm.block_scaled_matmul(*a),
                          *_gemm_specs(*shape, "block")).as_text()
    assert "mosaic_gpu" in text
  assert [c.cross_tile for c in seen] == [True, True, True], seen


def test_gemm_pads_arrays_smaller_than_one_tile():
  """On the H200 an [8, 128] x [64, 128] problem read through a 128-row TMA box gave all
  zeros; such operands are padded to one whole tile before the kernel sees them."""
  text = _lower_on_h100(lambda *a: gemm.block_scaled_matmul(*a),
                        *_gemm_specs(8, 64, 128, "block")).as_text()
  named = gemm.parse_gemm_kernel_name(text)
  assert (named["m"], named["n"], named["k"]) == (128, 128, 128), named


def test_gemm_stage_cap_is_needed_and_sufficient(monkeypatch):
  too_deep = tuning.TuningConfig(tile_n=256, max_concurrent_steps=8)
  capped = tuning.fit_stages(too_deep, jnp.bfloat16)
  assert 2 <= capped.max_concurrent_steps < 8
  specs = _gemm_specs(1024, 1024, 1024, "block")
  _lower_on_h100(lambda *a: gemm.block_scaled_matmul(*a, config=too_deep), *specs)
  one_more = dataclasses.replace(capped, max_concurrent_steps=capped.max_concurrent_steps + 1)
  monkeypatch.setattr(gemm, "fit_stages", lambda config, out_dtype: config)
  with pytest.raises(ValueError, match="shared memory"):
    _lower_on_h100(lambda *a: gemm.block_scaled_matmul(*a, config=one_more), *specs)


def test_default_config_picks_the_faster_measured_tile_width():
  """On every shape where an H200 run timed both tile widths (all else at the defaults),
  default_config picks the faster."""
  checked = 0
  for name in ("gemm_h200_run1.json", "gemm_h200_s8_variants.json"):
    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results", name)
    with open(path) as f:
      rows = json.load(f)["rows"]
    for row in rows:
      by_width = {}
      for config, timing in row["ours_by_config"].items():
        if "tflops" not in timing:
          continue
        if config.startswith("TuningConfig("):  # run 1: the two widths, spelled out
          by_width[192 if "tile_n=192" in config else 128] = timing["tflops"]
        elif config == "None":  # session 8: the default then, 128 on these shapes
          by_width[128] = timing["tflops"]
        elif "tile_n=192" in config:
          by_width[192] = timing["tflops"]
      if len(by_width) < 2:
        continue
      faster = max(by_width, key=by_width.get)
      picked = tuning.default_config(row["M"], row["N"], row["K"], b_scale=row["b_scale"]).tile_n
      assert picked == faster, (name, row["label"], by_width, picked)
      checked += 1
  assert checked >= 23  # 16 shapes of run 1, 7 of session 8 (3584x18944x16384 among them)


def test_default_config_picks_the_faster_measured_warpgroup_count():
  """Where an H200 run timed two and three compute warpgroups on the same shape (64x128
  tiles, all else at the defaults), default_config picks the faster. Session 10's first run
  timed three as a variant of the two-warpgroup default of the time; the later runs timed two
  as a variant of the three-warpgroup default."""
  checked = 0
  results = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results")
  for name in ("gemm_h200_s10_compute_wgs.json", "gemm_h200_s10_1p5b.json",
               "gemm_h200_s10_7b.json"):
    with open(os.path.join(results, name)) as f:
      rows = json.load(f)["rows"]
    for row in rows:
      picked = tuning.default_config(row["M"], row["N"], row["K"], b_scale=row["b_scale"])
      if picked.tile_n != 128:
        continue  # 192-wide wgrad tiles: three warpgroups of them do not fit in registers
      timed = {c: t["tflops"] for c, t in row["ours_by_config"].items() if "tflops" in t}
      if name == "gemm_h200_s10_compute_wgs.json":
        by_wgs = {2: timed["None"], 3: timed["default+compute_wgs=3"]}
      else:
        by_wgs = {picked.compute_wgs: timed["None"]}
        by_wgs.update({2: t for c, t in timed.items()
                       if "compute_wgs=2" in c and picked.compute_wgs == 3})
      if len(by_wgs) < 2:
        continue
      assert picked.compute_wgs == max(by_wgs, key=by_wgs.get), (name, row["label"], by_wgs)
      checked += 1
  assert checked >= 19  # 7 + 6 + 6 shapes with both counts timed


def test_gemm_kernel_is_traced_once_per_signature(monkeypatch):
  """Every layer calls the same GEMM shapes: the kernel body is traced (and its Mosaic module
  built) once per signature, not at every call (168 calls took 49 s to lower before)."""
  traces = []
  body = gemm_body.kernel_body
  monkeypatch.setattr(gemm_body, "kernel_body",
                      lambda *a, **kw: (traces.append(1), body(*a, **kw))[1])
  gemm._gemm_kernel.cache_clear()  # built again with the counting body, dropped after
  try:
    def six_calls(a, sa, b, sb):
      return sum(kernels.block_scaled_matmul(a, sa * (i + 1), b, sb) for i in range(6))
    _lower_on_h100(six_calls, *_gemm_specs(1024, 512, 1024, "block"))
  finally:
    gemm._gemm_kernel.cache_clear()
  assert 1 <= len(traces) <= 2, len(traces)  # one trace to jaxpr, at most one more to lower


@pytest.mark.parametrize("fn,kw", [
    (kernels.quantize_tiles, dict()),
    (kernels.quantize_tiles, dict(with_transpose=True)),
    (kernels.quantize_tiles, dict(fmt="e5m2", scale_format="fp32", with_transpose=True)),
    (kernels.quantize_blocks, dict(with_transpose=True)),
])
def test_quantize_lowers_for_hopper(fn, kw):
  for shape in ((16384, 1536), (1000, 1544)):
    spec = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    text = _lower_on_h100(lambda x: fn(x, **kw), spec).as_text()
    assert "mosaic_gpu" in text
    padded = tuple(-(-d // 128) * 128 for d in shape)
    assert quantize.quantize_kernel_name(padded, fn is kernels.quantize_blocks,
                                         kw.get("with_transpose", False)) in text


@pytest.mark.parametrize("with_transpose", [False, True])
def test_quantize_normed_lowers_for_hopper(with_transpose):
  for shape in ((16384, 1536), (1000, 1544)):
    specs = (jax.ShapeDtypeStruct(shape, jnp.bfloat16),
             jax.ShapeDtypeStruct((shape[0], 1), jnp.float32),
             jax.ShapeDtypeStruct((shape[1],), jnp.float32))
    f = lambda h, inv, g: kernels.quantize_normed_tiles(h, inv, g, with_transpose=with_transpose)
    text = _lower_on_h100(f, *specs).as_text()
    padded = tuple(-(-d // 128) * 128 for d in shape)
    name = quantize.quantize_kernel_name(padded, False, with_transpose, normed=True)
    assert "mosaic_gpu" in text and name in text and "normed_tiles" in name


def _mosaic_calls_in_scanned_model_gradient(num_layers, monkeypatch):
  import dataclasses
  import re
  import flax.linen as nn
  from infir2_jax.model import ModelConfig, Qwen2
  from infir2_jax.precision import PrecisionConfig, make_dot_general_factory
  monkeypatch.setattr(kernels, "available", lambda: True)  # as on an H100
  cfg = ModelConfig(vocab_size=1024, hidden_size=256, intermediate_size=512,
                    num_layers=num_layers, num_heads=2, num_kv_heads=1, head_dim=128,
                    remat="save_dots", scan_layers=True)
  model = Qwen2(cfg, make_dot_general_factory(PrecisionConfig(recipe="infir2",
                                                              backend="pallas")))
  tokens = jax.ShapeDtypeStruct((2, 128), jnp.int32)
  params = jax.eval_shape(lambda: nn.unbox(Qwen2(dataclasses.replace(cfg, scan_layers=False))
                                           .init(jax.random.key(0), jnp.zeros((2, 128), jnp.int32))
                                           ["params"]))
  grad = jax.grad(lambda p, t: jnp.mean(model.apply({"params": p}, t).astype(jnp.float32) ** 2))
  text = _lower_on_h100(grad, params, tokens).as_text()
  return len(re.findall(r"custom_call @mosaic_gpu", text)), "stablehlo.while" in text


def test_scanned_fp8_model_gradient_lowers_for_hopper_with_one_layer_body(monkeypatch):
  """model.scan_layers with the Pallas kernels: the kernels sit in one loop body, so the
  number of Mosaic GPU calls (what the GPU compiles) does not grow with depth."""
  two, loop = _mosaic_calls_in_scanned_model_gradient(2, monkeypatch)
  four, _ = _mosaic_calls_in_scanned_model_gradient(4, monkeypatch)
  assert loop
  assert two == four >= 3 * 7  # at least fprop, dgrad and wgrad of the 7 projections
