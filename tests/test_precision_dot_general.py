"""The FP8 dot_general: gradients vs a float64 reference, bf16 agreement, formats, layouts."""

import functools
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infir2_jax.precision.gemm import bf16_dot_general
from infir2_jax.precision import (
    fp8_gemm_report, get_recipe, make_dot_general, quantize, recipe_names)
from infir2_jax.precision import introspect
import precision_np_reference as ref

# Recipes whose GEMMs are another's with FP8 attention added (tests/test_fp8_attention.py)
# would repeat that one's cases here.
FP8_RECIPES = [n for n in recipe_names() if n != "bf16" and get_recipe(n).attention is None]
DENSE = (((2,), (0,)), ((), ()))


def _spec(o):
  return (o.fmt, o.tile, o.scale_format)


def _reference(recipe, x_MxK, w_KxN, g_MxN):
  """y, dx, dw of `recipe` in float64 from the NumPy quantizer (fresh, per the recipe)."""
  r = get_recipe(recipe)
  y = ref.qdq(x_MxK, _spec(r.fprop.lhs)) @ ref.qdq(w_KxN.T, _spec(r.fprop.rhs)).T
  dx = ref.qdq(g_MxN, _spec(r.dgrad.lhs)) @ ref.qdq(w_KxN, _spec(r.dgrad.rhs)).T
  dw = ref.qdq(x_MxK.T, _spec(r.wgrad.lhs)) @ ref.qdq(g_MxN.T, _spec(r.wgrad.rhs)).T
  return y, dx, dw


def _abs_products(x, w, g):
  """|A| |B| of the three GEMMs: the scale of f32 accumulation-order differences."""
  return _reference("bf16", np.abs(x), np.abs(w), np.abs(g))


def _run(recipe, x_BxLxK, w_KxN, g_BxLxN):
  dg = make_dot_general(recipe, backend="xla")

  @jax.jit
  def f(x, w):
    y, vjp = jax.vjp(lambda x, w: dg(x, w, DENSE, preferred_element_type=jnp.float32), x, w)
    return (y, *vjp(g_BxLxN))
  return [np.asarray(a, np.float64) for a in f(x_BxLxK, w_KxN)]


@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_fprop_dgrad_wgrad_match_float64_reference(recipe):
  rng = np.random.default_rng(0)
  x = (rng.standard_t(4, (2, 96, 320)) * np.exp(rng.normal(0, 1, 320))).astype(np.float32)
  w = (rng.standard_normal((320, 200)) * 0.05).astype(np.float32)
  g = (rng.standard_t(4, (2, 96, 200)) * 1e-3).astype(np.float32)
  y, dx, dw = _run(recipe, x, w, g)
  m = 2 * 96
  want = _reference(recipe, x.reshape(m, 320).astype(np.float64), w.astype(np.float64),
                    g.reshape(m, 200).astype(np.float64))
  bound = _abs_products(x.reshape(m, 320), w, g.reshape(m, 200))
  gemms = get_recipe(recipe).gemms().values()
  for name, got, exact, mag, gemm in zip(("y", "dx", "dw"), (y, dx, dw), want, bound, gemms):
    got = got.reshape(exact.shape)
    # Same quantized operands, so only the f32 summation order may differ. On a GPU the
    # native FP8 GEMM (cuBLASLt) accumulates inside the tensor core with fewer bits than
    # f32 before each promotion, hence the looser bound there.
    native = all(o.quantized and o.tile in (None, (1, -1)) for o in (gemm.lhs, gemm.rhs))
    rel = 1e-3 if native and jax.default_backend() == "gpu" else 2e-5
    err = np.abs(got - exact)
    assert (err <= rel * mag + 1e-30).all(), f"{recipe} {name}: max err {err.max()}"


def _heavy_tailed(rng, shape, outlier_channels=8, scale=1.0):
  x = rng.standard_t(3, shape) * scale
  cols = rng.choice(shape[-1], outlier_channels, replace=False)
  x[..., cols] *= 30.0  # LLM-like outlier channels
  return x


