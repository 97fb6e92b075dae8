"""GPU tests of infir2_jax.precision.kernels (Hopper only): compiled kernels vs float64 / XLA references.

Run on the device machine: PYTHONPATH=. python3 -m pytest -m gpu tests/test_kernels_gpu.py
"""
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infir2_jax.precision import kernels
from infir2_jax.precision.kernels import gemm
from infir2_jax.precision.kernels import tuning
from tests import test_kernels as cpu

pytestmark = pytest.mark.gpu

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
CONFIGS = [
    tuning.DEFAULT_CONFIG,
    tuning.TuningConfig(split_k=2),
    tuning.TuningConfig(max_concurrent_steps=5, grid_tile_width=16),
    tuning.TuningConfig(tile_n=192, max_concurrent_steps=4, grid_minor_dim="m"),
    tuning.TuningConfig(compute_wgs=3, max_concurrent_steps=4, epi_n=64),
    tuning.TuningConfig(compute_wgs=3, max_concurrent_steps=4, epi_n=128, split_k=2),
    tuning.TuningConfig(compute_wgs=1, max_concurrent_steps=6),
]
# Hopper's FP8 wgmma keeps a reduced-precision sum inside a 128-wide K block (DeepSeek-V3
# reports ~14 bits), so an f32 output is ~1e-4 off the float64 reference (measured 1.3e-4
# on these inputs with every config); bf16 rounding (~2e-3) dominates a bf16 output.
F32_TOL, BF16_TOL = 1e-3, 1e-2


@pytest.fixture(autouse=True)
def _needs_hopper():
  if not kernels.available():
    pytest.skip("needs a Hopper GPU with Mosaic GPU")


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("m,n,k,kind", [(1024, 1536, 2048, "block"), (520, 264, 1000, "row")])
def test_gemm_matches_float64(config, m, n, k, kind):
  args = cpu._operands(m, n, k, kind, seed=m + k)
  ref = cpu._numpy_f64(*args)
  f = jax.jit(lambda *a: kernels.block_scaled_matmul(*a, out_dtype=jnp.float32, config=config))
  out = f(*args)
  assert not bool(jnp.any(jnp.isnan(out)))
  assert cpu._rel_err(out, ref) < F32_TOL
  again = f(*args)  # a moving result would mean a race
  assert bool(jnp.all(out == again))


@pytest.mark.parametrize("m,n,k,kind", [(16384, 1536, 256, "block"), (4104, 2000, 1000, "row"),
                                        (16392, 264, 1536, "block")])
def test_gemm_cross_tile_matches_float64_and_the_per_tile_pipeline(m, n, k, kind):
  """One pipeline across each CTA's tiles: same sums as without it, bit for bit."""
  args = cpu._operands(m, n, k, kind, seed=m + n)
  ref = cpu._numpy_f64(*args)
  outs = {}
  for carried in (True, False):
    cfg = tuning.TuningConfig(max_concurrent_steps=6, epi_n=64, cross_tile=carried)
    f = jax.jit(lambda *a, cfg=cfg: kernels.block_scaled_matmul(*a, out_dtype=jnp.float32,
                                                                 config=cfg))
    outs[carried] = f(*args)
    assert not bool(jnp.any(jnp.isnan(outs[carried])))
    assert cpu._rel_err(outs[carried], ref) < F32_TOL
    assert bool(jnp.all(f(*args) == outs[carried]))  # a moving result would mean a race
  assert bool(jnp.all(outs[True] == outs[False]))


@pytest.mark.parametrize("m,n,k,kind,split_k", [(1536, 256, 16384, "row", 5),
                                                (520, 264, 1000, "row", 3)])
