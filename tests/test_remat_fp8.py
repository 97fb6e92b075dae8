"""Remat policies under FP8 recipes: the backward pass must not recompute the forward GEMMs.

On Hopper the FP8 GEMM is a Pallas call, not a dot_general, so a dots-only policy would not
save its output and the backward pass would redo the forward GEMMs (about +25% GEMM work per
step). Here the kernels are replaced by opaque primitives (jnp references inside, like a
pallas_call to the remat machinery) and the GEMMs in the gradient's jaxpr are counted.
"""

import collections
import dataclasses
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Jaxpr, Primitive
from jax.interpreters import mlir

import infir2_jax.precision.kernels as kernels
from infir2_jax.model import ModelConfig, Qwen2, init_params
from infir2_jax.precision import (
    PrecisionConfig, gemm, make_dot_general, make_dot_general_factory)
from tests import meshes

FUSED_BACKWARD = PrecisionConfig().fused_mlp_backward

# 128-aligned widths: every projection takes the kernel path
CFG = ModelConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_layers=2,
                  num_heads=2, num_kv_heads=1, head_dim=128, dtype="bfloat16")
PROJECTIONS_PER_LAYER = 7  # q, k, v, o, gate, up, down
# FP8 GEMMs of a layer: 3 per projection; with the factory's fused ops (precision.fused_qkv,
# precision.fused_mlp) q, k and v are one GEMM each way, gate and up another: 3 x 2 for
# attention, 3 x 2 for the MLP.
GEMMS_PER_LAYER = {False: 3 * PROJECTIONS_PER_LAYER, True: 3 * 2 + 3 * 2}


def _opaque(fn, name: str):
  """fn behind a primitive of its own: remat policies see no dot_general inside."""
  prim = Primitive(name)
  prim.multiple_results = True

  def impl(*args, **kw):
    out = fn(*args, **kw)
    return list(out) if isinstance(out, (tuple, list)) else [out]

  prim.def_impl(impl)
  prim.def_abstract_eval(lambda *args, **kw: [
      jax.core.ShapedArray(o.shape, o.dtype)
      for o in jax.eval_shape(lambda *a: impl(*a, **kw), *args)])
  mlir.register_lowering(prim, mlir.lower_fun(impl, multiple_results=True))

  def call(*args, **kw):
    out = prim.bind(*args, **kw)
    return out[0] if len(out) == 1 else tuple(out)
  return call


_FAKE_KERNELS = types.SimpleNamespace(
    available=lambda: True, supports=kernels.supports,
    block_scaled_matmul=_opaque(kernels.block_scaled_matmul_reference, "fake_fp8_gemm"),
    quantize_tiles=_opaque(kernels.quantize_tiles_reference, "fake_quantize_tiles"),
    quantize_blocks=_opaque(kernels.quantize_blocks_reference, "fake_quantize_blocks"),
    swiglu_quantize=_opaque(kernels.swiglu_quantize_reference, "fake_swiglu_quantize"),
    swiglu_bwd_quantize=_opaque(kernels.swiglu_bwd_quantize_reference,
                                "fake_swiglu_bwd_quantize"))


@pytest.fixture
def fake_pallas(monkeypatch):
  monkeypatch.setattr(gemm, "pallas_kernels", lambda backend: _FAKE_KERNELS)


def _all_eqns(jaxpr: Jaxpr):
  """Every equation of `jaxpr` and of the jaxprs nested in its equations' params."""
  for eqn in jaxpr.eqns:
    yield eqn
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        if isinstance(sub, Jaxpr):
          yield from _all_eqns(sub)
        elif hasattr(sub, "jaxpr") and isinstance(sub.jaxpr, Jaxpr):
          yield from _all_eqns(sub.jaxpr)


def _count_primitives(jaxpr: Jaxpr, counts: collections.Counter) -> collections.Counter:
  counts.update(eqn.primitive.name for eqn in _all_eqns(jaxpr))
  return counts


def _factory(fused_mlp: bool):
  """infir2 everywhere (the LM head too); with the fused MLP or one dot_general per projection."""
  if fused_mlp:
    return make_dot_general_factory(
        PrecisionConfig(recipe="infir2", backend="pallas", quantize_lm_head=True))
  dot_general = make_dot_general("infir2", backend="pallas")
  return lambda path, axes=None: dot_general


def _grad_fn(remat: str, dtype: str = "bfloat16", fused_mlp: bool = False):
  model = Qwen2(dataclasses.replace(CFG, remat=remat, dtype=dtype), _factory(fused_mlp))
  tokens = jnp.zeros((2, 128), jnp.int32)
  params = jax.eval_shape(lambda: nn.unbox(model.init(jax.random.key(0), tokens)["params"]))
  loss = lambda p, t: jnp.mean(model.apply({"params": p}, t).astype(jnp.float32) ** 2)
  return jax.grad(loss), params, tokens


@pytest.mark.parametrize("fused_mlp", [False, True])
@pytest.mark.parametrize("remat,extra_fprops", [
    ("none", 0), ("save_dots", 0), ("save_dots_fp8", 0),
    # full remat recomputes every forward GEMM whose output the backward pass needs: q, k,
    # v, gate, up (one of each fused op: q/k/v, gate/up)
    ("full", {False: 4, True: 2})])
