"""The gradients of the per-feature params (q/k/v biases, the norms' scales) are float32 sums.

Broadcast in bf16, autodiff's transpose sums a bf16 cotangent over the tokens in a bf16
reduction, and XLA:GPU adds a bf16 reduction in bf16: on the H200 every partial sum of the
16,384 tokens rounded (`add.rn.bf16`, session 31; `benchmarks/peak_buffers.py` counts such
reductions in the compiled step). XLA:CPU computes in float32, so the values here cannot
show it: the gradient's jaxpr must hold no bf16 reduce_sum, which the GPU compiles as it is.
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from infir2_jax.model import ModelConfig, Qwen2
from infir2_jax.precision import PrecisionConfig, make_dot_general_factory
from infir2_jax.precision.cotangents import broadcast_like
from test_remat_fp8 import _all_eqns

CFG = ModelConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_layers=2,
                  num_heads=2, num_kv_heads=1, head_dim=128, dtype="bfloat16")


def test_broadcast_like_is_the_cast_and_its_gradient_one_rounding_of_the_sum():
  rng = np.random.default_rng(0)
  v = jnp.asarray(rng.standard_normal(64), jnp.float32)
  like = jnp.zeros((4096, 64), jnp.bfloat16)
  np.testing.assert_array_equal(
      np.asarray(broadcast_like(v, like), np.float32),
      np.broadcast_to(np.asarray(v.astype(jnp.bfloat16), np.float32), like.shape))
  c = jnp.asarray(rng.standard_normal((4096, 64)) + 0.05, jnp.bfloat16)
  grad = jax.grad(lambda v: jnp.sum((broadcast_like(v, like) * c).astype(jnp.float32)))
  v16 = v.astype(jnp.bfloat16)
  got = np.asarray(grad(v16), np.float32)
  want = np.asarray(c, np.float64).sum(0).astype(ml_dtypes.bfloat16).astype(np.float32)
  ulp = np.abs(want) * 2.0**-7
  assert np.all(np.abs(got - want) <= ulp), np.max(np.abs(got - want) / ulp)
  assert np.mean(got == want) > 0.95   # one rounding of a float32 sum: almost always exact


def _bf16_sums(factory, cfg) -> list:
  model = Qwen2(cfg, factory) if factory else Qwen2(cfg)
  tokens = jnp.zeros((2, 128), jnp.int32)
  params = jax.eval_shape(lambda: nn.unbox(model.init(jax.random.key(0), tokens)["params"]))
  # the train step differentiates the params' bf16 copies (train/step.py)
  params = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, jnp.bfloat16), params)
  loss = lambda p, t: jnp.mean(model.apply({"params": p}, t).astype(jnp.float32) ** 2)
  jaxpr = jax.make_jaxpr(jax.grad(loss))(params, tokens).jaxpr
  return [tuple(e.invars[0].aval.shape) for e in _all_eqns(jaxpr)
          if e.primitive.name == "reduce_sum" and e.invars[0].aval.dtype == jnp.bfloat16]


@pytest.mark.parametrize("remat", ["none", "save_dots_fp8", "full"])
@pytest.mark.parametrize("precision", [
    None, PrecisionConfig(recipe="infir2", backend="xla"),
    PrecisionConfig(recipe="infir2", backend="xla", fused_norm=True)],
    ids=["bf16", "infir2", "infir2_fused_norm"])
def test_no_gradient_is_summed_in_bf16(precision, remat):
  factory = make_dot_general_factory(precision) if precision else None
  cfg = dataclasses.replace(CFG, remat=remat)
  assert _bf16_sums(factory, cfg) == []
