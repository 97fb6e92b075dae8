"""FP8 telemetry in a jitted train step: values against NumPy, key layout, zero cost when off."""

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infir2_jax.precision import (
    PrecisionConfig, fp8_gemm_report, get_recipe, make_dot_general_factory, telemetry)
import precision_np_reference as ref


class Linear(nn.Module):
  """The model contract's injection point: factory(path) inside the compact method."""
  features: int
  factory: Callable

  @nn.compact
  def __call__(self, x):
    kernel = self.param("kernel", nn.initializers.normal(0.05), (x.shape[-1], self.features))
    dot_general = self.factory("/".join(self.scope.path))
    return dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))


class Attn(nn.Module):
  factory: Callable

  @nn.compact
  def __call__(self, x):
    # Two projections of the same input, so each sees a known x and a known dY.
    return (Linear(384, self.factory, name="q_proj")(x),
            Linear(128, self.factory, name="k_proj")(x))


class Tiny(nn.Module):
  factory: Callable

  @nn.compact
  def __call__(self, x):
    return Attn(self.factory, name="self_attn")(x)


def _wrap(factory):
  """Puts the projections under "layers_0/..." as in the real model."""
  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      return Tiny(factory, name="layers_0")(x)
  return Model()


CFG = PrecisionConfig(recipe="infir2", overrides=("k_proj=infir2_e5m2_grad",),
                      telemetry_every_steps=10)


def _data():
  rng = np.random.default_rng(0)
  x = rng.standard_t(3, (2, 96, 256)).astype(np.float32)
  x[..., 7] *= 40.0                                               # outlier channel
  tiny = rng.random(x.shape) < 0.05
  x[tiny] = 1e-6 * np.sign(x[tiny])                               # flushed by big tiles
  g1 = (rng.standard_normal((2, 96, 384)) * 1e-3).astype(np.float32)
  g2 = (rng.standard_t(3, (2, 96, 128)) * 1e-3).astype(np.float32)
  return x, g1, g2


def _train_step(model):
  @jax.jit
  def step(params, sinks, x, g1, g2):
    def loss_fn(params, sinks):
      (y, z), state = model.apply({"params": params, telemetry.SINKS: sinks}, x,
                                  mutable=[telemetry.STATS])
      return jnp.sum(y * g1) + jnp.sum(z * g2), state[telemetry.STATS]
    (loss, fstats), (grads, sink_grads) = jax.value_and_grad(
        loss_fn, argnums=(0, 1), has_aux=True)(params, sinks)
    params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    return params, loss, grads, fstats, sink_grads
  return step


def _spec(o):
  return (o.fmt, o.tile, o.scale_format)


def test_stats_match_numpy_in_jitted_train_step():
  x, g1, g2 = _data()
  model = _wrap(make_dot_general_factory(CFG, telemetry=True))
  rng = np.random.default_rng(1)
  params = jax.tree.map(lambda s: jnp.asarray(rng.normal(0, 0.05, s.shape), s.dtype),
                        jax.eval_shape(model.init, jax.random.key(0), x)["params"])
  sinks = telemetry.init_sinks(model, jax.random.key(0), x)
  _, _, grads, fstats, sink_grads = _train_step(model)(params, sinks, x, g1, g2)
  metrics = telemetry.summarize(fstats, sink_grads)

  x2 = x.reshape(-1, 256).astype(np.float64)
  for proj, g, recipe in (("q_proj", g1, "infir2"), ("k_proj", g2, "infir2_e5m2_grad")):
    r = get_recipe(recipe)
    w = np.asarray(params["layers_0"]["self_attn"][proj]["kernel"], np.float64)
    dy = g.reshape(x2.shape[0], -1).astype(np.float64)
    want = {("fprop", "x"): ref.stats(x2, _spec(r.fprop.lhs)),
            ("fprop", "w"): ref.stats(w.T, _spec(r.fprop.rhs)),
            ("dgrad", "dy"): ref.stats(dy, _spec(r.dgrad.lhs)),
            ("dgrad", "w"): ref.stats(w, _spec(r.dgrad.rhs)),
            ("wgrad", "x"): ref.stats(x2.T, _spec(r.wgrad.lhs)),
            ("wgrad", "dy"): ref.stats(dy.T, _spec(r.wgrad.rhs))}
    for (role, operand), (amax, flush, snr) in want.items():
      key = f"fp8/layers_0/self_attn/{proj}/{role}/{operand}"
      assert metrics[f"{key}/amax"] == pytest.approx(amax, rel=1e-7), key
      assert metrics[f"{key}/flush_frac"] == pytest.approx(flush, rel=1e-6, abs=1e-9), key
      assert metrics[f"{key}/snr_db"] == pytest.approx(snr, abs=1e-3), key
  assert metrics["fp8/layers_0/self_attn/q_proj/fprop/x/flush_frac"] > 0.01
  worst = metrics["fp8/worst/fprop/x/min_snr_db"]
  assert worst == min(metrics[f"fp8/layers_0/self_attn/{p}/fprop/x/snr_db"]
                      for p in ("q_proj", "k_proj"))

  # Telemetry observes, it does not change the numerics: same gradients as without it.
  plain = _wrap(make_dot_general_factory(CFG))
  plain_grads = jax.jit(jax.grad(lambda p: jnp.sum(
      plain.apply({"params": p}, x)[0] * g1) + jnp.sum(plain.apply({"params": p}, x)[1] * g2)))(
          params)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(plain_grads)):
    np.testing.assert_array_equal(a, b)