def _cos(a, b):
  a, b = np.ravel(a).astype(np.float64), np.ravel(b).astype(np.float64)
  return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_cosine_similarity_to_bf16_on_realistic_activations():
  rng = np.random.default_rng(1)
  x = jnp.asarray(_heavy_tailed(rng, (2, 128, 512)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((512, 384)) * 0.02, jnp.bfloat16)
  g = jnp.asarray(_heavy_tailed(rng, (2, 128, 384), 4, 1e-4), jnp.bfloat16)

  def grads(recipe, x, w, g):
    dg = make_dot_general(recipe)
    f = lambda x, w: dg(x, w, DENSE)          # bf16 out, as the model's Linear
    y, vjp = jax.vjp(f, x, w)
    return (y, *vjp(g))
  grads = jax.jit(grads, static_argnums=0)
  base = grads("bf16", x, w, g)
  for recipe in FP8_RECIPES:
    got = grads(recipe, x, w, g)
    for name, a, b in zip(("y", "dx", "dw"), got, base):
      assert a.dtype == b.dtype
      assert _cos(a, b) > 0.99, f"{recipe} {name}: cos {_cos(a, b)}"


def _roles(recipe, m=256, k=384, n=256):
  dg = make_dot_general(recipe, backend="xla")
  x = jnp.ones((m, k), jnp.bfloat16)
  w = jnp.ones((k, n), jnp.bfloat16)
  loss = lambda x, w: jnp.sum(dg(x, w, (((1,), (0,)), ((), ()))).astype(jnp.float32))
  records = fp8_gemm_report(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, w))
  return {r.role: r for r in records}, records


@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_each_gemm_uses_the_recipe_formats(recipe):
  roles, records = _roles(recipe)
  assert len(records) == 3 and set(roles) == {"fprop", "dgrad", "wgrad"}, \
      introspect.format_report(records)
  spec = get_recipe(recipe)
  dtype_name = lambda o: None if o.fmt is None else {"e4m3": "float8_e4m3fn",
                                                      "e5m2": "float8_e5m2"}[o.fmt]
  for role, gemm in spec.gemms().items():
    r = roles[role]
    want = (dtype_name(gemm.lhs), dtype_name(gemm.rhs))
    # wgrad of a Dense kernel [K, N] is NT(X^T, dY^T), the contract's own order: the [K, N]
    # gradient comes out directly (a [N, K] weight takes NT(dY^T, X^T), tested below)
    assert (r.lhs_fp8, r.rhs_fp8) == want, f"{recipe} {role}: {r}"
    # Per-tensor / per-row scales feed fp8 straight into the dot (XLA's native FP8 GEMM);
    # 1x128 / 128x128 tiles use the exact dequantize path (bf16, or f32 for fp32 scales).
    one_block = all(o.tile in (None, (1, -1)) for o in (gemm.lhs, gemm.rhs))
    if gemm.lhs.quantized and gemm.rhs.quantized:
      assert r.native_fp8 == one_block, f"{recipe} {role}: {r}"
      if not one_block:
        # (On CPU, gemm.bf16_dot_general runs bf16 dots as f32 dots of the same values.)
        bf16 = gemm.lhs.scale_format == "ue8m0" and jax.default_backend() != "cpu"
        want = "bfloat16" if bf16 else "float32"
        assert (r.lhs_dtype, r.rhs_dtype) == (want, want)


def test_bf16_recipe_is_plain_dot_general():
  assert make_dot_general("bf16") is bf16_dot_general
  _, records = _roles("bf16")
  assert len(records) == 3
  assert all(r.lhs_fp8 is None and r.rhs_fp8 is None and r.role is None for r in records)


def test_residuals_are_fp8_not_bf16_activations():
  from jax._src.ad_checkpoint import saved_residuals  # no public equivalent in jax 0.11
  m, k, n = 256, 384, 512
  x, w = jnp.ones((m, k), jnp.bfloat16), jnp.ones((k, n), jnp.bfloat16)
  for recipe, high in (("infir2", []), ("fp8_tensorwise", []), ("fp8_rowwise", []),
                       ("infir2_bf16_wgrad", [(k, m)])):
    dg = make_dot_general(recipe)
    res = saved_residuals(lambda x, w: dg(x, w, (((1,), (0,)), ((), ()))), x, w)
    big = [(str(a.dtype), a.shape) for a, _ in res if a.size >= min(m, n) * k]
    assert sorted(s for d, s in big if "float8" not in d) == sorted(high), (recipe, big)
    assert len(big) == 2, (recipe, big)  # X (for wgrad) and W (for dgrad), nothing else


