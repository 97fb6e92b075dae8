"""The pre-norm blocks' RMSNorms fused into their FP8 consumers (precision/normed.py,
precision.fused_norm): the fused MLP takes the post-attention norm's NormedInput(f32(h),
inv, gamma, dtype) instead of the normed x, the fused q|k|v product (its FP8 dot_general)
the input_layernorm's.

Bit-for-bit comparisons compile with xla_allow_excess_precision off (EXACT): with it on,
XLA:CPU drops the bf16 rounding of a y = gamma * bf16(h * inv) that it fuses into the XLA
quantizer, so an unfused reference would not quantize the y that RMSNorm defines (the
library's own fallback keeps the rounding behind a barrier, tested below with it on).
"""
import collections
import dataclasses
import functools
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

from infir2_jax.model import ModelConfig, Qwen2, init_params
from infir2_jax.config import load_config
from infir2_jax.precision import (
    MlpAxes, PrecisionConfig, dot_general, gemm, get_recipe, kernels,
    make_dot_general_factory, make_gated_mlp)
from infir2_jax.precision.cotangents import broadcast_like
from infir2_jax.precision.fused_qkv import make_fused_qkv
from infir2_jax.precision.per_shard import QkvAxes
from infir2_jax.precision.dot_general import GemmPlan, quantize_normed_rows, quantize_rows
from infir2_jax.precision.kernels.quantize import quantize_normed_tiles_reference
from infir2_jax.precision.normed import NormedInput, materialize, normed_vjp
from infir2_jax.train import grads
from tests import meshes

D, F, EPS = 256, 512, 1e-6
LEAD = (2, 128)   # M = 256 tokens
EXACT = {"xla_allow_excess_precision": False}
BF16 = ml_dtypes.bfloat16


def _inv(h):
  """RMSNorm's row statistics, written out as model.layers.RMSNorm has them."""
  h32 = h.astype(jnp.float32)
  return lax.rsqrt(jnp.mean(h32 * h32, axis=-1, keepdims=True) + EPS)


def _normed(h, gamma):
  """The NormedInput RMSNorm(deferred=True) makes of h (in the compute dtype)."""
  return NormedInput(h.astype(jnp.float32), _inv(h), gamma, np.dtype(h.dtype))


def _operands(seed=0):
  r = np.random.default_rng(seed)
  h = jnp.asarray(r.standard_normal((*LEAD, D)) * 3, jnp.bfloat16)
  gamma = jnp.asarray(1 + 0.3 * r.standard_normal(D), jnp.float32)
  wg, wu = (jnp.asarray(r.standard_normal((D, F)) * 0.06, jnp.bfloat16) for _ in range(2))
  wd = jnp.asarray(r.standard_normal((F, D)) * 0.06, jnp.bfloat16)
  ct = jnp.asarray(r.standard_normal((*LEAD, D)), jnp.float32)
  return (h, gamma, wg, wu, wd), ct


def _bits_equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


# --- normed.py -----------------------------------------------------------------------------

def test_normed_vjp_is_autodiff_of_the_norms_product():
  """The cotangents against RMSNorm's product differentiated by jax (inv an input), and
  against its derivative in numpy: g = bf16(dy * bf16(gamma)), dh = g * inv in float32 (not
  rounded: RMSNorm's autodiff adds the statistics' part before the one rounding),
  dinv = sum(g * h) (float32: to float32's rounding). dgamma = sum(bf16(dy * bf16(h * inv)))
  is a float32 sum rounded once to bf16 (precision/cotangents.broadcast_like; it was a bf16
  sum before session 31), checked to the products' and the one sum's rounding."""
  (h, gamma, *_), dy = _operands(1)
  dy = dy.astype(jnp.bfloat16)
  n = _normed(h, gamma)
  got = jax.jit(normed_vjp, compiler_options=EXACT)(n, dy)
  def product(h32, inv, scale):
    y = (h32 * inv).astype(jnp.bfloat16)
    return broadcast_like(scale, y) * y
  want = jax.jit(lambda *a: jax.vjp(product, *a)[1](dy), compiler_options=EXACT)(
      n.h, n.inv, n.gamma)
  # dgamma below, to its rounding: a float32 sum, into which XLA may fuse the bf16 products
  # unrounded (it did in one of the two compiles)
  _bits_equal((got.h, got.inv), want[:2])
  assert (got.h.dtype, got.inv.dtype, got.gamma.dtype, got.dtype) == (
      jnp.float32, jnp.float32, jnp.float32, jnp.bfloat16)
  f32 = lambda x: np.asarray(x, np.float32)
  g = (f32(dy) * f32(gamma.astype(jnp.bfloat16))).astype(BF16).astype(np.float32)
  np.testing.assert_array_equal(f32(got.h), g * f32(n.inv))
  np.testing.assert_allclose(f32(got.inv), (g * f32(h)).sum(-1, keepdims=True), rtol=1e-5,
                             atol=1e-4)
  normalized = (f32(h) * f32(n.inv)).astype(BF16).astype(np.float64)   # y / gamma
  terms = np.asarray(dy, np.float64) * normalized
  # each product rounded to bf16 (u = 2^-9) or not, the float32 sum rounded once (u |sum|)
  bound = 2 ** -9 * np.abs(terms).sum((0, 1)) + 2 ** -8 * np.abs(terms.sum((0, 1)))
  for dgamma in (got.gamma, want[2], jax.jit(normed_vjp)(n, dy).gamma):
    assert (np.abs(f32(dgamma) - terms.sum((0, 1))) <= bound).all()


