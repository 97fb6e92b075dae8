"""Sharded train steps equal the single-device step: meshes (8,1,1), (1,8,1), (2,2,2), (1,2,4).

The model is configs/1p5b.py shrunk until one step compiles in seconds, with widths chosen so
every FP8 tile splits on shard boundaries on all four meshes (hidden 1024 = 8 x 128 for
fsdp 8; 4 heads of 128 and MLP 512 for tensor 4; 2 KV heads, replicated at tensor 4), and
float32 compute. Gradients come out exactly as the parameter change of one SGD(1) step.
"""

import dataclasses
import functools
import importlib.util
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from infir2_jax import parallel
from infir2_jax.config import TrainConfig
from infir2_jax.model import Qwen2, init_params, projections
from infir2_jax.precision import PrecisionConfig, make_dot_general_factory
from infir2_jax.train.step import make_train_step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESHES = [(8, 1, 1), (1, 8, 1), (2, 2, 2), (1, 2, 4)]
ROWS, LENGTH = 8, 128  # every batch shard holds a multiple of 128 tokens
# Norm-relative gradient error per leaf. f32 reduction order differs between meshes; bf16
# then agrees to ~1e-6. FP8 turns such 1e-7 differences into flipped roundings that the
# backward pass amplifies (measured up to 9e-3); FP8 itself moves gradients ~1e-1 from bf16.
GRAD_TOL = {"bf16": 1e-4, "infir2": 3e-2}


def tiny_config() -> TrainConfig:
  spec = importlib.util.spec_from_file_location("cfg_1p5b",
                                                os.path.join(ROOT, "configs", "1p5b.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config()
  c.model.update(vocab_size=512, hidden_size=1024, intermediate_size=512, num_layers=1,
                 num_heads=4, num_kv_heads=2, head_dim=128, dtype="float32", attention="xla",
                 remat="none")
  c.precision.backend = "xla"
  return TrainConfig.from_config_dict(c)


def make_batch():
  rng = np.random.default_rng(0)
  return {"inputs": rng.integers(0, 512, (ROWS, LENGTH), dtype=np.int32),
          "targets": rng.integers(0, 512, (ROWS, LENGTH), dtype=np.int32),
          "segment_ids": np.repeat(np.array([[1] * 100 + [2] * 28]), ROWS, 0).astype(np.int32),
          "positions": np.tile(np.arange(LENGTH, dtype=np.int32), (ROWS, 1)),
          "loss_mask": (rng.random((ROWS, LENGTH)) < 0.7).astype(np.float32)}


def run_step(recipe: str, mesh_shape, **model_overrides):
  """(loss, initial params, gradients, new state) of one step on the first prod(mesh_shape)
  devices; model_overrides replace ModelConfig fields (e.g. attention="cudnn")."""
  cfg = tiny_config()
  cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **model_overrides))
  model = Qwen2(cfg.model, make_dot_general_factory(
      PrecisionConfig(recipe=recipe, backend="xla")))
  tx = optax.sgd(1.0)  # new params = params - grads exactly
  init = functools.partial(init_params, model)
  mesh_cfg = parallel.MeshConfig(*mesh_shape)
  mesh = parallel.make_mesh(mesh_cfg, jax.devices()[:int(np.prod(mesh_shape))])
  rules = parallel.logical_rules(mesh_cfg, cfg.model, mesh)
  parallel.check_fp8_alignment(projections(cfg.model), mesh, rules, PrecisionConfig(recipe=recipe),
                               batch_rows=ROWS, seq_len=LENGTH)
  state, shardings = parallel.sharded_init(init, tx, mesh, rules, jax.random.key(0))
  batch_sharding = parallel.batch_sharding(mesh, rules)
  batch = jax.tree.map(lambda x: jax.device_put(x, batch_sharding), make_batch())
  params = jax.device_get(state["params"])
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    step = jax.jit(make_train_step(model, tx, lambda _: 1.0),
                   in_shardings=(shardings, batch_sharding),
                   out_shardings=(shardings, parallel.replicated(mesh)))
    new_state, metrics = step(state, batch)
  grads = jax.tree.map(lambda a, b: a - b, params, jax.device_get(new_state["params"]))
  return float(metrics["loss"]), params, grads, new_state


def norm_errors(grads, ref_grads) -> dict[str, float]:
  flat = jax.tree_util.tree_flatten_with_path(jax.tree.map(
      lambda a, b: float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)),
      grads, ref_grads))[0]
  return {jax.tree_util.keystr(path): err for path, err in flat}


# One test per recipe (not per mesh) so that xdist workers do not each rebuild the reference.
@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["bf16", "infir2"])
def test_sharded_steps_match_single_device(recipe):
  ref_loss, ref_params, ref_grads, _ = run_step(recipe, (1, 1, 1))
  if recipe != "bf16":  # the tolerance can fail: FP8 vs bf16 differs by several times it
    bf16_grads = run_step("bf16", (1, 1, 1))[2]
    errors = norm_errors(ref_grads, bf16_grads)
    assert min(errors.values()) > 2 * GRAD_TOL[recipe], errors
  for mesh_shape in MESHES:
    loss, params, grads, new_state = run_step(recipe, mesh_shape)
    # Same initial params whatever the sharding (partitionable threefry).
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
      np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, err_msg=f"mesh {mesh_shape}")
    errors = norm_errors(grads, ref_grads)
    assert max(errors.values()) < GRAD_TOL[recipe], (mesh_shape, errors)
    # The state really is sharded as the rules say (FSDP on embed, TP on heads / MLP).
    gate = new_state["params"]["layers_0"]["mlp"]["gate_proj"]["kernel"]
    expected = P(*(a if mesh_shape[i] > 1 else None for i, a in ((1, "fsdp"), (2, "tensor"))))
    assert gate.sharding.is_equivalent_to(
        jax.sharding.NamedSharding(gate.sharding.mesh, expected), 2), (mesh_shape, gate.sharding)