def test_dimension_numbers_canonicalize():
  dg = make_dot_general("infir2")
  rng = np.random.default_rng(2)
  x4 = jnp.asarray(rng.standard_normal((2, 8, 4, 32)), jnp.float32)
  k3 = jnp.asarray(rng.standard_normal((4, 32, 256)), jnp.float32)
  emb = jnp.asarray(rng.standard_normal((300, 128)), jnp.float32)

  def both(f, g, *args, exact_wgrad=True):
    (ya, ga), (yb, gb) = (jax.jit(jax.value_and_grad(lambda *a: jnp.sum(h(*a) ** 2),
                                                     argnums=tuple(range(len(args)))))(*args)
                          for h in (f, g))
    np.testing.assert_array_equal(ya, yb)
    np.testing.assert_array_equal(ga[0], gb[0])
    if exact_wgrad:
      np.testing.assert_array_equal(ga[1], gb[1])
    else:  # NT(a, b) against NT(b, a)^T: the same products, summed in another f32 order
      np.testing.assert_allclose(ga[1], gb[1], rtol=2e-6, atol=1e-5)

  # DenseGeneral over (heads, head_dim) == Dense on the flattened input.
  both(lambda x, k: dg(x, k, (((2, 3), (0, 1)), ((), ()))),
       lambda x, k: dg(x.reshape(2, 8, 128), k.reshape(128, 256), DENSE).reshape(2, 8, 256),
       x4, k3)
  # Tied LM head (rhs contracting dim 1, [N, K]) == Dense with the transposed table ([K, N]).
  x3 = x4.reshape(2, 8, 128)
  both(lambda x, e: dg(x, e, (((2,), (1,)), ((), ()))),
       lambda x, e: dg(x, e.T, DENSE), x3, emb, exact_wgrad=False)
  with pytest.raises(NotImplementedError, match="batch"):
    dg(x4, x4, (((3,), (3,)), ((0,), (0,))))


def test_nan_and_inf_propagate_to_outputs():
  x = np.ones((256, 256), np.float32)
  x[3, 10] = np.nan
  x[200, 130] = np.inf
  w = jnp.ones((256, 128), jnp.float32)
  run = lambda recipe: np.asarray(jax.jit(
      lambda x, w: make_dot_general(recipe)(x, w, (((1,), (0,)), ((), ()))))(x, w))
  y = run("infir2")
  assert np.isnan(y[3]).all() and np.isnan(y[200]).all()
  assert np.isfinite(np.delete(y, [3, 200], axis=0)).all()
  y = run("fp8_tensorwise")
  assert np.isnan(y).all()  # one scale for the whole tensor


def test_backend_selection(monkeypatch):
  rng = np.random.default_rng(3)
  x0 = jnp.asarray(rng.standard_normal((256, 256)), jnp.bfloat16)
  w0 = jnp.asarray(rng.standard_normal((256, 256)), jnp.bfloat16)
  dn = (((1,), (0,)), ((), ()))
  with pytest.raises(ValueError, match="backend"):
    make_dot_general("infir2", backend="cuda")
  # Without usable kernels: 'pallas' is a clear error, 'auto' falls back to XLA.
  fake = types.ModuleType("infir2_jax.precision.kernels")
  fake.available = lambda: False
  monkeypatch.setitem(sys.modules, "infir2_jax.precision.kernels", fake)
  with pytest.raises(RuntimeError, match="kernels"):
    jax.jit(lambda x, w: make_dot_general("infir2", backend="pallas")(x, w, dn))(x0, w0)
  y_xla = jax.jit(lambda x, w: make_dot_general("infir2", backend="auto")(x, w, dn))(x0, w0)

  # With kernels: every block-scaled GEMM goes through block_scaled_matmul (canonical NT).
  calls = []

  def block_scaled_matmul(a_q, a_scale, b_q, b_scale, *, out_dtype):
    calls.append((a_q.shape, a_scale.shape, b_q.shape, b_scale.shape))
    a = a_q.astype(jnp.float32) * jnp.repeat(a_scale, 128, axis=1)[:, :a_q.shape[1]]
    rows = 128 if b_scale.shape[0] != b_q.shape[0] else 1
    sb = jnp.repeat(jnp.repeat(b_scale, rows, axis=0), 128, axis=1)[:b_q.shape[0], :b_q.shape[1]]
    return (a @ (b_q.astype(jnp.float32) * sb).T).astype(out_dtype)
  def quantize_tiles(x, *, fmt, scale_format, with_transpose=False):
    calls.append(("tiles", x.shape, with_transpose))
    out = quantize(x, (1, 128), fmt, scale_format)
    return out + quantize(x.T, (1, 128), fmt, scale_format) if with_transpose else out

  def quantize_blocks(w, *, fmt, scale_format, with_transpose=False):
    calls.append(("blocks", w.shape, with_transpose))
    out = quantize(w, (128, 128), fmt, scale_format)
    return out + (out[0].T,) if with_transpose else out
  fake.available = lambda: True
  fake.supports = lambda m, n, k, a_dtype, b_dtype, b_scale_shape, out_dtype: True
  fake.block_scaled_matmul = block_scaled_matmul
  fake.quantize_tiles = quantize_tiles
  fake.quantize_blocks = quantize_blocks
  m, k, n = 384, 256, 128
  x, w = jnp.ones((m, k), jnp.bfloat16), jnp.ones((k, n), jnp.bfloat16)
  dg = make_dot_general("infir2", backend="auto")
  jax.jit(jax.grad(lambda x, w: jnp.sum(dg(x, w, dn).astype(jnp.float32)),
                   argnums=(0, 1)))(x, w)
  assert calls == [("tiles", (m, k), True),                # X and X^T in one read
                   ("blocks", (k, n), True),              # W and W^T in one read of W
                   ((m, k), (m, 2), (n, k), (1, 2)),      # fprop: X, W^T 128x128 blocks
                   ("tiles", (m, n), True),               # dY and dY^T in one read
                   ((m, n), (m, 1), (k, n), (2, 1)),      # dgrad: dY, W blocks
                   ((k, m), (k, 3), (n, m), (n, 3))]      # wgrad: X^T, dY^T (1x128, tokens)
  y_pallas = jax.jit(lambda x, w: make_dot_general("infir2", backend="pallas")(x, w, dn))(x0, w0)
  np.testing.assert_allclose(np.asarray(y_pallas, np.float32), np.asarray(y_xla, np.float32),
                             rtol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["fp8_tensorwise", "fp8_rowwise"])