def test_quantize_normed_rows_is_quantize_rows_of_the_normed_operand():
  """The XLA path against quantize_rows of y made op by op (eagerly: every bf16 rounding
  kept), compiled with excess precision ON, as training compiles it: without its barrier
  3.5% of the FP8 values came from the unrounded float32 y."""
  (h, gamma, *_), _ = _operands(2)
  h = h.reshape(-1, D)
  n = _normed(h, gamma)
  r = get_recipe("infir2")
  plan = GemmPlan(r, "xla", np.dtype(jnp.bfloat16), np.dtype(jnp.bfloat16),
                  np.dtype(jnp.bfloat16), np.dtype(jnp.bfloat16), False, False)
  got = jax.jit(lambda n: quantize_normed_rows(plan, n, r.fprop.lhs, r.wgrad.lhs))(n)
  want = quantize_rows(plan, materialize(n), r.fprop.lhs, r.wgrad.lhs)
  for g, w in zip(got, want):
    assert g.tile == w.tile and g.scale_format == w.scale_format
    _bits_equal((g.q, g.scale), (w.q, w.scale))


# --- the fused MLP on a NormedInput ----------------------------------------------------------

def _losses(mlp, ct):
  """loss(normed, h, gamma, wg, wu, wd): the MLP on the NormedInput of h, or on its
  materialized y (the unfused composition), against the cotangent ct."""
  def loss(normed, h, gamma, *w):
    n = _normed(h, gamma)
    y = mlp(n if normed else materialize(n), *w)
    return jnp.sum(y.astype(jnp.float32) * ct)
  return loss


def _value_and_grads(loss, normed, args):
  fn = lambda *a: (loss(normed, *a), jax.grad(loss, argnums=(1, 2, 3, 4, 5))(normed, *a))
  return jax.jit(fn, compiler_options=EXACT)(*args)


@pytest.mark.parametrize("recipe", ["infir2", "infir2_fp32_scale"])
def test_fused_mlp_on_a_normed_input_is_the_composition(recipe):
  """Output and the gradients of h (through inv too), gamma and the three weights bit for
  bit as jax.grad of materialize -> fused MLP."""
  args, ct = _operands()
  loss = _losses(make_gated_mlp(recipe, backend="xla", fused_norm=True), ct)
  (value_n, grads_n), (value_m, grads_m) = (_value_and_grads(loss, normed, args)
                                            for normed in (True, False))
  _bits_equal(value_n, value_m)
  _bits_equal(grads_n, grads_m)
  assert grads_n[1].dtype == jnp.float32 and grads_n[0].dtype == jnp.bfloat16


def test_a_width_that_is_not_whole_tiles_materializes_the_normed_input():
  """F = 200: the composition of three products, on the materialized x."""
  args, ct = _operands()
  h, gamma = args[:2]
  r = np.random.default_rng(5)
  wg, wu = (jnp.asarray(r.standard_normal((D, 200)) * 0.06, jnp.bfloat16) for _ in range(2))
  wd = jnp.asarray(r.standard_normal((200, D)) * 0.06, jnp.bfloat16)
  loss = _losses(make_gated_mlp("infir2", backend="xla", fused_norm=True), ct)
  _bits_equal(*(_value_and_grads(loss, normed, (h, gamma, wg, wu, wd))
                for normed in (True, False)))