def test_gemm_ragged_split_k_matches_float64_and_even_splits(m, n, k, kind, split_k):
  """A split that does not divide the K blocks (the last one overhangs K and is read as
  zeros) gives the sums of a dividing split, to f32 rounding of the partial order."""
  args = cpu._operands(m, n, k, kind, seed=m + k)
  ref = cpu._numpy_f64(*args)
  outs = []
  for s in (split_k, 2):
    cfg = tuning.TuningConfig(max_concurrent_steps=4, epi_n=64, split_k=s)
    out = jax.jit(lambda *a, cfg=cfg: kernels.block_scaled_matmul(*a, out_dtype=jnp.float32,
                                                                  config=cfg))(*args)
    assert not bool(jnp.any(jnp.isnan(out)))
    assert cpu._rel_err(out, ref) < F32_TOL
    outs.append(out)
  assert cpu._rel_err(outs[0], np.asarray(outs[1], np.float64)) < 1e-6


@pytest.mark.parametrize("m,n,k,kind", [(16384, 1536, 256, "block"), (1536, 256, 16384, "row"),
                                        (4104, 2000, 1000, "block")])
def test_matmul_kernel_scales_is_block_scaled_matmul_bit_for_bit(m, n, k, kind):
  """Scales handed over in the kernel's layout: the same output as the canonical entry."""
  args = cpu._operands(m, n, k, kind, seed=m + 2 * n)
  a, _, b, _ = args
  want = jax.jit(lambda *x: kernels.block_scaled_matmul(*x))(*args)
  scales = jax.jit(kernels.kernel_scales)(*args)
  got = jax.jit(lambda a, b, s: kernels.matmul_kernel_scales(a, b, s))(a, b, scales)
  assert cpu._rel_err(want, cpu._numpy_f64(*args)) < BF16_TOL
  if kind == "row":  # split K: partials summed by XLA, in the same order both ways
    assert cpu._rel_err(got, np.asarray(want, np.float64)) < 1e-6
  else:
    assert bool(jnp.all(got == want))


@pytest.mark.parametrize("m,n,k,kind", [(16384, 1536, 256, "block"), (4104, 2000, 1000, "row")])
def test_gemm_epilogue_chunks_are_bit_identical(m, n, k, kind):
  """One staging buffer per warpgroup, reused by every chunk: 32-, 64- and 128-wide chunks
  give the same bf16 output bit for bit, and the same on a rerun (a store still reading the
  buffer while the next chunk overwrites it would show)."""
  args = cpu._operands(m, n, k, kind, seed=m + n + 1)
  ref = cpu._numpy_f64(*args)
  outs = {}
  for epi_n in (128, 64, 32):
    cfg = tuning.TuningConfig(max_concurrent_steps=4, epi_n=epi_n)
    f = jax.jit(lambda *a, cfg=cfg: kernels.block_scaled_matmul(*a, config=cfg))
    outs[epi_n] = f(*args)
    assert cpu._rel_err(outs[epi_n], ref) < BF16_TOL
    assert bool(jnp.all(f(*args) == outs[epi_n]))
  assert bool(jnp.all(outs[128] == outs[64])) and bool(jnp.all(outs[128] == outs[32]))


@pytest.mark.parametrize("a_dtype,b_dtype,out_dtype", [
    (E4M3, E4M3, jnp.bfloat16), (E4M3, E5M2, jnp.bfloat16), (E5M2, E5M2, jnp.float32)])
@pytest.mark.parametrize("m,n,k,kind", [(8, 64, 128, "block"), (4096, 4096, 4096, "block"),
                                        (2000, 3000, 1040, "row")])
def test_gemm_dtypes_and_tails(a_dtype, b_dtype, out_dtype, m, n, k, kind):
  args = cpu._operands(m, n, k, kind, seed=7, a_dtype=a_dtype, b_dtype=b_dtype)
  out = jax.jit(lambda *a: kernels.block_scaled_matmul(*a, out_dtype=out_dtype))(*args)
  assert out.shape == (m, n) and out.dtype == out_dtype
  assert cpu._rel_err(out, cpu._numpy_f64(*args)) < (BF16_TOL if out_dtype == jnp.bfloat16 else F32_TOL)


