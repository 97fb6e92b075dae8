"""CPU tests of the Triton quantizers (kernels/quantize_triton.py): the kernel bodies in
interpret mode against the pure-jnp references bit for bit, their errors, and their lowering
to Triton for a Hopper GPU."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infir2_jax.precision import kernels
from infir2_jax.precision.kernels import fused_quantize
from infir2_jax.precision.kernels import quantize_triton as qt
from tests import test_kernels as cpu
from tests.test_fused_quantize import _gu


def _dh(m, f, seed=2):
  return jnp.asarray(np.random.default_rng(seed).standard_normal((m, f)) * 1e-3, jnp.bfloat16)


def _assert_bit_equal(out, ref):
  assert len(out) == len(ref)
  for i, (o, r) in enumerate(zip(out, ref)):
    assert o.shape == r.shape and o.dtype == r.dtype, (i, o.shape, r.shape, o.dtype, r.dtype)
    assert cpu._bit_equal(o, r), i


@pytest.mark.parametrize("m,k,fmt,scale_format,with_transpose", [
    (200, 312, "e4m3", "ue8m0", True),     # token and K tails, zero and subnormal tiles
    (200, 256, "e5m2", "fp32", True),
    (128, 264, "e4m3", "fp32", False),
])
def test_quantize_tiles_triton_interpret_bit_identical(m, k, fmt, scale_format, with_transpose):
  x = cpu._special_input(m, k, seed=m + k)
  kw = dict(fmt=fmt, scale_format=scale_format, with_transpose=with_transpose)
  out = qt.quantize_tiles_triton(x, interpret=True, **kw)
  _assert_bit_equal(out, kernels.quantize_tiles_reference(x, **kw))


def test_quantize_tiles_triton_default_path_and_leading_dims():
  """interpret=None on the CPU runs the interpreter (platform_dependent's default branch);
  leading dims fold into the token axis as in the Mosaic kernel."""
  x = cpu._special_input(136, 128, seed=5).reshape(2, 68, 128)
  out = jax.jit(qt.quantize_tiles_triton)(x)
  _assert_bit_equal(out, kernels.quantize_tiles_reference(x))
  assert out[1].shape == (2, 68, 1)


def test_all_zero_input_gives_zero_q_and_the_floor_scale():
  x = jnp.zeros((130, 128), jnp.bfloat16)
  q, s, qt_, st = qt.quantize_tiles_triton(x, with_transpose=True, interpret=True)
  assert not np.any(np.asarray(q.astype(jnp.float32))) and not np.any(
      np.asarray(qt_.astype(jnp.float32)))
  assert np.all(np.asarray(s) == np.float32(2.0 ** -126))
  assert np.all(np.asarray(st) == np.float32(2.0 ** -126))


@pytest.mark.parametrize("m,f,fmt,scale_format", [
    (200, 256, "e4m3", "ue8m0"),           # a token tail (padded to 256 inside)
    (128, 128, "e5m2", "fp32"),
])
def test_swiglu_quantize_triton_interpret_bit_identical(m, f, fmt, scale_format):
  gu = _gu(m, f, seed=m)
  kw = dict(fmt=fmt, scale_format=scale_format)
  out = qt.swiglu_quantize_triton(gu, interpret=True, with_values=True, **kw)
  assert [o.shape for o in out[:4]] == [(m, f), (m, f // 128), (f, m), (f, -(-m // 128))]
  _assert_bit_equal(out[:4], kernels.swiglu_quantize_reference(gu, **kw))
  assert cpu._bit_equal(out[4], fused_quantize.swiglu_reference(gu))


@pytest.mark.parametrize("m,f,fmt,scale_format", [
    (200, 256, "e4m3", "ue8m0"),
    (136, 128, "e5m2", "fp32"),
])
def test_swiglu_bwd_quantize_triton_interpret_bit_identical(m, f, fmt, scale_format):
  gu, dh = _gu(m, f, seed=1), _dh(m, f)
  kw = dict(fmt=fmt, scale_format=scale_format)
  out = qt.swiglu_bwd_quantize_triton(dh, gu, interpret=True, with_values=True, **kw)
  assert [o.shape for o in out[:4]] == [(m, 2 * f), (m, 2 * f // 128), (2 * f, m),
                                        (2 * f, -(-m // 128))]
  _assert_bit_equal(out[:4], kernels.swiglu_bwd_quantize_reference(dh, gu, **kw))
  assert cpu._bit_equal(out[4], fused_quantize.swiglu_bwd_reference(dh, gu))


def test_the_tests_can_fail():
  """One flipped input sign flips an output: bit equality is not vacuous."""
  gu = _gu(128, 128, seed=3, special=False)
  out = qt.swiglu_quantize_triton(gu, interpret=True)
  ref = kernels.swiglu_quantize_reference(gu.at[7, 128 + 9].multiply(-1))  # up of h[7, 9]
  assert not all(cpu._bit_equal(o, r) for o, r in zip(out, ref))


def test_triton_quantizers_reject_bad_input():
  x = jnp.ones((128, 128), jnp.bfloat16)
  with pytest.raises(ValueError, match="unknown FP8 format 'e3m4'"):
    qt.quantize_tiles_triton(x, fmt="e3m4")
  with pytest.raises(ValueError, match="unknown scale format 'e8m0'"):
    qt.quantize_tiles_triton(x, scale_format="e8m0")
  with pytest.raises(ValueError, match="bfloat16"):
    qt.quantize_tiles_triton(x.astype(jnp.float32))
  with pytest.raises(ValueError, match="2-D"):
    qt.quantize_tiles_triton(jnp.ones((2, 64, 128), jnp.bfloat16), with_transpose=True)
  with pytest.raises(ValueError, match="at least 2 dims"):
    qt.quantize_tiles_triton(jnp.ones((128,), jnp.bfloat16))
  gu = jnp.ones((128, 512), jnp.bfloat16)
  with pytest.raises(ValueError, match="bfloat16"):
    qt.swiglu_quantize_triton(gu.astype(jnp.float32))
  with pytest.raises(ValueError, match="multiple of 128"):
    qt.swiglu_quantize_triton(jnp.ones((128, 192), jnp.bfloat16))
  with pytest.raises(ValueError, match=r"expected \[M, 2F\]"):
    qt.swiglu_quantize_triton(jnp.ones((128, 255), jnp.bfloat16))
  with pytest.raises(ValueError, match="does not match"):
    qt.swiglu_bwd_quantize_triton(jnp.ones((128, 128), jnp.bfloat16), gu)
  with pytest.raises(ValueError, match="bfloat16"):
    qt.swiglu_bwd_quantize_triton(jnp.ones((128, 256), jnp.float16), gu)
  with pytest.raises(ValueError, match="num_warps"):
    qt.TritonConfig(num_warps=6)


@pytest.mark.parametrize("name,shapes", [
    ("quantize_t", [(1000, 1544)]), ("swiglu", [(1000, 512)]),
    ("swiglu_bwd", [(1000, 256), (1000, 512)])])
def test_triton_quantizers_lower_for_hopper(name, shapes):
  """interpret=None lowered for CUDA picks the Triton kernel, named for profiles."""
  fns = {"quantize_t": lambda x: qt.quantize_tiles_triton(x, with_transpose=True),
         "swiglu": qt.swiglu_quantize_triton, "swiglu_bwd": qt.swiglu_bwd_quantize_triton}
  specs = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes]
  text = cpu._lower_on_h100(fns[name], *specs).as_text()
  assert text.count("__gpu$xla.gpu.triton") == 1
  producer = "quantize" if name == "quantize_t" else name
  width = 1664 if name == "quantize_t" else shapes[-1][1] // 2
  assert qt.kernel_name(producer, 1024, width) in text


# --- Opt-in wiring: precision.quantize_backend ---

def test_quantize_backend_config_is_validated_and_reaches_the_mlp():
  from infir2_jax.errors import ConfigError
  from infir2_jax.precision import PrecisionConfig
  from infir2_jax.precision import fused_mlp
  assert PrecisionConfig().quantize_backend == "mosaic"
  with pytest.raises(ConfigError, match="quantize_backend"):
    PrecisionConfig(quantize_backend="cuda")
  with pytest.raises(ValueError, match="quantize_backend"):
    fused_mlp.make_gated_mlp("infir2", quantize_backend="cuda")
  assert fused_mlp.fused_quantizers(kernels, "mosaic") == (
      kernels.swiglu_quantize, kernels.swiglu_bwd_quantize)
  assert fused_mlp.fused_quantizers(kernels, "triton") == (
      qt.swiglu_quantize_triton, qt.swiglu_bwd_quantize_triton)


def test_triton_quantize_backend_gives_the_same_loss_and_grads(monkeypatch):
  """The fused MLP with quantize_backend="triton", its SwiGLU quantizers made to run (the
  Triton kernels, interpreted on the CPU), against the default path (XLA on the CPU): the
  same loss and gradients, bit for bit."""
  from infir2_jax.precision import fused_mlp
  from infir2_jax.precision.factory import make_dot_general_factory
  from infir2_jax.precision import PrecisionConfig
  r = np.random.default_rng(0)
  x = jnp.asarray(r.standard_normal((136, 128)), jnp.bfloat16)
  w = [jnp.asarray(r.standard_normal(s) * 0.1, jnp.bfloat16)
       for s in ((128, 256), (128, 256), (256, 128))]

  def loss_and_grads(quantize_backend):
    mlp = make_dot_general_factory(PrecisionConfig(
        recipe="infir2", quantize_backend=quantize_backend)).gated_mlp("layers_0/mlp")
    loss = lambda x, *w: jnp.mean(mlp(x, *w).astype(jnp.float32) ** 2)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(x, *w)

  reference = loss_and_grads("mosaic")
  calls = []
  real = fused_mlp.fused_quantizers
  monkeypatch.setattr(fused_mlp, "quantizer_kernels", lambda *a, **k: kernels)  # "on Hopper"
  monkeypatch.setattr(fused_mlp, "fused_quantizers",
                      lambda k, b: calls.append(b) or real(k, b))
  triton = loss_and_grads("triton")
  assert calls == ["triton", "triton"]   # the forward's and the backward's quantizer
  for a, b in zip(jax.tree.leaves(triton), jax.tree.leaves(reference)):
    assert cpu._bit_equal(a, b)


def test_triton_quantize_backend_reaches_the_projections_x_and_dy(monkeypatch):
  """A projection's dot_general with quantize_backend="triton": its X (fprop + wgrad) and dY
  (dgrad + wgrad) tile quantizations made to run as the Triton kernel (interpreted on the
  CPU), against the default path (XLA on the CPU): the same loss and gradients, bit for bit;
  the weights' 128x128 blocks stay on their own path."""
  from infir2_jax.precision import PrecisionConfig
  from infir2_jax.precision import dot_general as dg
  from infir2_jax.precision.factory import make_dot_general_factory
  r = np.random.default_rng(1)
  x = jnp.asarray(r.standard_normal((2, 72, 256)), jnp.bfloat16)   # token tail: 144 rows
  w = jnp.asarray(r.standard_normal((256, 384)) * 0.05, jnp.bfloat16)
  dims = (((2,), (0,)), ((), ()))

  def loss_and_grads(quantize_backend):
    dot = make_dot_general_factory(PrecisionConfig(
        recipe="infir2", quantize_backend=quantize_backend))("layers_0/self_attn/q_proj")
    loss = lambda x, w: jnp.mean(dot(x, w, dims).astype(jnp.float32) ** 2)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w)

  reference = loss_and_grads("mosaic")
  real_kernels, real_quantizer = dg.quantizer_kernels, dg.tile_quantizer
  calls = []
  monkeypatch.setattr(dg, "quantizer_kernels",   # "on Hopper", for the 1x128 tiles only
                      lambda plan, x, *s, tile: (kernels if tile == (1, 128)
                                                 else real_kernels(plan, x, *s, tile=tile)))
  monkeypatch.setattr(dg, "tile_quantizer",
                      lambda k, b: calls.append(b) or real_quantizer(k, b))
  triton = loss_and_grads("triton")
  assert calls == ["triton", "triton"]   # X in the forward, dY in the backward
  assert real_quantizer(kernels, "triton") is qt.quantize_tiles_triton
  assert real_quantizer(kernels, "mosaic") is kernels.quantize_tiles
  for a, b in zip(jax.tree.leaves(triton), jax.tree.leaves(reference)):
    assert cpu._bit_equal(a, b)
  with pytest.raises(ValueError, match="quantize_backend"):
    dg.make_dot_general("infir2", quantize_backend="cuda")