def _stand_in_kernels(calls, quantize_normed_tiles=quantize_normed_tiles_reference):
  """A kernels module as on a Hopper GPU: every kernel its jnp reference, but
  quantize_normed_tiles as given (absent for None), all counted (per trace: one call per op
  of a jitted function)."""
  def counted(name, fn):
    def run(*args, **kwargs):
      calls[name] += 1
      return fn(*args, **kwargs)
    return run
  module = types.SimpleNamespace(
      available=lambda: True, supports=kernels.supports,
      block_scaled_matmul=counted("gemm", kernels.block_scaled_matmul_reference),
      quantize_tiles=counted("quantize_tiles", kernels.quantize_tiles_reference),
      quantize_blocks=counted("quantize_blocks", kernels.quantize_blocks_reference),
      swiglu_quantize=counted("swiglu_quantize", kernels.swiglu_quantize_reference),
      swiglu_bwd_quantize=counted("swiglu_bwd_quantize",
                                  kernels.swiglu_bwd_quantize_reference))
  if quantize_normed_tiles is not None:
    module.quantize_normed_tiles = counted("quantize_normed_tiles", quantize_normed_tiles)
  return module


NORMED_KERNELS = {
    "reference": quantize_normed_tiles_reference,
    "interpreted": functools.partial(kernels.quantize_normed_tiles, interpret=True),
    "absent": None}


def _stand_in_forwards(monkeypatch, normed_kernel, loss, args):
  """With the stand-in kernels (NORMED_KERNELS[normed_kernel] as quantize_normed_tiles):
  loss's forward on the NormedInput equals its forward on y bit for bit; returns the kernel
  calls the two traces made."""
  calls = collections.Counter()
  stand_in = _stand_in_kernels(calls, NORMED_KERNELS[normed_kernel])
  monkeypatch.setattr(gemm, "pallas_kernels", lambda backend: stand_in)
  forward = lambda normed: jax.jit(lambda *a: loss(normed, *a), compiler_options=EXACT)(*args)
  _bits_equal(forward(True), forward(False))
  return calls


@pytest.mark.parametrize("normed_kernel", list(NORMED_KERNELS))
def test_on_hopper_the_normed_tiles_come_from_one_kernel(monkeypatch, normed_kernel):
  """With the kernels (stand-ins; quantize_normed_tiles its reference, or the Mosaic GPU
  kernel interpreted), the forward quantizes x once, from h: one quantize_normed_tiles call
  and no quantize_tiles of a materialized x; the same output and gradients as the
  materialized x through the reference kernels. A kernels module without
  quantize_normed_tiles falls back to quantize_tiles of y."""
  args, ct = _operands(3)
  loss = _losses(make_gated_mlp("infir2", backend="auto", fused_norm=True), ct)
  calls = _stand_in_forwards(monkeypatch, normed_kernel, loss, args)
  assert calls["swiglu_quantize"] == 2 and calls["gemm"] == 4   # two forwards traced
  with_normed = NORMED_KERNELS[normed_kernel] is not None
  assert (calls["quantize_normed_tiles"], calls["quantize_tiles"]) == (
      (1, 1) if with_normed else (0, 2))
  _bits_equal(*(_value_and_grads(loss, normed, args) for normed in (True, False)))


def test_the_kernel_is_used_only_where_it_applies(monkeypatch):
  """Not with the Triton quantizers (it has no Triton twin), nor without X^T's spec, nor
  for a float32 h (quantizer_kernels declines: the kernels read bf16)."""
  stand_in = _stand_in_kernels(collections.Counter())
  monkeypatch.setattr(gemm, "pallas_kernels", lambda backend: stand_in)
  (h, gamma, *_), _ = _operands()
  h = h.reshape(-1, D)
  r = get_recipe("infir2")
  bf16 = np.dtype(jnp.bfloat16)
  plan = lambda quantize_backend: GemmPlan(r, "auto", bf16, bf16, bf16, bf16, False, False,
                                           quantize_backend=quantize_backend)
  n = _normed(h, gamma)
  assert dot_general._normed_kernel(plan("mosaic"), n, r.fprop.lhs, r.wgrad.lhs) is not None
  assert dot_general._normed_kernel(plan("triton"), n, r.fprop.lhs, r.wgrad.lhs) is None
  assert dot_general._normed_kernel(plan("mosaic"), n, r.fprop.lhs, None) is None
  n32 = NormedInput(n.h, n.inv, n.gamma, np.dtype(jnp.float32))   # a float32 model
  assert dot_general._normed_kernel(plan("mosaic"), n32, r.fprop.lhs, r.wgrad.lhs) is None


