"""CPU tests of the quantization fused into SwiGLU and its backward (kernels/fused_quantize.py):
the Mosaic GPU kernels in interpret mode against their references, the references' SwiGLU
against float64, and the kernels' lowering for Hopper."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from infir2_jax.precision import kernels
from infir2_jax.precision.kernels import fused_quantize
from tests import test_kernels as cpu


def _gu(m, f, seed=0, special=True):
  """[M, 2F] bf16 gate | up, with NaN, +-inf, zeros and subnormal-range values when special."""
  r = np.random.default_rng(seed)
  gu = (r.standard_normal((m, 2 * f)) * np.exp2(r.integers(-6, 5, (m, 1)))).astype(np.float32)
  if special:
    gu[0, 3], gu[1, f + 5], gu[2, 7] = np.nan, np.inf, -np.inf
    gu[3, :128] = 0.0                      # a zero tile of h
    gu[4, 9] = gu[4, f + 9] = 1e-30        # h underflows to a float32 subnormal
    gu[5, 200 % f] = 60.0                  # sigmoid saturates at 1
    gu[6, 11] = -90.0                      # ... and at 0 (exp overflows)
  return jnp.asarray(gu, jnp.bfloat16)


@pytest.mark.parametrize("m,f,fmt,scale_format,config", [
    (256, 256, "e4m3", "ue8m0", fused_quantize.FusedConfig(64, True)),
    # a token tail (padded to 256 rows inside)
    (200, 128, "e5m2", "fp32", fused_quantize.FusedConfig(128, False)),
    # the persistent, pipelined kernel: 3 programs for 4 blocks (uneven shares, two stages)
    (256, 256, "e4m3", "ue8m0", fused_quantize.FusedConfig(64, False, programs=3)),
])
def test_swiglu_quantize_interpret_bit_identical(m, f, fmt, scale_format, config):
  gu = _gu(m, f)
  out = kernels.swiglu_quantize(gu, fmt=fmt, scale_format=scale_format, interpret=True,
                                with_values=True, config=config)
  ref = kernels.swiglu_quantize_reference(gu, fmt=fmt, scale_format=scale_format)
  assert [o.shape for o in out[:4]] == [(m, f), (m, f // 128), (f, m), (f, -(-m // 128))]
  for o, r in zip(out, ref):
    assert o.dtype == r.dtype and cpu._bit_equal(o, r)
  assert cpu._bit_equal(out[4], fused_quantize.swiglu_reference(gu))


@pytest.mark.parametrize("m,f,fmt,scale_format,config", [
    (256, 256, "e4m3", "ue8m0", fused_quantize.FusedConfig(64, True)),
    (136, 128, "e4m3", "fp32", fused_quantize.FusedConfig(128, False)),
    # the unrolled form (session 17's kernel, over the instruction cache: kept to compare)
    (256, 128, "e4m3", "ue8m0", fused_quantize.FusedConfig(64, True, loop_outputs=False)),
    # the persistent, pipelined kernel, a token tail, 5 programs for 4 blocks (capped)
    (136, 256, "e4m3", "fp32", fused_quantize.FusedConfig(128, False, programs=5)),
    (256, 256, "e4m3", "ue8m0", fused_quantize.FusedConfig(64, False, programs=3)),
])
def test_swiglu_bwd_quantize_interpret_bit_identical(m, f, fmt, scale_format, config):
  gu = _gu(m, f, seed=1)
  dh = jnp.asarray(np.random.default_rng(2).standard_normal((m, f)) * 1e-3, jnp.bfloat16)
  out = kernels.swiglu_bwd_quantize(dh, gu, fmt=fmt, scale_format=scale_format,
                                    interpret=True, with_values=True, config=config)
  ref = kernels.swiglu_bwd_quantize_reference(dh, gu, fmt=fmt, scale_format=scale_format)
  assert [o.shape for o in out[:4]] == [(m, 2 * f), (m, 2 * f // 128), (2 * f, m),
                                        (2 * f, -(-m // 128))]
  for o, r in zip(out, ref):
    assert o.dtype == r.dtype and cpu._bit_equal(o, r)
  assert cpu._bit_equal(out[4], fused_quantize.swiglu_bwd_reference(dh, gu))


def _bf16_ulps(a, b):
  """|a - b| in units of b's bf16 spacing (finite entries)."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  spacing = np.exp2(np.floor(np.log2(np.maximum(np.abs(b), 2.0 ** -126))) - 7)
  return np.abs(a - b) / spacing


