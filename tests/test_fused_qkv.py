"""The fused q/k/v product (precision/fused_qkv.py) against three projections and float64,
where the factory offers it, and in the model (single device and per shard)."""
import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from infir2_jax.model import ModelConfig, Qwen2, init_params
from infir2_jax.precision import PrecisionConfig, fused_qkv, make_dot_general, make_dot_general_factory
from infir2_jax.precision.quantize import quantize_tensor
from tests import meshes

M, D, NQ, NK = 256, 256, 384, 128
DIMS = (((1,), (0,)), ((), ()))


def _operands(seed=0, nk=NK):
  r = np.random.default_rng(seed)
  x = jnp.asarray(r.standard_normal((M, D)), jnp.bfloat16)
  wq = jnp.asarray(r.standard_normal((D, NQ)) * 0.06, jnp.bfloat16)
  wk, wv = (jnp.asarray(r.standard_normal((D, nk)) * 0.06, jnp.bfloat16) for _ in range(2))
  cts = tuple(jnp.asarray(r.standard_normal((M, n)), jnp.float32) for n in (NQ, nk, nk))
  return (x, wq, wk, wv), cts


def _value_and_grads(qkv, args, cts):
  loss = lambda *a: sum(jnp.sum(y.astype(jnp.float32) * c) for y, c in zip(qkv(*a), cts))
  return jax.jit(lambda *a: (qkv(*a), jax.grad(loss, argnums=(0, 1, 2, 3))(*a)))(*args)


@pytest.mark.parametrize("recipe", ["infir2", "infir2_fp32_scale", "infir2_e5m2_grad"])
def test_fused_qkv_is_three_projections_with_one_dgrad_accumulator(recipe):
  """q, k, v and the weight gradients bit for bit as three dot_generals of the recipe; dx
  sums the three dgrad products in one f32 accumulator: the float64 product of the same
  quantized operands rounded once to bf16, where three projections round three times more."""
  args, cts = _operands()
  fused = fused_qkv.make_fused_qkv(recipe, backend="xla")
  dot = make_dot_general(recipe, backend="xla")
  three = lambda x, wq, wk, wv: tuple(dot(x, w, DIMS) for w in (wq, wk, wv))
  (ys_f, g_f), (ys_t, g_t) = _value_and_grads(fused, args, cts), _value_and_grads(three, args, cts)
  for a, b in zip(ys_f, ys_t):
    assert a.shape == b.shape
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  for a, b in zip(g_f[1:], g_t[1:]):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  # dx = [dq | dk | dv] . [Wq | Wk | Wv]^T from the quantized operands dgrad takes
  r = fused.recipe
  deq = lambda t, spec: np.asarray(quantize_tensor(t, spec.tile, spec.fmt, spec.scale_format)
                                   .dequantize(jnp.float32), np.float64)
  dy = jnp.concatenate([c.astype(jnp.bfloat16) for c in cts], 1)
  want = deq(dy, r.dgrad.lhs) @ deq(jnp.concatenate(args[1:], 1), r.dgrad.rhs).T
  err = lambda got: np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want)
  rounded_once = err(want.astype(np.float32).astype(jnp.bfloat16))
  assert err(g_f[0]) < 1.02 * rounded_once < 1.02 * 1.3 * rounded_once < err(g_t[0]), (
      err(g_f[0]), rounded_once, err(g_t[0]))


def _same_up_to_summation_order(a, b):
  """a equals b, bf16 products of the same operands, except where XLA:CPU's GEMM sums K in
  another order for the concatenated weights than for one projection's: such an element is
  one bf16 rounding step off, and rare (session 30: on one CPU, 2 and 4 of the 24,576 k and v
  outputs at width 96, none at 128; on the CPU of session 29's CI, none)."""
  a32, b32 = np.asarray(a, np.float32), np.asarray(b, np.float32)
  differ = a32 != b32
  if not differ.any():
    return
  step = np.spacing(np.abs(b32[differ]).astype(ml_dtypes.bfloat16)).astype(np.float32)
  assert np.all(np.abs(a32[differ] - b32[differ]) <= step), "differs by more than one step"
  assert differ.mean() < 1e-3, f"{differ.sum()} of {differ.size} elements differ"