@pytest.mark.parametrize("m,k", [(256, 384), (1000, 1544), (4096, 1536)])
@pytest.mark.parametrize("fmt,scale_format", [("e4m3", "ue8m0"), ("e5m2", "fp32"),
                                              ("e4m3", "fp32")])
def test_quantize_tiles_bit_identical_on_gpu(m, k, fmt, scale_format):
  x = cpu._special_input(m, k, seed=m)
  out = jax.jit(lambda x: kernels.quantize_tiles(
      x, fmt=fmt, scale_format=scale_format, with_transpose=True))(x)
  ref = jax.jit(lambda x: kernels.quantize_tiles_reference(
      x, fmt=fmt, scale_format=scale_format, with_transpose=True))(x)
  for o, r in zip(out, ref):
    assert cpu._bit_equal(o, r)
  q, s = jax.jit(lambda x: kernels.quantize_tiles(x, fmt=fmt, scale_format=scale_format))(x)
  assert cpu._bit_equal(q, ref[0]) and cpu._bit_equal(s, ref[1])
  try:
    pq = importlib.import_module("infir2_jax.precision.quantize")
  except ImportError as e:
    pytest.skip(f"infir2_jax.precision.quantize not importable: {e}")
  pq_q, pq_s = jax.jit(lambda x: pq.quantize(x, (1, 128), fmt, scale_format))(x)
  assert cpu._bit_equal(out[0], pq_q) and cpu._bit_equal(out[1], pq_s)


@pytest.mark.parametrize("m,k", [(256, 384), (1000, 1544), (4096, 1536)])
@pytest.mark.parametrize("fmt,scale_format", [("e4m3", "ue8m0"), ("e5m2", "fp32")])
def test_quantize_normed_tiles_bit_identical_on_gpu(m, k, fmt, scale_format):
  """The normed kernel against XLA's RMSNorm written out in bf16, then quantize_tiles (and
  its reference), on this GPU. The reference's norm compiles with xla_allow_excess_precision
  off, so it keeps both bf16 roundings whatever XLA:GPU fuses (deviceless, its RMSNorm
  fusion keeps them either way). Session 30's failures here were the kernel's own gamma:
  a convert pair that XLA:GPU folded (quantize._rounded_to)."""
  h, inv, gamma = cpu._norm_inputs(m, k, seed=m)
  kw = dict(fmt=fmt, scale_format=scale_format, with_transpose=True)
  out = jax.jit(lambda h, i, g: kernels.quantize_normed_tiles(h, i, g, **kw))(h, inv, gamma)
  y = jax.jit(kernels.quantize.rms_normed_reference,
              compiler_options={"xla_allow_excess_precision": False})(h, inv, gamma)
  separate = jax.jit(lambda y: kernels.quantize_tiles(y, **kw))(y)
  ref = jax.jit(lambda y: kernels.quantize_tiles_reference(y, **kw))(y)
  for name, o, a, r in zip(("q", "s", "qt", "st"), out, separate, ref):
    frac = float(jnp.mean((o.astype(jnp.float32) != r.astype(jnp.float32))))
    assert cpu._bit_equal(o, a) and cpu._bit_equal(o, r), f"{name}: {frac:.2e} of it differs"


@pytest.mark.parametrize("r,c", [(1536, 8960), (200, 312)])
@pytest.mark.parametrize("scale_format", ["ue8m0", "fp32"])
def test_quantize_blocks_bit_identical_on_gpu(r, c, scale_format):
  w = cpu._special_input(r, c, seed=c)
  q, s, qt = jax.jit(lambda w: kernels.quantize_blocks(
      w, scale_format=scale_format, with_transpose=True))(w)
  rq, rs = jax.jit(lambda w: kernels.quantize_blocks_reference(w, scale_format=scale_format))(w)
  assert cpu._bit_equal(q, rq) and cpu._bit_equal(s, rs) and cpu._bit_equal(qt, rq.T)