def test_remat_policy_recomputes_no_fp8_gemm(fake_pallas, remat, extra_fprops, fused_mlp):
  grad, params, tokens = _grad_fn(remat, fused_mlp=fused_mlp)
  if isinstance(extra_fprops, dict):
    extra_fprops = extra_fprops[fused_mlp]
  counts = _count_primitives(jax.make_jaxpr(grad)(params, tokens).jaxpr, collections.Counter())
  # fprop + dgrad + wgrad per projection and for the LM head (these factories give it the
  # recipe too)
  expected = (GEMMS_PER_LAYER[fused_mlp] + extra_fprops) * CFG.num_layers + 3
  if remat == "full":
    assert counts["fake_fp8_gemm"] >= expected, counts
  else:
    assert counts["fake_fp8_gemm"] == expected, counts


@pytest.mark.parametrize("fused_mlp", [False, True])
def test_save_dots_fp8_saves_the_quantized_operands(fake_pallas, fused_mlp):
  counts = {}
  for remat in ("none", "save_dots", "save_dots_fp8"):
    grad, params, tokens = _grad_fn(remat, fused_mlp=fused_mlp)
    c = _count_primitives(jax.make_jaxpr(grad)(params, tokens).jaxpr, collections.Counter())
    counts[remat] = c["fake_quantize_tiles"] + c["fake_swiglu_quantize"]
    if fused_mlp:  # one SwiGLU backward per layer, whatever is saved
      assert c["fake_swiglu_bwd_quantize"] == (CFG.num_layers if FUSED_BACKWARD else 0), c
  assert counts["save_dots_fp8"] == counts["none"] < counts["save_dots"], counts


@pytest.mark.slow
def test_remat_with_fake_kernels_gives_the_same_gradients(fake_pallas):
  """The policies change what is stored, never the values: equal gradients bit for bit.

  In float32 activations: in bf16, a recomputed forward fused differently by XLA may round a
  value the other way, and FP8 quantization turns that into a visibly different gradient
  (a few % of its max on this tiny random model, with or without the named saves).
  """
  tokens = jax.random.randint(jax.random.key(1), (2, 128), 0, CFG.vocab_size)
  grads = {}
  for remat in ("none", "save_dots", "save_dots_fp8", "full"):
    grad = _grad_fn(remat, dtype="float32", fused_mlp=True)[0]
    params = nn.unbox(init_params(Qwen2(CFG), jax.random.key(0)))
    grads[remat] = jax.jit(grad)(params, tokens)
  for remat in ("save_dots", "save_dots_fp8", "full"):
    for a, b in zip(jax.tree.leaves(grads["none"]), jax.tree.leaves(grads[remat])):
      np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("scan_layers", [False, True])
def test_per_shard_gemms_keep_the_policy(fake_pallas, scan_layers):
  """Under FSDP x tensor the FP8 GEMMs run inside shard_map (precision.per_shard); save_dots must
  still find their named outputs there: no GEMM recomputed."""
  factory = make_dot_general_factory(
      PrecisionConfig(recipe="infir2", backend="pallas", quantize_lm_head=True))
  cfg = dataclasses.replace(CFG, remat="save_dots", scan_layers=scan_layers, num_kv_heads=2)
  model = Qwen2(cfg, factory)
  tokens = jnp.zeros((4, 128), jnp.int32)
  params = jax.eval_shape(lambda: nn.unbox(model.init(jax.random.key(0), tokens)["params"]))
  loss = lambda p, t: jnp.mean(model.apply({"params": p}, t).astype(jnp.float32) ** 2)
  with meshes.fsdp2_tensor2(cfg):
    jaxpr = jax.make_jaxpr(jax.grad(loss))(params, tokens).jaxpr
  counts = _count_primitives(jaxpr, collections.Counter())
  assert counts["shard_map"] > 0, "the projections did not run per shard"
  per_layer = GEMMS_PER_LAYER[True] * (1 if scan_layers else CFG.num_layers)
  assert counts["fake_fp8_gemm"] == per_layer + 3, counts  # + the LM head's three
  assert counts["fake_swiglu_bwd_quantize"] == (
      (1 if scan_layers else CFG.num_layers) if FUSED_BACKWARD else 0), counts


def _barrier_fed_gemms(jaxpr: Jaxpr) -> tuple[int, int]:
  """(FP8 GEMMs, of which feed an optimization_barrier directly), through nested jaxprs."""
  gemm_outs, fed, total = set(), set(), 0
  for eqn in _all_eqns(jaxpr):  # a producer comes before its consumers
    if eqn.primitive.name == "fake_fp8_gemm":
      total += 1
      gemm_outs.update(id(v) for v in eqn.outvars)
    if eqn.primitive.name == "optimization_barrier":
      fed.update(id(v) for v in eqn.invars if id(v) in gemm_outs)
  return total, len(fed)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_fprop_kernel_outputs_pass_an_optimization_barrier(fake_pallas, scan_layers):
  """The saved fprop outputs leave the kernel through an optimization barrier; the dgrad and
  wgrad outputs do not. Without it XLA:GPU's dynamic-slice fusion cloned every saved FP8
  GEMM into the scan's stacking update: 27 GEMMs per layer instead of 21 on the H200
  (tests/test_kernels_gpu.py counts them in the compiled step)."""
  _, params, tokens = _grad_fn("save_dots")
  model = Qwen2(dataclasses.replace(CFG, remat="save_dots", scan_layers=scan_layers),
                _factory(fused_mlp=True))
  forward = jax.make_jaxpr(lambda p, t: model.apply({"params": p}, t))(params, tokens).jaxpr
  fprops, fed = _barrier_fed_gemms(forward)
  assert fprops > 0 and fed == fprops, (fprops, fed)
  loss = lambda p, t: jnp.mean(model.apply({"params": p}, t).astype(jnp.float32) ** 2)
  total, fed = _barrier_fed_gemms(jax.make_jaxpr(jax.grad(loss))(params, tokens).jaxpr)
  assert total == 3 * fprops and fed == fprops, (total, fprops, fed)