def test_bf16_fused_qkv_is_three_products_with_one_dgrad_accumulator():
  """bf16 (Megatron's fused linear_qkv): q, k, v and the weight gradients as three bf16
  dot_generals (bit for bit up to the GEMM's order of summation); dx is the float64 product
  rounded once to bf16, where three products round each to bf16 and add them. Widths need
  not be whole tiles."""
  for nk in (NK, 96):
    args, cts = _operands(seed=2, nk=nk)
    fused = fused_qkv.make_fused_qkv("bf16")
    dot = make_dot_general("bf16")
    three = lambda x, wq, wk, wv: tuple(dot(x, w, DIMS) for w in (wq, wk, wv))
    (ys_f, g_f), (ys_t, g_t) = (_value_and_grads(fused, args, cts),
                                _value_and_grads(three, args, cts))
    for a, b in [*zip(ys_f, ys_t), *zip(g_f[1:], g_t[1:])]:
      assert a.dtype == b.dtype == jnp.bfloat16 and a.shape == b.shape
      _same_up_to_summation_order(a, b)
    f64 = lambda t: np.asarray(t, np.float64)
    dy = np.concatenate([f64(c.astype(jnp.bfloat16)) for c in cts], 1)
    want = dy @ np.concatenate([f64(w) for w in args[1:]], 1).T
    err = lambda got: np.linalg.norm(f64(got) - want) / np.linalg.norm(want)
    rounded_once = err(want.astype(np.float32).astype(jnp.bfloat16))
    assert err(g_f[0]) < 1.02 * rounded_once < 1.02 * 1.3 * rounded_once < err(g_t[0]), (
        nk, err(g_f[0]), rounded_once, err(g_t[0]))


@pytest.mark.parametrize("recipe,nk", [("infir2", NK), ("infir2", 96), ("bf16", NK)])
def test_biases_are_added_as_one_vector_and_their_gradients_are_float32_sums(recipe, nk):
  """biases=(bq, bk, bv): q, k, v are the product's slices plus each bias, bit for bit, and
  the weights' and x's gradients are those without biases. Each bias's gradient is the sum
  of its cotangents over the tokens in float32, rounded once (the float64 sum rounded to
  bf16, to one step). In the one product (widths of whole tiles, or bf16) the biases'
  gradient is one float32 reduce_sum of [dq | dk | dv]: XLA fuses it into the pass that
  builds that concatenation instead of re-reading dq, dk and dv (session 32)."""
  (x, wq, wk, wv), cts = _operands(seed=3, nk=nk)
  r = np.random.default_rng(4)
  biases = tuple(jnp.asarray(r.standard_normal(n) * 0.5, jnp.bfloat16) for n in (NQ, nk, nk))
  fused = fused_qkv.make_fused_qkv(recipe, backend="xla")
  with_b = lambda x, wq, wk, wv, *b: fused(x, wq, wk, wv, biases=b)
  loss = lambda f: lambda *a: sum(jnp.sum(y.astype(jnp.float32) * c)
                                  for y, c in zip(f(*a), cts))
  args = (x, wq, wk, wv, *biases)
  ys, grads = jax.jit(lambda *a: (with_b(*a), jax.grad(loss(with_b), argnums=range(7))(*a)))(
      *args)
  ys0, grads0 = _value_and_grads(fused, (x, wq, wk, wv), cts)
  for y, y0, b in zip(ys, ys0, biases):
    np.testing.assert_array_equal(np.asarray(y, np.float32),
                                  np.asarray((y0 + b).astype(jnp.bfloat16), np.float32))
  for g, g0 in zip(grads[:4], grads0):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(g0, np.float32))
  for g, c in zip(grads[4:], cts):
    want = np.asarray(c.astype(jnp.bfloat16), np.float64).sum(0)
    assert g.dtype == jnp.bfloat16
    step = np.spacing(np.abs(want).astype(ml_dtypes.bfloat16)).astype(np.float64)
    assert np.all(np.abs(np.asarray(g, np.float64) - want) <= step), recipe
  jaxpr = jax.make_jaxpr(jax.grad(loss(with_b), argnums=(4, 5, 6)))(*args).jaxpr
  sums = [e.invars[0].aval for e in jaxpr.eqns   # over the tokens (not the loss's own sums)
          if e.primitive.name == "reduce_sum" and e.outvars[0].aval.ndim == 1]
  one_product = recipe == "bf16" or nk % 128 == 0
  want_widths = [NQ + 2 * nk] if one_product else [NQ, nk, nk]
  assert sorted(a.shape[-1] for a in sums) == sorted(want_widths), sums
  assert all(a.dtype == jnp.float32 for a in sums), sums


