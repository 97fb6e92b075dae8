"""Block-scaled FP8 HF checkpoints load by dequantizing: our --fp8 export and other layouts."""

import json
import os

import flax.linen as nn
import flax.traverse_util
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from infir2_jax import hf, parallel
from infir2_jax.hf import save as hf_save
from infir2_jax.model import ModelConfig, Qwen2

torch = pytest.importorskip("torch")   # an independent reader of float8 safetensors
from safetensors.torch import load_file, save_file as save_torch  # noqa: E402

# Widths that make several 128-blocks, one of them partial (intermediate 320 = 2.5 blocks),
# so sharded reads start and stop inside blocks.
MODEL = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=320, num_layers=2,
                    num_heads=2, num_kv_heads=1, rope_theta=1e4, dtype="float32")


def random_params(cfg, seed=0):
  shapes = jax.eval_shape(lambda: Qwen2(cfg).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))
  flat = flax.traverse_util.flatten_dict(nn.unbox(shapes["params"]), sep="/")
  rs = np.random.RandomState(seed)
  return flax.traverse_util.unflatten_dict(
      {k: (rs.standard_normal(s.shape) / np.sqrt(s.shape[0])).astype(np.float32)
       for k, s in flat.items()}, sep="/")


def reference_dequantized(path: str, block=(128, 128)) -> dict[str, np.ndarray]:
  """Every tensor of an FP8 checkpoint as float32 (read by torch), dequantized with np.kron
  over whole blocks."""
  out = {}
  tensors = {k: v.float().numpy() for k, v in
             load_file(os.path.join(path, "model.safetensors")).items()}
  for name, t in tensors.items():
    if name.endswith("_scale_inv"):
      continue
    if name + "_scale_inv" in tensors:
      s = tensors[name + "_scale_inv"]
      scale = np.kron(s, np.ones(block, np.float32))[:t.shape[0], :t.shape[1]]
      out[name] = t.astype(np.float32) * scale
    else:
      out[name] = t.astype(np.float32)
  return out


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("fp8"))
  hf_save.export_params(random_params(MODEL), MODEL, path, fp8=True)
  return path


def _ours_in_hf_names(params) -> dict[str, np.ndarray]:
  specs = hf.tensor_specs(MODEL)
  flat = flax.traverse_util.flatten_dict(params, sep="/")
  return {specs[k].name: (np.asarray(v).T if specs[k].transpose else np.asarray(v))
          for k, v in flat.items()}


def test_fp8_export_loads_dequantized(fp8_dir):
  names = load_file(os.path.join(fp8_dir, "model.safetensors")).keys()
  assert sum(n.endswith("weight_scale_inv") for n in names) == 14   # 7 projections x 2 layers
  model, params = hf.load_pretrained(fp8_dir)
  got, expected = _ours_in_hf_names(params), reference_dequantized(fp8_dir)
  assert got.keys() == expected.keys()
  for name, value in got.items():
    np.testing.assert_array_equal(value, expected[name], err_msg=name)
  # and it is the model: its FP8 round trip stays close to the exported float32 weights
  original = _ours_in_hf_names(random_params(MODEL))
  q = "model.layers.1.mlp.down_proj.weight"
  assert 0 < np.abs(got[q] - original[q]).max() <= 0.07 * np.abs(original[q]).max()
  tokens = np.random.RandomState(1).randint(0, MODEL.vocab_size, (2, 16))
  assert np.isfinite(np.asarray(model.apply({"params": params}, tokens))).all()


@pytest.mark.parametrize("mesh_cfg", [parallel.MeshConfig(data=1, fsdp=4, tensor=2),
                                      parallel.MeshConfig(data=1, fsdp=2, tensor=4)],
                         ids=["f4t2", "f2t4"])
def test_sharded_fp8_load_equals_single_host_load(fp8_dir, mesh_cfg):
  """Shards of 320/4 = 80 or 256/4 = 64 rows start inside 128-blocks: each device reads the
  scale blocks its slice touches."""
  mesh = parallel.make_mesh(mesh_cfg)
  abstract = jax.eval_shape(
      lambda: Qwen2(MODEL).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"])
  shardings = parallel.param_shardings(abstract, mesh, parallel.logical_rules(mesh_cfg))
  _, reference = hf.load_pretrained(fp8_dir)
  params = hf.load_params(fp8_dir, MODEL, shardings)
  flat, flat_ref = (flax.traverse_util.flatten_dict(p, sep="/") for p in (params, reference))
  down = flax.traverse_util.flatten_dict(shardings, sep="/")["layers_0/mlp/down_proj/kernel"]
  assert not down.is_fully_replicated
  for name, value in flat.items():
    np.testing.assert_array_equal(np.asarray(value), np.asarray(flat_ref[name]), err_msg=name)


def test_other_block_sizes_come_from_quantization_config(tmp_path):
  """An FP8 checkpoint of another exporter: 64x64 blocks, named in quantization_config."""
  params = random_params(MODEL, seed=3)
  tensors = hf_save.hf_tensors(flax.traverse_util.flatten_dict(params, sep="/"), MODEL)
  rs = np.random.RandomState(4)
  for name in [n for n in tensors if n.endswith("_proj.weight")]:
    w = tensors[name].astype(np.float32)
    scale = np.exp2(rs.randint(-8, -4, (-(-w.shape[0] // 64), -(-w.shape[1] // 64))))
    big = np.kron(scale, np.ones((64, 64)))[:w.shape[0], :w.shape[1]]
    tensors[name] = np.clip(w / big, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    tensors[name + "_scale_inv"] = scale.astype(np.float32)
  save_file(tensors, str(tmp_path / "model.safetensors"))
  config = hf.hf_config_from_model(MODEL, quantization_config={
      "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
      "weight_block_size": [64, 64]})
  (tmp_path / "config.json").write_text(json.dumps(config))
  _, loaded = hf.load_pretrained(str(tmp_path))
  got, expected = _ours_in_hf_names(loaded), reference_dequantized(str(tmp_path), (64, 64))
  for name, value in got.items():
    np.testing.assert_array_equal(value, expected[name], err_msg=name)


def test_fp8_scales_of_the_wrong_shape_are_an_error(fp8_dir, tmp_path):
  tensors = load_file(os.path.join(fp8_dir, "model.safetensors"))
  config = json.load(open(os.path.join(fp8_dir, "config.json")))
  config["quantization_config"]["weight_block_size"] = [64, 64]   # the scales are 128x128
  save_torch(tensors, str(tmp_path / "model.safetensors"))
  (tmp_path / "config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match="weight_scale_inv has shape .* 64x64 blocks"):
    hf.load_pretrained(str(tmp_path))
  config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
  (tmp_path / "config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match="quant_method='gptq' is not supported"):
    hf.load_pretrained(str(tmp_path))