def test_native_fp8_gemms_in_gpu_hlo(recipe):
  # One-scale-along-K recipes must reach XLA's FP8 GEMM (cuBLASLt, or a Triton fusion with
  # f8 dot operands) for all three GEMMs, not a dequantized bf16 dot.
  dg = make_dot_general(recipe, backend="xla")
  x, w = jnp.ones((1024, 1536), jnp.bfloat16), jnp.ones((1536, 2048), jnp.bfloat16)
  # sum(y^2): the fprop output is needed, and dY is not a constant XLA could fold.
  step = jax.jit(jax.grad(lambda x, w: jnp.sum(jnp.square(
      dg(x, w, (((1,), (0,)), ((), ()))).astype(jnp.float32))), argnums=(0, 1)))
  counts = introspect.hlo_fp8_gemm_count(step.lower(x, w).compile().as_text())
  assert counts["cublaslt_f8"] + counts["fp8_dot"] >= 3, counts


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["infir2", "infir2_fp32_scale"])
def test_pallas_backend_matches_xla_on_gpu(recipe):
  # Same quantization bit for bit, so the Pallas GEMMs may differ from XLA's only by the
  # order of the f32 additions.
  kernels = pytest.importorskip("infir2_jax.precision.kernels")
  if not kernels.available():
    pytest.skip("no Hopper GPU / Mosaic GPU")
  rng = np.random.default_rng(4)
  x = jnp.asarray(_heavy_tailed(rng, (4, 512, 1536)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((1536, 8960)) * 0.02, jnp.bfloat16)
  g = jnp.asarray(_heavy_tailed(rng, (4, 512, 8960), 4, 1e-3), jnp.bfloat16)

  @functools.partial(jax.jit, static_argnums=0)
  def run(backend, x, w, g):
    dg = make_dot_general(recipe, backend=backend)
    y, vjp = jax.vjp(lambda x, w: dg(x, w, DENSE, preferred_element_type=jnp.float32), x, w)
    return (y, *vjp(g.astype(jnp.float32)))
  got, want = run("pallas", x, w, g), run("xla", x, w, g)
  for name, a, b in zip(("y", "dx", "dw"), got, want):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert _cos(a, b) > 0.99999, (recipe, name, _cos(a, b))
    np.testing.assert_allclose(a, b, rtol=2e-2, atol=1e-3 * np.abs(b).max(), err_msg=name)


def test_bf16_dot_with_f32_result_runs_its_backward_in_bf16(monkeypatch):
  """LM head: bf16 x bf16 -> f32 logits; dgrad and wgrad must be bf16 GEMMs, not TF32."""
  from infir2_jax.precision import gemm
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((4, 32, 64)), jnp.bfloat16)
  table = jnp.asarray(rng.standard_normal((96, 64)), jnp.bfloat16)
  dn = (((2,), (1,)), ((), ()))
  g = jnp.asarray(rng.standard_normal((4, 32, 96)), jnp.float32)

  def loss(x, table):
    y = bf16_dot_general(x, table, dn, preferred_element_type=jnp.float32)
    assert y.dtype == jnp.float32
    return jnp.sum(y * g)

  monkeypatch.setattr(gemm.jax, "default_backend", lambda: "gpu")  # no CPU f32 upcast
  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, table)
  dots = [e for e in _all_eqns(jaxpr.jaxpr) if e.primitive.name == "dot_general"]
  assert len(dots) >= 3  # forward, dgrad, wgrad
  assert all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars), dots
  monkeypatch.undo()

  dx, dtable = jax.grad(loss, argnums=(0, 1))(x, table)
  g16 = np.asarray(g.astype(jnp.bfloat16), np.float64)
  x64, t64 = np.asarray(x, np.float64), np.asarray(table, np.float64)
  want_dx = np.einsum("blv,vd->bld", g16, t64)
  want_dt = np.einsum("blv,bld->vd", g16, x64)
  for got, want in ((dx, want_dx), (dtable, want_dt)):
    assert got.dtype == jnp.bfloat16
    err = np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want)
    assert err < 4e-3, err  # bf16 rounding of the result only
  y = bf16_dot_general(x, table, dn, preferred_element_type=jnp.float32)
  np.testing.assert_allclose(np.asarray(y), np.einsum("bld,vd->blv", x64, t64), rtol=1e-5,
                             atol=1e-4)