def test_a_width_that_is_not_whole_tiles_runs_three_projections():
  args, cts = _operands(seed=1, nk=96)
  fused = fused_qkv.make_fused_qkv("infir2", backend="xla")
  dot = make_dot_general("infir2", backend="xla")
  three = lambda x, wq, wk, wv: tuple(dot(x, w, DIMS) for w in (wq, wk, wv))
  (_, g_f), (_, g_t) = _value_and_grads(fused, args, cts), _value_and_grads(three, args, cts)
  for a, b in zip(g_f, g_t):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_factory_offers_the_fused_qkv_only_where_it_applies():
  path = "layers_3/self_attn"
  made = lambda **kw: make_dot_general_factory(PrecisionConfig(**kw)).fused_qkv(path)
  assert made(recipe="infir2") is not None
  assert made(recipe="infir2_fp32_scale").recipe.name == "infir2_fp32_scale"
  assert made(recipe="infir2_bf16_wgrad") is not None   # its bf16 wgrad reads no tiles
  assert made(recipe="bf16").recipe.name == "bf16"
  for recipe in ("fp8_rowwise", "fp8_tensorwise"):   # row/tensor scales span N
    assert made(recipe=recipe) is None, recipe
  assert made(recipe="infir2", overrides=("k_proj=bf16",)) is None
  assert made(recipe="infir2", overrides=("layers_2/=bf16",)) is not None
  assert made(recipe="infir2", fused_qkv=False) is None
  telemetry = make_dot_general_factory(PrecisionConfig(recipe="infir2"), telemetry=True)
  assert telemetry.fused_qkv(path) is None
  with pytest.raises(ValueError, match="no fused q/k/v"):
    fused_qkv.make_fused_qkv("fp8_rowwise")


CFG = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=384, num_layers=2,
                  num_heads=2, num_kv_heads=2, head_dim=128)


def _loss(model, tokens):
  return lambda p: jnp.mean(model.apply({"params": p}, tokens).astype(jnp.float32) ** 2)


def _relative_error(tree, ref) -> float:
  flat = lambda t: np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(t)])
  return float(np.linalg.norm(flat(tree) - flat(ref)) / np.linalg.norm(flat(ref)))