def test_swiglu_references_are_the_float64_formulas_rounded_once():
  """h and dgu: the float64 value of SwiGLU and of its derivative, rounded once to bf16
  (within one bf16 ulp where f32 rounding lands on a tie's other side; almost always exact)."""
  gu = _gu(256, 256, special=False)
  dh = jnp.asarray(np.random.default_rng(3).standard_normal((256, 256)), jnp.bfloat16)
  g64, u64 = (np.asarray(gu[:, :256], np.float64), np.asarray(gu[:, 256:], np.float64))
  s = 1.0 / (1.0 + np.exp(-g64))
  h64 = g64 * s * u64
  dgh = np.asarray(dh, np.float64)
  dg64 = dgh * u64 * (s + g64 * s * (1.0 - s))   # d/dg of g * sigmoid(g) * u
  du64 = dgh * g64 * s
  for got, want in ((fused_quantize.swiglu_reference(gu), h64),
                    (fused_quantize.swiglu_bwd_reference(dh, gu), np.concatenate([dg64, du64], 1))):
    rounded = want.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
    got = np.asarray(got, np.float64)
    assert np.mean(got == rounded) > 0.999
    assert np.max(_bf16_ulps(got, rounded)) <= 1.0


def test_fused_config_rejects_bad_values():
  with pytest.raises(ValueError, match="producer_cols"):
    fused_quantize.FusedConfig(producer_cols=32)
  with pytest.raises(ValueError, match="programs=-1"):
    fused_quantize.FusedConfig(alias_outputs=False, programs=-1)
  with pytest.raises(ValueError, match="alias_outputs=False"):
    fused_quantize.FusedConfig(programs=132)


def test_fused_quantize_rejects_bad_input():
  gu = jnp.zeros((128, 512), jnp.bfloat16)
  with pytest.raises(ValueError, match="multiple of 128"):
    kernels.swiglu_quantize(jnp.zeros((128, 320), jnp.bfloat16), interpret=True)
  with pytest.raises(ValueError, match="bfloat16"):
    kernels.swiglu_quantize(gu.astype(jnp.float32), interpret=True)
  with pytest.raises(ValueError, match="does not match"):
    kernels.swiglu_bwd_quantize(jnp.zeros((128, 128), jnp.bfloat16), gu, interpret=True)
  with pytest.raises(ValueError, match=r"\[M, 2F\]"):
    kernels.swiglu_quantize(jnp.zeros((128, 255), jnp.bfloat16), interpret=True)


@pytest.mark.parametrize("producer", ["swiglu", "swiglu_bwd"])
@pytest.mark.parametrize("config", [fused_quantize.FusedConfig(cols, alias)
                                    for cols in (64, 128) for alias in (True, False)]
                         + [fused_quantize.FusedConfig(64, False, programs=132)], ids=str)
def test_fused_quantize_lowers_for_hopper(producer, config):
  """The 1.5B's MLP (16384 tokens, F = 8960) and a token tail: shared memory fits, every
  primitive lowers, and the kernel carries its name for profiles."""
  for m, f in ((16384, 8960), (1000, 768)):
    gu = jax.ShapeDtypeStruct((m, 2 * f), jnp.bfloat16)
    if producer == "swiglu":
      fn, specs = kernels.swiglu_quantize, (gu,)
    else:
      fn, specs = kernels.swiglu_bwd_quantize, (jax.ShapeDtypeStruct((m, f), jnp.bfloat16), gu)
    text = cpu._lower_on_h100(lambda *a: fn(*a, config=config), *specs).as_text()
    assert "mosaic_gpu" in text
    assert fused_quantize.fused_kernel_name(producer, -(-m // 128) * 128, f) in text


def test_backward_bisect_benchmark_runs_its_stand_ins_in_interpret_mode(tmp_path):
  """benchmarks/fused_bwd_bisect.py (the GPU run that times the backward's pieces): every
  stand-in producer builds and runs, and its backward row is the reference bit for bit."""
  import json
  import os
  import sys
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
  import fused_bwd_bisect
  out = tmp_path / "bisect.json"
  fused_bwd_bisect.main(["--shape=256x256", "--interpret", f"--out={out}"])
  rows = json.loads(out.read_text())["rows"]
  assert set(rows) == set(fused_bwd_bisect.variants(256))
  assert not [name for name, row in rows.items() if "error" in row], rows
  assert rows["bwd"]["matches_reference"] and rows["bwd_noalias"]["matches_reference"]
  assert rows["bwd_unrolled"]["matches_reference"]
  assert rows["bwd"]["differing_elements"] == [0] * 4   # dgate, dup and their wgrad layouts