def test_no_cost_when_off():
  x, _, _ = _data()
  key = jax.random.key(0)
  model = _wrap(make_dot_general_factory(CFG))
  variables = jax.eval_shape(model.init, key, x)
  assert set(variables) == {"params"}
  loss = lambda p: jnp.sum(model.apply({"params": p}, x)[0])
  jaxpr = jax.make_jaxpr(jax.grad(loss))(variables["params"])
  stacks = [str(e.source_info.name_stack) for e in jaxpr.eqns]
  assert not any("fp8_telemetry" in s for s in stacks)
  _, state = jax.eval_shape(lambda v: model.apply(v, x, mutable=[telemetry.STATS]), variables)
  assert not state  # nothing sown
  # The telemetry variant does add its ops (so the check above can fail).
  model_t = _wrap(make_dot_general_factory(CFG, telemetry=True))
  vt = jax.eval_shape(model_t.init, key, x)
  jt = jax.make_jaxpr(jax.grad(lambda p, s: jnp.sum(model_t.apply(
      {"params": p, telemetry.SINKS: s}, x)[0])))(vt["params"], vt[telemetry.SINKS])
  assert any("fp8_telemetry" in str(e.source_info.name_stack) for e in jt.eqns)
  # Both run the same three FP8 GEMMs per projection.
  roles = lambda j: sorted(r.role for r in fp8_gemm_report(j) if r.role)
  assert roles(jaxpr) == roles(jt) == ["dgrad", "fprop", "fprop", "wgrad"]


def test_without_sinks_only_forward_stats():
  x, _, _ = _data()
  model = _wrap(make_dot_general_factory(CFG, telemetry=True))
  params = jax.eval_shape(model.init, jax.random.key(0), x)["params"]
  _, state = jax.eval_shape(
      lambda p: model.apply({"params": p}, x, mutable=[telemetry.STATS]), params)
  leaves = jax.tree_util.tree_leaves_with_path(state[telemetry.STATS])
  assert {jax.tree_util.keystr(k) for k, _ in leaves} == {
      f"['layers_0']['self_attn']['{p}']['fp8_{p}']['fprop']" for p in ("q_proj", "k_proj")}
  assert all(v.shape == (2, 3) for _, v in leaves)