@pytest.mark.parametrize("scan_layers", [False, True])
def test_model_with_the_fused_qkv_keeps_its_params_and_logits(scan_layers):
  """The fused product declares the same params (names, shapes, partitioning, the q/k/v
  biases) as the three Linears and computes the same logits bit for bit; its gradients
  differ only by dx's rounding (amplified upstream by FP8 quantization), far less than
  FP8's own distance from bf16."""
  cfg = dataclasses.replace(CFG, scan_layers=scan_layers, remat="save_dots")
  tokens = jax.random.randint(jax.random.key(1), (2, 128), 0, cfg.vocab_size)
  fused = make_dot_general_factory(PrecisionConfig(recipe="infir2", backend="xla"))
  three = make_dot_general_factory(PrecisionConfig(recipe="infir2", backend="xla",
                                                   fused_qkv=False))
  init_cfg = dataclasses.replace(cfg, scan_layers=False)
  boxed_f = jax.jit(Qwen2(init_cfg, fused).init)(jax.random.key(0), tokens)
  boxed_t = jax.jit(Qwen2(init_cfg, three).init)(jax.random.key(0), tokens)
  describe = lambda boxed: jax.tree.map(lambda b: (b.value.shape, b.names), boxed,
                                        is_leaf=lambda b: isinstance(b, nn.Partitioned))
  assert describe(boxed_f) == describe(boxed_t)
  assert "bias" in boxed_f["params"]["layers_0"]["self_attn"]["k_proj"]
  jax.tree.map(np.testing.assert_array_equal, nn.unbox(boxed_f), nn.unbox(boxed_t))
  params = nn.unbox(boxed_f)["params"]
  # nonzero biases, so that a bias dropped or swapped would show
  params = jax.tree_util.tree_map_with_path(
      lambda path, p: p + 0.05 if path[-1].key == "bias" else p, params)
  model_f, model_t = Qwen2(cfg, fused), Qwen2(cfg, three)
  logits = lambda model: jax.jit(lambda p: model.apply({"params": p}, tokens))(params)
  np.testing.assert_array_equal(np.asarray(logits(model_f)), np.asarray(logits(model_t)))
  g_f, g_t = (jax.jit(jax.grad(_loss(m, tokens)))(params) for m in (model_f, model_t))
  bf16 = Qwen2(cfg, make_dot_general_factory(PrecisionConfig(recipe="bf16")))
  g_bf16 = jax.jit(jax.grad(_loss(bf16, tokens)))(params)
  assert _relative_error(g_f, g_t) < min(3e-2, 0.3 * _relative_error(g_t, g_bf16))


@pytest.mark.parametrize("recipe,kv_heads", [("infir2", 2), ("infir2", 1), ("bf16", 2)])
def test_fused_qkv_per_shard_equals_one_device(recipe, kv_heads):
  """fsdp 2 x tensor 2 on 4 CPU devices: the fused product runs inside shard_map, each
  device concatenating its own q and k/v heads (one KV head: k and v replicated over
  tensor), and gives one device's loss and gradients (float32 compute). bf16's other
  projections stay with XLA's partitioner."""
  cfg = dataclasses.replace(CFG, num_kv_heads=kv_heads, dtype="float32")
  tokens = jax.random.randint(jax.random.key(2), (4, 128), 0, cfg.vocab_size)
  factory = make_dot_general_factory(PrecisionConfig(recipe=recipe, backend="xla"))
  model = Qwen2(cfg, factory)
  loss = _loss(model, tokens)
  params = nn.unbox(init_params(model, jax.random.key(0)))
  params = jax.tree_util.tree_map_with_path(   # nonzero biases
      lambda path, p: p + 0.05 if path[-1].key == "bias" else p, params)
  want_loss, want_grads = jax.jit(jax.value_and_grad(loss))(params)
  with meshes.fsdp2_tensor2(cfg):
    forward = str(jax.make_jaxpr(loss)(params))
    got_loss, got_grads = jax.jit(jax.value_and_grad(loss))(params)
  # per layer: q/k/v, o and the MLP, each in its own shard_map (not XLA's partitioner)
  per_layer = 1 if recipe == "bf16" else 3
  assert forward.count("shard_map[") == per_layer * cfg.num_layers
  np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)
  assert _relative_error(got_grads, want_grads) < 3e-2
  for name in ("q_proj", "k_proj", "v_proj"):   # the biases' own (summed over devices)
    got, want = (g["layers_0"]["self_attn"][name]["bias"] for g in (got_grads, want_grads))
    assert _relative_error(got, want) < 3e-2, name