def _all_eqns(jaxpr):
  for e in jaxpr.eqns:
    yield e
    for p in e.params.values():
      for sub in (p if isinstance(p, (list, tuple)) else [p]):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          yield from _all_eqns(inner)


def test_bf16_dots_stay_bf16_when_compiling_for_a_gpu_mesh_on_a_cpu_host():
  """The CPU-speed upcast follows the platform compiled for (the mesh's devices), so a
  deviceless GPU compile on a CPU host keeps bf16 GEMMs (and GPU memory figures)."""
  from infir2_jax.precision import gemm
  x = jnp.ones((4, 64), jnp.bfloat16)
  w = jnp.ones((64, 32), jnp.bfloat16)
  dn = (((1,), (0,)), ((), ()))
  dot_dtypes = lambda: [v.aval.dtype for e in _all_eqns(
      jax.make_jaxpr(lambda a, b: bf16_dot_general(a, b, dn))(x, w).jaxpr)
      if e.primitive.name == "dot_general" for v in e.invars]
  assert gemm.target_platform() == jax.default_backend() == "cpu"
  assert set(dot_dtypes()) == {jnp.dtype(jnp.float32)}  # CPU: the f32 upcast
  gpu = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
  mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=gpu)
  with jax.sharding.use_abstract_mesh(mesh):
    assert gemm.target_platform() == "gpu"
    assert set(dot_dtypes()) == {jnp.dtype(jnp.bfloat16)}


@pytest.mark.parametrize("recipe", ["infir2", "fp8_tensorwise"])
def test_wgrad_writes_the_gradient_in_the_weights_layout(recipe):
  """A Dense kernel [K, N] gets NT(X^T, dY^T) = dW [K, N]; the same weight stored [N, K]
  (the tied head's layout) gets NT(dY^T, X^T) = dW [N, K]: no transposed gradient either
  way, and the two are the same numbers."""
  m, k, n = 256, 384, 256
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((k, n)) * 0.05, jnp.bfloat16)
  g = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
  dg = make_dot_general(recipe, backend="xla")
  grads = lambda w, dims: jax.vjp(lambda x, w: dg(x, w, dims), x, w)[1](g)
  dx_kn, dw_kn = jax.jit(grads, static_argnums=1)(w, (((1,), (0,)), ((), ())))
  dx_nk, dw_nk = jax.jit(grads, static_argnums=1)(w.T, (((1,), (1,)), ((), ())))
  np.testing.assert_array_equal(np.asarray(dx_kn, np.float32), np.asarray(dx_nk, np.float32))
  np.testing.assert_allclose(np.asarray(dw_kn, np.float32), np.asarray(dw_nk, np.float32).T,
                             rtol=1e-2, atol=1e-6)
  for dims, w_in, lhs_rows in (((((1,), (0,)), ((), ())), w, k), ((((1,), (1,)), ((), ())), w.T, n)):
    loss = lambda x, w: jnp.sum(dg(x, w, dims).astype(jnp.float32))
    records = fp8_gemm_report(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, w_in))
    (wgrad,) = [r for r in records if r.role == "wgrad"]
    assert wgrad.lhs_shape[0] == lhs_rows, wgrad