def test_summarize_unstacks_scanned_layers_and_top_level_head():
  per_layer = np.arange(3 * 2 * 3, dtype=np.float32).reshape(3, 2, 3)
  tree = {"layers": {"mlp": {"up_proj": {"fp8_up_proj": {"fprop": per_layer}}}},
          "fp8_lm_head": {"fprop": per_layer[0]}}
  m = telemetry.summarize(tree)
  assert m["fp8/layers_2/mlp/up_proj/fprop/w/snr_db"] == per_layer[2, 1, 2]
  assert m["fp8/layers_0/mlp/up_proj/fprop/x/amax"] == per_layer[0, 0, 0]
  assert m["fp8/lm_head/fprop/w/flush_frac"] == per_layer[0, 1, 1]
  assert m["fp8/worst/fprop/x/max_amax"] == per_layer[:, 0, 0].max()
  assert telemetry.finite_only({"a": float("inf"), "b": 1.0}) == {"b": 1.0}


def test_summarize_reads_fp8_attention_stats_beside_the_projections():
  """FP8 attention's [4, 3] leaf ("attention": q, k, p, v) becomes its own keys, scanned
  layers unstacked, next to the projections' [2, 3] "fprop" leaves of the same tree."""
  attn = np.arange(2 * 4 * 3, dtype=np.float32).reshape(2, 4, 3)
  proj = np.zeros((2, 2, 3), np.float32)
  tree = {"layers": {"self_attn": {"fp8_self_attn": {"attention": attn},
                                   "q_proj": {"fp8_q_proj": {"fprop": proj}}}}}
  m = telemetry.summarize(tree)
  assert m["fp8/layers_1/self_attn/attention/p/flush_frac"] == attn[1, 2, 1]
  assert m["fp8/layers_0/self_attn/attention/v/snr_db"] == attn[0, 3, 2]
  assert m["fp8/worst/attention/p/max_flush_frac"] == attn[:, 2, 1].max()
  assert m["fp8/layers_1/self_attn/q_proj/fprop/x/amax"] == 0
  assert not any("attention" in k and "q_proj" in k for k in m)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["infir2", "infir2_fp8attn"])
def test_real_model_smoke(recipe):
  model_lib = pytest.importorskip("infir2_jax.model")
  cfg = model_lib.ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                              num_layers=1, num_heads=2, num_kv_heads=1, attention="xla")
  model = model_lib.Qwen2(cfg, make_dot_general_factory(PrecisionConfig(recipe=recipe),
                                                        telemetry=True))
  tokens = jnp.ones((2, 32), jnp.int32)
  shapes = jax.eval_shape(model.init, jax.random.key(0), tokens)   # no init compile
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda s: jnp.asarray(rng.normal(0, 0.05, s.shape), s.dtype),
                        shapes["params"])
  sinks = telemetry.zeros_like_sinks(shapes[telemetry.SINKS])

  @jax.jit
  def step(params, sinks):
    def loss_fn(params, sinks):
      logits, state = model.apply({"params": params, telemetry.SINKS: sinks}, tokens,
                                  mutable=[telemetry.STATS])
      return jnp.mean(jax.nn.logsumexp(logits, -1)), state[telemetry.STATS]
    (_, fstats), (_, sink_grads) = jax.value_and_grad(
        loss_fn, argnums=(0, 1), has_aux=True)(params, sinks)
    return fstats, sink_grads
  metrics = telemetry.summarize(*step(params, sinks))
  projs = [f"layers_{i}/{p}" for i in range(1) for p in (
      "self_attn/q_proj", "self_attn/k_proj", "self_attn/v_proj", "self_attn/o_proj",
      "mlp/gate_proj", "mlp/up_proj", "mlp/down_proj")]
  for p in projs:
    for role in ("fprop", "dgrad", "wgrad"):
      for op in telemetry.ROLES[role]:
        assert np.isfinite(metrics[f"fp8/{p}/{role}/{op}/snr_db"]), (p, role, op)
  assert not any("lm_head" in k for k in metrics)  # the head stays bf16
  attention = {k: v for k, v in metrics.items() if "/attention/" in k}
  if recipe == "infir2":
    assert not attention
  else:   # FP8 attention's forward operands, with E4M3's SNR
    for op in ("q", "k", "p", "v"):
      assert metrics[f"fp8/layers_0/self_attn/attention/{op}/snr_db"] > 20, op
      assert 0 <= metrics[f"fp8/layers_0/self_attn/attention/{op}/flush_frac"] < 0.5, op