# --- the fused q|k|v product on a NormedInput ------------------------------------------------

def _qkv_operands(widths=(256, 128, 128), seed=6):
  """(h, gamma, wq, wk, wv) and a cotangent per output."""
  r = np.random.default_rng(seed)
  (h, gamma, *_), _ = _operands(seed)
  ws = tuple(jnp.asarray(r.standard_normal((D, n)) * 0.06, jnp.bfloat16) for n in widths)
  cts = tuple(jnp.asarray(r.standard_normal((*LEAD, n)), jnp.float32) for n in widths)
  return (h, gamma, *ws), cts


def _qkv_losses(qkv, cts):
  """loss(normed, h, gamma, wq, wk, wv): the product on the NormedInput of h, or on its
  materialized y, against one cotangent per output."""
  def loss(normed, h, gamma, *w):
    n = _normed(h, gamma)
    outs = qkv(n if normed else materialize(n), *w)
    return sum(jnp.sum(y.astype(jnp.float32) * ct) for y, ct in zip(outs, cts))
  return loss


@pytest.mark.parametrize("recipe,widths", [
    ("infir2", (256, 128, 128)), ("infir2_fp32_scale", (256, 128, 128)),
    ("infir2", (256, 200, 200)), ("bf16", (256, 128, 128))])
def test_fused_qkv_on_a_normed_input_is_the_composition(recipe, widths):
  """q, k, v and the gradients of h (through inv too), gamma and the three weights bit for
  bit as jax.grad of materialize -> the product: the one FP8 dot_general on the NormedInput,
  and where it is not that (widths not whole tiles: three products; bf16) on y materialized
  inside."""
  args, cts = _qkv_operands(widths)
  qkv = make_fused_qkv(recipe, backend="xla", fused_norm=True)
  assert qkv.accepts_normed is (recipe != "bf16")
  loss = _qkv_losses(qkv, cts)
  (value_n, grads_n), (value_m, grads_m) = (_value_and_grads(loss, normed, args)
                                            for normed in (True, False))
  _bits_equal(value_n, value_m)
  _bits_equal(grads_n, grads_m)
  assert grads_n[1].dtype == jnp.float32 and grads_n[0].dtype == jnp.bfloat16


@pytest.mark.parametrize("normed_kernel", ["reference", "absent"])
def test_on_hopper_the_qkv_tiles_come_from_one_kernel(monkeypatch, normed_kernel):
  """With the kernels (stand-ins), the q|k|v forward quantizes x once, from h: one
  quantize_normed_tiles call and no quantize_tiles of a materialized x (the unfused forward
  has the one); the same output and gradients as the materialized x."""
  args, cts = _qkv_operands(seed=7)
  loss = _qkv_losses(make_fused_qkv("infir2", backend="auto", fused_norm=True), cts)
  calls = _stand_in_forwards(monkeypatch, normed_kernel, loss, args)
  assert calls["gemm"] == 2   # one product per forward traced
  with_normed = NORMED_KERNELS[normed_kernel] is not None
  assert (calls["quantize_normed_tiles"], calls["quantize_tiles"]) == (
      (1, 1) if with_normed else (0, 2))
  _bits_equal(*(_value_and_grads(loss, normed, args) for normed in (True, False)))


def test_the_fp8_dot_general_takes_a_normed_lhs_only_as_dense():
  """A NormedInput lhs contracted on another axis than its last is refused; with telemetry
  it is materialized first (the same product and statistics as on y)."""
  (h, gamma, wq, *_), _ = _qkv_operands()
  n = _normed(h, gamma)
  over_length = wq[:LEAD[1]]   # [L, N]: contracts h's length axis
  with pytest.raises(NotImplementedError, match="last axis only"):
    dot_general.quantized_dot_general(n, over_length, (((1,), (0,)), ((), ())),
                                      recipe=get_recipe("infir2"), backend="xla")
  dims = (((2,), (0,)), ((), ()))
  run = jax.jit(lambda x, w: dot_general.quantized_dot_general(
      x, w, dims, recipe=get_recipe("infir2"), backend="xla", telemetry=True),
      compiler_options=EXACT)
  _bits_equal(run(n, wq), run(materialize(n), wq))


# --- the factory and the model ---------------------------------------------------------------

