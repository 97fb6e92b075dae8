"""The fused SwiGLU MLP (precision/fused_mlp.py) against the composition of three projections
and float64, where the factory offers it, and in the model (single device and per shard)."""
import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infir2_jax.model import ModelConfig, Qwen2, init_params
from infir2_jax.precision import (
    PrecisionConfig, fused_mlp, make_dot_general, make_dot_general_factory, make_gated_mlp,
    swiglu)
from tests import meshes

M, D, F = 256, 256, 384


def _operands(seed=0, dtype=jnp.bfloat16):
  r = np.random.default_rng(seed)
  x = jnp.asarray(r.standard_normal((M, D)), dtype)
  wg, wu = (jnp.asarray(r.standard_normal((D, F)) * 0.06, dtype) for _ in range(2))
  wd = jnp.asarray(r.standard_normal((F, D)) * 0.06, dtype)
  ct = jnp.asarray(r.standard_normal((M, D)), jnp.float32)
  return (x, wg, wu, wd), ct


def _value_and_grads(mlp, args, ct):
  loss = lambda *a: jnp.sum(mlp(*a).astype(jnp.float32) * ct)
  return jax.jit(lambda *a: (mlp(*a), jax.grad(loss, argnums=(0, 1, 2, 3))(*a)))(*args)


@pytest.mark.parametrize("recipe", ["infir2", "infir2_fp32_scale", "infir2_e5m2_grad"])
def test_fused_mlp_is_the_composition_with_one_dgrad_accumulator(recipe):
  """Same output and weight gradients bit for bit as three dot_generals of the recipe; dx
  sums gate's and up's products in one f32 accumulator: it is the float64 product of the
  very same quantized operands rounded once to bf16, where the composition rounds twice
  more (each product, then their sum)."""
  args, ct = _operands()
  fused = make_gated_mlp(recipe, backend="xla")
  dot = make_dot_general(recipe, backend="xla")
  dims = (((1,), (0,)), ((), ()))
  composed = lambda x, wg, wu, wd: dot(swiglu(dot(x, wg, dims), dot(x, wu, dims)), wd, dims)
  y_f, g_f = _value_and_grads(fused, args, ct)
  y_c, g_c = _value_and_grads(composed, args, ct)
  np.testing.assert_array_equal(np.asarray(y_f, np.float32), np.asarray(y_c, np.float32))
  for a, b in zip(g_f[1:], g_c[1:]):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  # dx = dgate . Wg^T + dup . Wu^T from the quantized operands the backward uses: recompute
  # them with the library's own quantizer, then the product in float64.
  from infir2_jax.precision.kernels import fused_quantize as fq
  from infir2_jax.precision.quantize import quantize_tensor
  r = fused.recipe
  x, wg, wu, wd = args
  h = swiglu(x @ wg, x @ wu)  # only to get dh's shape; dh comes from the real backward below
  _, vjp = jax.vjp(lambda h: dot(h, wd, dims), h)
  gu = jnp.concatenate([dot(x, wg, dims), dot(x, wu, dims)], 1)
  dh = vjp(ct.astype(jnp.bfloat16))[0]
  dgu = fq.swiglu_bwd_reference(dh, gu)
  deq = lambda t, spec: np.asarray(quantize_tensor(t, spec.tile, spec.fmt, spec.scale_format)
                                   .dequantize(jnp.float32), np.float64)
  want = deq(dgu, r.dgrad.lhs) @ deq(jnp.concatenate([wg, wu], 1), r.dgrad.rhs).T
  err = lambda got: np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want)
  rounded_once = err(want.astype(np.float32).astype(jnp.bfloat16))
  assert err(g_f[0]) < 1.02 * rounded_once < 1.02 * 1.3 * rounded_once < err(g_c[0]), (
      err(g_f[0]), rounded_once, err(g_c[0]))


def test_swiglu_gradient_is_autodiff_of_its_forward():
  """The hand-written backward (shared with the fused kernel) against jax.grad of the f32
  forward formula, in float32 inputs."""
  r = np.random.default_rng(4)
  g, u = (jnp.asarray(r.standard_normal((64, 128)) * 4, jnp.float32) for _ in range(2))
  dh = jnp.asarray(r.standard_normal((64, 128)), jnp.float32)
  ours = jax.vjp(swiglu, g, u)[1](dh)
  auto = jax.vjp(lambda g, u: g * jax.nn.sigmoid(g) * u, g, u)[1](dh)
  for a, b in zip(ours, auto):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6, atol=1e-6)


def test_factory_offers_the_fused_mlp_only_where_it_applies():
  path = "layers_3/mlp"
  made = lambda **kw: make_dot_general_factory(PrecisionConfig(**kw)).gated_mlp(path)
  assert made(recipe="infir2") is not None
  assert made(recipe="infir2_fp32_scale").recipe.name == "infir2_fp32_scale"
  for recipe in ("bf16", "fp8_rowwise", "fp8_tensorwise", "infir2_bf16_wgrad"):
    assert made(recipe=recipe) is None, recipe
  # a projection of the MLP under another recipe: the three dot_generals instead
  assert made(recipe="infir2", overrides=("down_proj=bf16",)) is None
  assert made(recipe="infir2", overrides=("layers_2/=bf16",)) is not None
  telemetry = make_dot_general_factory(PrecisionConfig(recipe="infir2"), telemetry=True)
  assert telemetry.gated_mlp(path) is None
  with pytest.raises(ValueError, match="no fused MLP"):
    make_gated_mlp("fp8_rowwise")
  assert not fused_mlp.supports("infir2_bf16_wgrad") and fused_mlp.supports("infir2")


