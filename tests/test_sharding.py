"""Mesh, logical rules, sharded init, batch placement and the FP8 alignment check (8 CPU)."""

import dataclasses
import importlib.util
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from infir2_jax import parallel
from infir2_jax.parallel.mesh import process_slice
from infir2_jax.config import TrainConfig
from infir2_jax.model import ModelConfig, Qwen2, projections
from infir2_jax.model.axes import compute_axes
from infir2_jax.config import OptConfig
from infir2_jax.train.optim import make_optimizer
from infir2_jax.precision import PrecisionConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=1,
                   num_heads=4, num_kv_heads=2, head_dim=64)


def model_config(name: str, **overrides) -> ModelConfig:
  spec = importlib.util.spec_from_file_location(f"cfg_{name}",
                                                os.path.join(ROOT, "configs", f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  cfg = TrainConfig.from_config_dict(module.get_config()).model
  return dataclasses.replace(cfg, num_layers=2, **overrides)  # fewer layers: faster tracing


def mesh_and_rules(shape, model_cfg=None, rules=()):
  cfg = parallel.MeshConfig(*shape, rules=rules)
  mesh = parallel.make_mesh(cfg, jax.devices()[:int(np.prod([s for s in shape if s > 0]))])
  return mesh, parallel.logical_rules(cfg, model_cfg, mesh)


# --- mesh and rules ---------------------------------------------------------------------------

def test_mesh_fills_minus_one_and_rejects_bad_sizes():
  assert parallel.MeshConfig(data=-1, fsdp=2, tensor=2).shape(8) == (2, 2, 2)
  assert dict(parallel.make_mesh(parallel.MeshConfig(fsdp=4)).shape) == {
      "data": 2, "fsdp": 4, "tensor": 1}
  with pytest.raises(ValueError, match="at most one"):
    parallel.MeshConfig(data=-1, fsdp=-1)
  with pytest.raises(ValueError, match="positive"):
    parallel.MeshConfig(tensor=0)
  with pytest.raises(ValueError, match="cannot fill 8"):
    parallel.MeshConfig(tensor=3).shape(8)
  with pytest.raises(ValueError, match="needs 4 devices, but 8"):
    parallel.MeshConfig(data=2, fsdp=2, tensor=1).shape(8)
  with pytest.raises(ValueError, match="fp8_alignment"):
    parallel.MeshConfig(fp8_alignment="maybe")


def test_rule_overrides_from_config():
  rules = dict(parallel.logical_rules(parallel.MeshConfig(
      rules=("embed=", "batch=data", "vocab=tensor+fsdp"))))
  assert rules["embed"] is None and rules["batch"] == "data"
  assert rules["vocab"] == ("tensor", "fsdp") and rules["heads"] == "tensor"
  with pytest.raises(ValueError, match="unknown mesh axis 'model'"):
    parallel.MeshConfig(rules=("heads=model",))
  with pytest.raises(ValueError, match="logical=axis"):
    parallel.MeshConfig(rules=("heads",))
  with pytest.raises(ValueError, match="unknown logical axis 'embd'.*'embed'"):
    parallel.MeshConfig(rules=("embd=fsdp",))


def test_kv_heads_replicated_when_the_tensor_degree_does_not_divide_them():
  _, rules = mesh_and_rules((2, 1, 4), TINY)  # 2 KV heads, tensor 4
  assert dict(rules)["kv_heads"] is None and dict(rules)["heads"] == "tensor"
  _, rules = mesh_and_rules((4, 1, 2), TINY)
  assert dict(rules)["kv_heads"] == "tensor"


def test_heads_that_do_not_split_are_an_error():
  with pytest.raises(ValueError, match="num_heads=28 does not split over the 8-way"):
    mesh_and_rules((1, 1, 8), model_config("7b"))


def test_compute_axes_gather_fsdp_and_keep_tensor():
  assert compute_axes(("embed", "heads")) == ("act_embed", "act_heads")
  assert compute_axes(("mlp", "embed")) == ("act_mlp", "act_embed")
  assert compute_axes(("vocab", "embed", None)) == ("vocab", "act_embed", None)


# --- state ------------------------------------------------------------------------------------

def init_fn(model_cfg):
  model = Qwen2(model_cfg)
  return lambda rng: model.init(rng, jnp.zeros((1, 8), jnp.int32))["params"]


def test_sharded_init_puts_params_and_adam_moments_on_the_mesh():
  mesh, rules = mesh_and_rules((2, 2, 2), TINY)
  tx = make_optimizer(OptConfig(), 10)
  state, shardings = parallel.sharded_init(init_fn(TINY), tx, mesh, rules, jax.random.key(0))
  gate = state["params"]["layers_0"]["mlp"]["gate_proj"]["kernel"]
  assert gate.sharding.spec == P("fsdp", "tensor")
  assert gate.addressable_shards[0].data.shape == (128, 256)  # [256, 512] over fsdp 2, tensor 2
  moments = [x for x in jax.tree.leaves(state["opt_state"]) if x.shape == gate.shape]
  assert len(moments) >= 2 and all(m.sharding == gate.sharding for m in moments)
  assert all(m.dtype == jnp.float32 for m in moments)
  structs, _ = parallel.abstract_state(init_fn(TINY), tx, mesh, rules)
  assert jax.tree.map(lambda s: (s.shape, s.dtype, s.sharding), structs) == jax.tree.map(
      lambda x: (x.shape, x.dtype, x.sharding), state)


def test_uneven_param_split_names_the_param():
  mesh, rules = mesh_and_rules((1, 1, 8), dataclasses.replace(TINY, vocab_size=500, num_heads=8))
  with pytest.raises(ValueError, match=r"embed_tokens/embedding \(500, 256\).*'vocab' of size "
                                       r"500 does not split 8 ways"):
    parallel.abstract_state(init_fn(dataclasses.replace(TINY, vocab_size=500, num_heads=8)),
                            make_optimizer(OptConfig(), 10), mesh, rules)


def test_spec_table_pads_specs_to_the_rank():
  mesh, _ = mesh_and_rules((8, 1, 1))
  table = parallel.spec_table({"a": NamedSharding(mesh, P("data"))},
                              {"a": jax.ShapeDtypeStruct((8, 3), jnp.float32)})
  assert table == {"a": {"spec": ["data", None], "shape": [8, 3], "dtype": "float32"}}


# --- batches and processes --------------------------------------------------------------------

def test_batch_sharding_follows_the_rules():
  mesh, rules = mesh_and_rules((2, 2, 2))
  assert parallel.batch_sharding(mesh, rules).spec == P(("data", "fsdp"), None)
  _, seq_rules = mesh_and_rules((2, 2, 2), rules=("length=tensor",))
  assert parallel.batch_sharding(mesh, seq_rules).spec == P(("data", "fsdp"), "tensor")


def test_data_process_index_single_process():
  mesh, rules = mesh_and_rules((2, 2, 2))
  assert parallel.data_process_index(mesh, rules) == (0, 1)


def test_process_slice_from_the_shards_each_process_holds():
  halves = {0: {0, 1}, 1: {2, 3}}
  assert process_slice(halves, 4, 0) == (0, 2)
  assert process_slice(halves, 4, 1) == (1, 2)
  # Tensor parallelism across processes: both hold every row, both load the same slice.
  assert process_slice({0: {0, 1}, 1: {0, 1}}, 2, 1) == (0, 1)
  with pytest.raises(ValueError, match="not an aligned contiguous block"):
    process_slice({0: {0, 2}, 1: {1, 3}}, 4, 0)
  with pytest.raises(ValueError, match="overlapping"):
    process_slice({0: {0, 1}, 1: {1, 2}, 2: {2, 3}}, 4, 0)


# --- FP8 alignment ----------------------------------------------------------------------------

def check_alignment(model_cfg, mesh, rules, precision, **kwargs):
  """parallel.check_fp8_alignment for a model config and a recipe name or PrecisionConfig."""
  if isinstance(precision, str):
    precision = PrecisionConfig(recipe=precision)
  return parallel.check_fp8_alignment(projections(model_cfg), mesh, rules, precision, **kwargs)


def test_fp8_misaligned_tensor_split_is_an_error_naming_layers_and_sizes():
  cfg = model_config("1p5b")  # MLP 8960 = 70 x 128: tensor 4 gives 2240 per shard
  mesh, rules = mesh_and_rules((2, 1, 4), cfg)
  with pytest.raises(ValueError) as e:
    check_alignment(cfg, mesh, rules, PrecisionConfig(recipe="infir2"))
  message = str(e.value)
  assert "layers_*/mlp/down_proj" in message and "layers_*/mlp/gate_proj" in message
  assert "K=8960 (act_mlp)" in message and "shards of 2240, not a multiple of 128" in message
  assert "self_attn" not in message  # 12 heads x 128 / 4 and the replicated KV heads align


def test_fp8_alignment_passes_where_shards_align():
  cfg = model_config("1p5b")
  for shape in ((1, 4, 2), (1, 8, 1), (8, 1, 1)):  # FSDP splits are gathered before quantizing
    mesh, rules = mesh_and_rules(shape, cfg)
    assert check_alignment(cfg, mesh, rules, "infir2", batch_rows=8,
                                        seq_len=4096) == []


def test_fp8_alignment_depends_on_recipe_and_overrides():
  cfg = model_config("1p5b")
  mesh, rules = mesh_and_rules((2, 1, 4), cfg)
  for precision in ("bf16", "fp8_rowwise", "fp8_tensorwise",  # whole-axis scales: a tiny max
                    PrecisionConfig(recipe="infir2", overrides=("mlp/=bf16",))):
    assert check_alignment(cfg, mesh, rules, precision) == []


def test_fp8_token_split_checked_when_the_batch_is_known(caplog):
  mesh, rules = mesh_and_rules((8, 1, 1), TINY)
  # 8 rows of 64 tokens over 8 devices: 64 tokens per shard < one 128-token wgrad tile.
  with caplog.at_level(logging.WARNING):
    problems = check_alignment(TINY, mesh, rules, "infir2", batch_rows=8,
                                            seq_len=64, mode="warn")
  assert problems and all("M=512 (tokens: 8 rows x 64)" in p for p in problems)
  assert "shards of 64" in caplog.text
  assert check_alignment(TINY, mesh, rules, "infir2", batch_rows=16,
                                      seq_len=64) == []
  assert check_alignment(TINY, mesh, rules, "infir2", batch_rows=8, seq_len=64,
                                      mode="off") == []


@pytest.mark.parametrize("x_spec, w_spec", [
    (P("data", "tensor"), P("tensor", None)),   # row-parallel (o_proj, down_proj): K split
    (P("data", None), P(None, "tensor")),       # column-parallel (q/k/v, gate/up): N split
], ids=["row_parallel", "column_parallel"])
def test_fp8_gemm_with_aligned_shards_quantizes_exactly_as_on_one_device(x_spec, w_spec):
  """Tiles that split on shard boundaries: every device quantizes what one device would, so
  y, dx and dw agree to f32 summation order (a single flipped FP8 rounding would show)."""
  from infir2_jax.precision import make_dot_general
  dot_general = make_dot_general("infir2", backend="xla")
  rng = np.random.default_rng(0)
  x = (rng.standard_normal((256, 256)) * rng.uniform(0.01, 10, (256, 1))).astype(np.float32)
  w = (rng.standard_normal((256, 256)) * 0.02).astype(np.float32)
  r = rng.standard_normal((256, 256)).astype(np.float32)
  def loss(x, w):
    y = dot_general(x, w, (((1,), (0,)), ((), ())))
    return jnp.sum(y * r), y
  grad = jax.jit(jax.grad(loss, (0, 1), has_aux=True))
  (dx1, dw1), y1 = grad(x, w)
  mesh = jax.make_mesh((2, 2), ("data", "tensor"), devices=jax.devices()[:4],
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  (dx, dw), y = grad(jax.device_put(x, NamedSharding(mesh, x_spec)),
                     jax.device_put(w, NamedSharding(mesh, w_spec)))
  for got, want in ((y, y1), (dx, dx1), (dw, dw1)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6 * float(
        np.abs(want).max()))


@pytest.mark.parametrize("k, aligned", [(256, True), (192, False)])
def test_fp8_row_parallel_gemm_communicates_only_its_partial_sums_when_aligned(k, aligned):
  """Why the start-up check exists: K split into 128-multiples quantizes locally (one
  all-reduce of the partial products, as Megatron); K/2 = 96 makes XLA exchange halos."""
  import re
  from infir2_jax.precision import make_dot_general
  dot_general = make_dot_general("infir2", backend="xla")
  mesh = jax.make_mesh((2, 2), ("data", "tensor"), devices=jax.devices()[:4],
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  struct = lambda shape, spec: jax.ShapeDtypeStruct(shape, jnp.float32,
                                                    sharding=NamedSharding(mesh, spec))
  def loss(x, w, r):
    return jnp.sum(dot_general(x, w, (((1,), (0,)), ((), ()))) * r)
  hlo = jax.jit(jax.grad(loss, (0, 1))).lower(
      struct((256, k), P("data", "tensor")), struct((k, 256), P("tensor", None)),
      struct((256, 256), P("data", None))).compile().as_text()
  collectives = re.findall(r"(all-gather|all-reduce|reduce-scatter|all-to-all|"
                           r"collective-permute)\(", hlo)
  if aligned:
    assert collectives == ["all-reduce"], collectives
  else:
    assert "collective-permute" in collectives or "all-gather" in collectives, collectives
