"""FP8 projections of shard-local recipes run per shard (shard_map): the local GEMM shapes.

Numerics across meshes are checked by test_sharding_equivalence (infir2 on four meshes equals
one device); here: which recipes take the per-shard path, and that each projection's GEMM
sees exactly its shard (tokens / batch ways, N or K / tensor ways), which is what an opaque
Pallas kernel needs so that no GPU computes another GPU's part.
"""

import collections

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from infir2_jax import parallel
from infir2_jax.model import Qwen2
from infir2_jax.precision import PrecisionConfig, get_recipe, make_dot_general_factory, recipe_names
from infir2_jax.precision.per_shard import shard_local
from test_sharding_equivalence import LENGTH, ROWS, make_batch, tiny_config


def test_which_recipes_are_shard_local():
  local = {name for name in recipe_names() if shard_local(get_recipe(name))}
  assert local == {n for n in recipe_names() if n.startswith("infir2")}
  assert not shard_local(get_recipe("bf16"))  # nothing quantized


def _local_gemm_shapes(recipe: str, mesh_shape, **precision):
  cfg = tiny_config()
  model = Qwen2(cfg.model, make_dot_general_factory(PrecisionConfig(recipe=recipe,
                                                                    backend="xla", **precision)))
  mesh_cfg = parallel.MeshConfig(*mesh_shape)
  mesh = parallel.make_mesh(mesh_cfg, jax.devices()[:mesh_shape[0] * mesh_shape[1] * mesh_shape[2]])
  rules = parallel.logical_rules(mesh_cfg, cfg.model, mesh)
  batch = make_batch()
  params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    jaxpr = jax.make_jaxpr(lambda p: model.apply(p, batch["inputs"], batch["positions"],
                                                 batch["segment_ids"]))(params)
  shapes = collections.Counter()
  def walk(j):
    for e in j.eqns:
      if e.primitive.name == "shard_map":
        inner = e.params["jaxpr"]
        shapes[tuple(tuple(v.aval.shape) for v in getattr(inner, "jaxpr", inner).invars)] += 1
      for p in e.params.values():
        for sub in (p if isinstance(p, (list, tuple)) else [p]):
          inner = getattr(sub, "jaxpr", sub)
          if hasattr(inner, "eqns"):
            walk(inner)
  walk(jaxpr.jaxpr)
  return shapes


@pytest.mark.parametrize("fused_qkv", [True, False])
def test_infir2_projections_see_only_their_shard(fused_qkv):
  # mesh data 1 x fsdp 2 x tensor 4; hidden 1024, 4 heads and 2 KV heads of 128, MLP 512.
  # KV heads are replicated at tensor 4 (2 < 4); o splits K over tensor (partial sums); the
  # fused MLP takes gate's and up's columns of its shard and down's rows (partial sums); the
  # fused q/k/v product its shard of q's columns and k's and v's whole (replicated) ones,
  # and of their biases.
  rows = ROWS // 2
  want = collections.Counter({
      ((rows, LENGTH, 512 // 4), (512 // 4, 1024)): 1,  # o_proj
      ((rows, LENGTH, 1024), (1024, 512 // 4), (1024, 512 // 4), (512 // 4, 1024)): 1,  # mlp
  })
  if fused_qkv:
    want[(rows, LENGTH, 1024), (1024, 512 // 4), (1024, 256), (1024, 256),
         (512 // 4,), (256,), (256,)] = 1
  else:
    want[(rows, LENGTH, 1024), (1024, 512 // 4)] = 1   # q_proj
    want[(rows, LENGTH, 1024), (1024, 256)] = 2        # k_proj, v_proj
  assert _local_gemm_shapes("infir2", (1, 2, 4), fused_qkv=fused_qkv) == want


@pytest.mark.parametrize("recipe", ["bf16", "fp8_tensorwise", "fp8_rowwise"])
def test_other_recipes_stay_with_xla_partitioning(recipe):
  assert not _local_gemm_shapes(recipe, (1, 2, 4), fused_qkv=False)


def test_bf16_runs_only_its_fused_qkv_per_shard():
  # bf16's o, gate, up and down stay with XLA's partitioner; its fused q/k/v product
  # concatenates each device's own heads (q's shard, the replicated k and v) and biases.
  want = collections.Counter({((ROWS // 2, LENGTH, 1024), (1024, 512 // 4), (1024, 256),
                                (1024, 256), (512 // 4,), (256,), (256,)): 1})
  assert _local_gemm_shapes("bf16", (1, 2, 4)) == want


def test_single_device_has_no_shard_map():
  assert not _local_gemm_shapes("infir2", (1, 1, 1))