def test_a_width_that_is_not_whole_tiles_runs_the_composition():
  r = np.random.default_rng(5)
  x = jnp.asarray(r.standard_normal((128, 256)), jnp.bfloat16)
  wg, wu = (jnp.asarray(r.standard_normal((256, 200)) * 0.06, jnp.bfloat16) for _ in range(2))
  wd = jnp.asarray(r.standard_normal((200, 256)) * 0.06, jnp.bfloat16)
  y = make_gated_mlp("infir2", backend="xla")(x, wg, wu, wd)
  y_c = fused_mlp._composed(fused_mlp.get_recipe("infir2"), "xla")(x, wg, wu, wd)
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_c, np.float32))


CFG = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=384, num_layers=2,
                  num_heads=2, num_kv_heads=2, head_dim=128)


def _model_loss(cfg, factory, tokens):
  model = Qwen2(cfg, factory)
  def loss(p):
    return jnp.mean(model.apply({"params": p}, tokens).astype(jnp.float32) ** 2)
  return model, loss


@pytest.mark.parametrize("scan_layers", [False, True])
def test_model_with_the_fused_mlp_keeps_its_params_and_matches_the_composition(scan_layers):
  """The fused MLP declares the same params (names, shapes, partitioning) as the three
  Linears and computes the same logits. Gradients differ only by dx's rounding, which FP8
  quantization upstream amplifies: ~1e-2, far below FP8's own distance from bf16."""
  cfg = dataclasses.replace(CFG, scan_layers=scan_layers, remat="save_dots")
  tokens = jax.random.randint(jax.random.key(1), (2, 128), 0, cfg.vocab_size)
  factory = make_dot_general_factory(PrecisionConfig(recipe="infir2", backend="xla"))
  plain = lambda path, axes=None: factory(path, axes)  # the same, without gated_mlp
  init_cfg = dataclasses.replace(cfg, scan_layers=False)
  boxed_fused = jax.jit(Qwen2(init_cfg, factory).init)(jax.random.key(0), tokens)
  boxed_plain = jax.jit(Qwen2(init_cfg, plain).init)(jax.random.key(0), tokens)
  assert (jax.tree.map(lambda b: (b.value.shape, b.names), boxed_fused,
                       is_leaf=lambda b: isinstance(b, nn.Partitioned))
          == jax.tree.map(lambda b: (b.value.shape, b.names), boxed_plain,
                          is_leaf=lambda b: isinstance(b, nn.Partitioned)))
  params = nn.unbox(boxed_fused)["params"]
  model_f, loss_f = _model_loss(cfg, factory, tokens)
  model_p, loss_p = _model_loss(cfg, plain, tokens)
  logits_f = jax.jit(lambda p: model_f.apply({"params": p}, tokens))(params)
  logits_p = jax.jit(lambda p: model_p.apply({"params": p}, tokens))(params)
  np.testing.assert_array_equal(np.asarray(logits_f), np.asarray(logits_p))
  g_f, g_p = jax.jit(jax.grad(loss_f))(params), jax.jit(jax.grad(loss_p))(params)
  bf16 = make_dot_general_factory(PrecisionConfig(recipe="bf16"))
  g_bf16 = jax.jit(jax.grad(_model_loss(cfg, bf16, tokens)[1]))(params)
  assert _relative_error(g_f, g_p) < min(3e-2, 0.3 * _relative_error(g_p, g_bf16))


def _relative_error(tree, ref) -> float:
  """|tree - ref| / |ref| over all leaves together (a leaf like k's bias, whose gradient is
  zero up to rounding, says nothing on its own)."""
  flat = lambda t: np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(t)])
  return float(np.linalg.norm(flat(tree) - flat(ref)) / np.linalg.norm(flat(ref)))


def test_fused_mlp_per_shard_equals_one_device():
  """fsdp 2 x tensor 2 on 4 CPU devices: the fused MLP runs inside shard_map (F split over
  tensor, down's partial sums added) and gives one device's loss and gradients (float32
  compute, tolerances as tests/test_sharding_equivalence.py's)."""
  # 256 of F per tensor shard: whole tiles
  cfg = dataclasses.replace(CFG, intermediate_size=512, dtype="float32")
  tokens = jax.random.randint(jax.random.key(2), (4, 128), 0, cfg.vocab_size)
  factory = make_dot_general_factory(PrecisionConfig(recipe="infir2", backend="xla"))
  model, loss = _model_loss(cfg, factory, tokens)
  params = nn.unbox(init_params(model, jax.random.key(0)))
  want_loss, want_grads = jax.jit(jax.value_and_grad(loss))(params)
  with meshes.fsdp2_tensor2(cfg):
    jaxpr = jax.make_jaxpr(jax.value_and_grad(loss))(params)
    got_loss, got_grads = jax.jit(jax.value_and_grad(loss))(params)
  assert "shard_map" in str(jaxpr)
  np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)
  assert _relative_error(got_grads, want_grads) < 3e-2