def test_the_factory_hands_the_flag_to_the_fused_mlp():
  path, axes = "layers_3/mlp", MlpAxes(x=("batch", "length", "act_embed"),
                                       hidden=("act_embed", "act_mlp"))
  made = lambda **kw: make_dot_general_factory(PrecisionConfig(recipe="infir2", **kw))
  assert PrecisionConfig().fused_norm is False
  assert made().gated_mlp(path).accepts_normed is False
  assert made(fused_norm=True).gated_mlp(path).accepts_normed is True
  assert made(fused_norm=True).gated_mlp(path, axes).accepts_normed is True   # per shard
  assert made(fused_norm=True, fused_mlp=False).gated_mlp(path) is None
  qkv_path, qkv_axes = "layers_3/self_attn", QkvAxes(x=("batch", "length", "act_embed"),
                                                     q=("act_embed", "act_heads"),
                                                     kv=("act_embed", "act_kv_heads"))
  assert made().fused_qkv(qkv_path).accepts_normed is False
  assert made(fused_norm=True).fused_qkv(qkv_path).accepts_normed is True
  assert made(fused_norm=True).fused_qkv(qkv_path, qkv_axes).accepts_normed is True
  bf16 = make_dot_general_factory(PrecisionConfig(recipe="bf16", fused_norm=True))
  assert bf16.fused_qkv(qkv_path).accepts_normed is False   # nothing to fuse it into
  assert load_config(overrides={"precision.fused_norm": True}).precision.fused_norm is True


CFG = ModelConfig(vocab_size=512, hidden_size=D, intermediate_size=F, num_layers=2,
                  num_heads=2, num_kv_heads=2, head_dim=128, remat="save_dots")


def _model(cfg, recipe="infir2", backend="xla", **precision):
  factory = make_dot_general_factory(PrecisionConfig(recipe=recipe, backend=backend,
                                                     **precision))
  return Qwen2(cfg, factory)


def _loss(model, tokens):
  return lambda p: jnp.mean(model.apply({"params": p}, tokens).astype(jnp.float32) ** 2)


def _fake_kernels():
  """tests/test_remat_fp8.py's kernels as opaque primitives, quantize_normed_tiles too."""
  from test_remat_fp8 import _FAKE_KERNELS, _opaque
  return types.SimpleNamespace(**vars(_FAKE_KERNELS), quantize_normed_tiles=_opaque(
      quantize_normed_tiles_reference, "fake_quantize_normed_tiles"))


def _normed_tiles_in_forward(monkeypatch, cfg) -> int:
  """quantize_normed_tiles calls in the jaxpr of the model's loss with the fused norm."""
  from test_remat_fp8 import _count_primitives
  fake = _fake_kernels()
  with monkeypatch.context() as patch:
    patch.setattr(gemm, "pallas_kernels", lambda backend: fake)
    model = _model(cfg, fused_norm=True, backend="pallas")
    tokens = jnp.zeros((2, 128), jnp.int32)
    init = _model(dataclasses.replace(cfg, scan_layers=False), fused_norm=True,
                  backend="pallas").init
    params = jax.eval_shape(lambda: nn.unbox(init(jax.random.key(0), tokens))["params"])
    jaxpr = jax.make_jaxpr(_loss(model, tokens))(params).jaxpr
  return _count_primitives(jaxpr, collections.Counter())["fake_quantize_normed_tiles"]


def _relative_error(tree, ref) -> float:
  flat = lambda t: np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(t)])
  return float(np.linalg.norm(flat(tree) - flat(ref)) / np.linalg.norm(flat(ref)))