def test_quantize_then_gemm_end_to_end():
  """fprop of a linear: kernels' quantizers feeding the kernel GEMM, vs float64."""
  kx, kw = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (2048, 1536), jnp.bfloat16)
  w = jax.random.normal(kw, (1536, 896), jnp.bfloat16)  # [K, N] as the model stores it

  @jax.jit
  def fprop(x, w):
    a_q, a_s = kernels.quantize_tiles(x)
    wt_q, wt_s = kernels.quantize_blocks(w.T)
    return kernels.block_scaled_matmul(a_q, a_s, wt_q, wt_s, out_dtype=jnp.float32), (a_q, a_s, wt_q, wt_s)
  out, ops = fprop(x, w)
  assert cpu._rel_err(out, cpu._numpy_f64(*ops)) < F32_TOL
  exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  assert cpu._rel_err(out, exact) < 0.1  # quantization error of e4m3, for scale


@pytest.mark.parametrize("remat", ["save_dots", "save_dots_fp8"])
def test_scanned_remat_step_runs_each_fp8_gemm_once(remat):
  """The compiled gradient of a scanned, rematerialized model holds 12 FP8 GEMMs per layer
  body (the fused q|k|v, o and the fused MLP's gate|up and down: 4 fprop + 4 dgrad + 4
  wgrad), none cloned into a dynamic-slice fusion. Before the fprop outputs passed an
  optimization barrier, XLA:GPU cloned the saved ones (27 of the 21 GEMMs of seven
  projections)."""
  import dataclasses
  import re
  import flax.linen as nn
  from infir2_jax.model import ModelConfig, Qwen2
  from infir2_jax.precision import PrecisionConfig, make_dot_general_factory
  cfg = ModelConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_layers=2,
                    num_heads=2, num_kv_heads=1, head_dim=128, remat=remat, scan_layers=True)
  model = Qwen2(cfg, make_dot_general_factory(PrecisionConfig(recipe="infir2",
                                                              backend="pallas")))
  tokens = jnp.zeros((2, 1024), jnp.int32)
  params = nn.unbox(Qwen2(dataclasses.replace(cfg, scan_layers=False))
                    .init(jax.random.key(0), tokens)["params"])
  grad = jax.grad(lambda p, t: jnp.mean(model.apply({"params": p}, t).astype(jnp.float32) ** 2))
  text = jax.jit(grad).lower(params, tokens).compile().as_text()
  calls = [l for l in text.splitlines() if "custom-call(" in l and gemm.KERNEL_NAME in l]
  assert len(calls) == 12, len(calls)
  fused = re.findall(r"%dynamic-slice-fusion[\w.]* \(.*?\n}\n", text, re.S)
  assert not any(gemm.KERNEL_NAME in f for f in fused)


def _ulp_mismatch(values, ref):
  """(fraction of entries that differ, max difference in bf16 ulps of ref) of two bf16 arrays."""
  v, r = np.asarray(values, np.float64), np.asarray(ref, np.float64)
  both = np.isfinite(v) & np.isfinite(r)
  spacing = np.exp2(np.floor(np.log2(np.maximum(np.abs(r[both]), 2.0 ** -126))) - 7)
  same_nonfinite = np.all((v[~both] == r[~both]) | (np.isnan(v[~both]) & np.isnan(r[~both])))
  return (float(np.mean(v[both] != r[both])), float(np.max(np.abs(v[both] - r[both]) / spacing)),
          bool(same_nonfinite))


@pytest.mark.parametrize("producer", ["swiglu", "swiglu_bwd"])
@pytest.mark.parametrize("m,f,fmt,scale_format,cols,alias,programs", [
    (4096, 1536, "e4m3", "ue8m0", 64, True, 0), (1000, 768, "e4m3", "fp32", 128, False, 0),
    (512, 256, "e5m2", "ue8m0", 128, True, 0),
    # the persistent, pipelined kernel: more blocks than programs, uneven shares, a tail
    (4096, 1536, "e4m3", "ue8m0", 64, False, 132), (1000, 768, "e4m3", "fp32", 64, False, 7)])