@pytest.mark.parametrize("scan_layers", [False, True])
def test_model_with_the_fused_norm_is_the_model_without(monkeypatch, scan_layers):
  """Both norms of every layer deferred (one quantize_normed_tiles each in the forward,
  kernels as opaque stand-ins), and still the same params (names, shapes, partitioning),
  loss and every gradient bit for bit: the norm's product differentiated inside the MLP's
  and the q|k|v product's custom_vjp hands dh back in float32, so it adds to the row
  statistics' part before the one rounding to bf16, as RMSNorm's autodiff does (a bf16 h
  had rounded it alone first: 1.3% of the gradients' norm, amplified by FP8 upstream). The
  gradients' dtypes for the optimizer (train/grads.py) agree."""
  cfg = dataclasses.replace(CFG, scan_layers=scan_layers)
  normed_tiles = _normed_tiles_in_forward(monkeypatch, cfg)
  assert normed_tiles == 2 * (1 if scan_layers else cfg.num_layers)   # one layer body
  tokens = jax.random.randint(jax.random.key(1), (2, 128), 0, cfg.vocab_size)
  init_cfg = dataclasses.replace(cfg, scan_layers=False)
  boxed = {flag: jax.jit(_model(init_cfg, fused_norm=flag).init)(jax.random.key(0), tokens)
           for flag in (False, True)}
  spec = lambda tree: jax.tree.map(lambda b: (b.value.shape, b.names), tree,
                                   is_leaf=lambda b: isinstance(b, nn.Partitioned))
  assert spec(boxed[True]) == spec(boxed[False])
  params = nn.unbox(boxed[False])["params"]
  _bits_equal(params, nn.unbox(boxed[True])["params"])
  step = lambda model: jax.jit(jax.value_and_grad(_loss(model, tokens)),
                               compiler_options=EXACT)(params)
  (loss_on, g_on), (loss_off, g_off) = (step(_model(cfg, fused_norm=flag))
                                        for flag in (True, False))
  _bits_equal(loss_on, loss_off)
  _bits_equal(g_on, g_off)
  g_bf16 = step(_model(cfg, recipe="bf16"))[1]
  assert _relative_error(g_off, g_bf16) > 1e-2   # the FP8 path ran (not bf16 throughout)
  dtypes = {flag: grads.compute_dtypes(_loss(_model(cfg, fused_norm=flag), tokens), params)
            for flag in (False, True)}
  assert dtypes[True] == dtypes[False]


@pytest.mark.parametrize("remat", ["none", "save_dots", "save_dots_fp8"])
def test_remat_treats_the_normed_tiles_as_the_tiles_of_x(monkeypatch, remat):
  """Kernels as opaque primitives (tests/test_remat_fp8.py): under each policy the model
  with the fused norm runs the same FP8 GEMMs as without, and quantize_normed_tiles where
  it quantized x, for both norms of each layer (no extra re-quantization, and under
  save_dots_fp8 none at all)."""
  from test_remat_fp8 import _count_primitives
  fake = _fake_kernels()
  monkeypatch.setattr(gemm, "pallas_kernels", lambda backend: fake)
  cfg = dataclasses.replace(CFG, remat=remat)
  tokens = jnp.zeros((2, 128), jnp.int32)
  def counts(fused_norm):
    model = _model(cfg, fused_norm=fused_norm, backend="pallas")
    params = jax.eval_shape(lambda: nn.unbox(model.init(jax.random.key(0), tokens))["params"])
    jaxpr = jax.make_jaxpr(jax.grad(_loss(model, tokens)))(params).jaxpr
    return _count_primitives(jaxpr, collections.Counter())
  on, off = counts(True), counts(False)
  assert on["fake_fp8_gemm"] == off["fake_fp8_gemm"]
  normed_tiles = on["fake_quantize_normed_tiles"]
  assert normed_tiles == 2 * cfg.num_layers * (2 if remat == "save_dots" else 1), on
  assert on["fake_quantize_tiles"] + normed_tiles == off["fake_quantize_tiles"], (on, off)


def test_fused_norm_per_shard_equals_one_device():
  """fsdp 2 x tensor 2 on 4 CPU devices: the NormedInputs enter the MLP's and the q|k|v
  product's shard_maps (h and inv split like the tokens, gamma whole) and give one device's
  loss and gradients (float32 compute, tolerances as tests/test_fused_mlp.py's per-shard
  test)."""
  cfg = dataclasses.replace(CFG, dtype="float32", num_layers=1)
  tokens = jax.random.randint(jax.random.key(2), (4, 128), 0, cfg.vocab_size)
  model = _model(cfg, fused_norm=True)
  loss = _loss(model, tokens)
  params = nn.unbox(init_params(model, jax.random.key(0)))
  want_loss, want_grads = jax.jit(jax.value_and_grad(loss))(params)
  with meshes.fsdp2_tensor2(cfg):
    jaxpr = jax.make_jaxpr(jax.value_and_grad(loss))(params)
    got_loss, got_grads = jax.jit(jax.value_and_grad(loss))(params)
  inputs = [[v.aval.shape for v in e.params["jaxpr"].invars] for e in jaxpr.jaxpr.eqns
            if e.primitive.name == "shard_map" and len(e.invars) in (6, 9)]
  normed = [(2, 128, D), (2, 128, 1), (D,)]
  assert normed + [(D, F // 2), (D, F // 2), (F // 2, D)] in inputs   # the MLP
  # q|k|v: each device's one head of each, and of each bias
  assert normed + [(D, 128)] * 3 + [(128,)] * 3 in inputs
  np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)
  assert _relative_error(got_grads, want_grads) < 3e-2