def test_fused_quantize_on_gpu(producer, m, f, fmt, scale_format, cols, alias, programs):
  """The fused kernels quantize the values they make exactly as the reference quantizer does
  (bit for bit); those values are XLA's SwiGLU (backward) but for the last f32 bit of exp and
  division: at most one bf16 ulp, in a few entries per million."""
  from tests.test_fused_quantize import _gu
  from infir2_jax.precision.kernels import fused_quantize as fq
  gu = _gu(m, f, seed=m)
  dh = jnp.asarray(np.random.default_rng(f).standard_normal((m, f)) * 1e-2, jnp.bfloat16)
  kw = dict(fmt=fmt, scale_format=scale_format)
  config = fq.FusedConfig(cols, alias, programs=programs)
  if producer == "swiglu":
    out = jax.jit(lambda g: kernels.swiglu_quantize(g, with_values=True, config=config, **kw))(
        gu)
    ref_values = jax.jit(fq.swiglu_reference)(gu)
  else:
    out = jax.jit(lambda d, g: kernels.swiglu_bwd_quantize(d, g, with_values=True,
                                                           config=config, **kw))(dh, gu)
    ref_values = jax.jit(fq.swiglu_bwd_reference)(dh, gu)
  *quantized, values = out
  requant = jax.jit(lambda v: kernels.quantize_tiles_reference(v, with_transpose=True, **kw))(
      values)
  for o, r in zip(quantized, requant):
    assert cpu._bit_equal(o, r)
  differ, ulps, nonfinite_equal = _ulp_mismatch(values, ref_values)
  print(f"{producer} {m}x{f}: {differ:.2e} of values differ from XLA's, max {ulps} ulp")
  assert nonfinite_equal and ulps <= 1.0 and differ < 1e-4


def test_fused_mlp_pallas_matches_xla_path_on_gpu():
  """The fused MLP's kernel path against its XLA path (the kernels' references) on the same
  operands: y and every gradient closer to each other than either is to BF16 (FP8's own
  error), by a margin: the two differ only where rounding flips a quantized value."""
  from infir2_jax.precision import make_gated_mlp
  k = jax.random.split(jax.random.key(3), 5)
  m, d, f = 4096, 1536, 4480
  x = jax.random.normal(k[0], (m, d), jnp.bfloat16)
  wg, wu = (jax.random.normal(kk, (d, f), jnp.bfloat16) * 0.03 for kk in k[1:3])
  wd = jax.random.normal(k[3], (f, d), jnp.bfloat16) * 0.03
  ct = jax.random.normal(k[4], (m, d), jnp.float32)
  from infir2_jax.precision import swiglu
  bf16 = lambda x, wg, wu, wd: swiglu(x @ wg, x @ wu) @ wd
  results = {}
  for name, mlp in (("pallas", make_gated_mlp("infir2", backend="pallas")),
                    ("xla", make_gated_mlp("infir2", backend="xla")), ("bf16", bf16)):
    loss = lambda *a, mlp=mlp: jnp.sum(mlp(*a).astype(jnp.float32) * ct)
    results[name] = jax.jit(lambda *a, mlp=mlp, loss=loss: (
        mlp(*a), *jax.grad(loss, argnums=(0, 1, 2, 3))(*a)))(x, wg, wu, wd)
  between = [cpu._rel_err(a, np.asarray(b, np.float64))
             for a, b in zip(results["pallas"], results["xla"])]
  fp8 = [cpu._rel_err(a, np.asarray(b, np.float64))
         for a, b in zip(results["xla"], results["bf16"])]
  print("pallas vs xla (y, dx, dWg, dWu, dWd):", between, "xla vs bf16:", fp8)
  assert all(b < 0.5 * f for b, f in zip(between, fp8)), (between, fp8)
