"""HF checkpoint import: logits equal transformers' own Qwen2/Llama; sharded loading; errors."""

import dataclasses
import os
import shutil

import flax.traverse_util
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infir2_jax import hf
from infir2_jax.hf import load as hf_load
from infir2_jax import parallel
from infir2_jax.model import Qwen2

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf_tiny")
TIED = os.path.join(FIXTURES, "qwen2_tied")        # Qwen2.5-style config, one file
UNTIED = os.path.join(FIXTURES, "qwen2_untied")    # transformers-5 config, 2 shards + index


def hf_logits(path, tokens_BxL):
  model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
  with torch.no_grad():
    return model(torch.tensor(np.asarray(tokens_BxL))).logits.numpy()


def tokens(batch=2, length=24, vocab=512, seed=0):
  return np.random.RandomState(seed).randint(0, vocab, (batch, length))


@pytest.mark.parametrize("path", [TIED, UNTIED], ids=["tied", "untied_sharded"])
def test_logits_match_transformers(path):
  model, params = hf.load_pretrained(path)
  assert model.config.tie_embeddings == (path == TIED)
  assert model.config.rope_theta == 1e4 and model.config.qkv_bias
  x = tokens()
  ours = np.asarray(model.apply({"params": params}, jnp.asarray(x)))
  assert ours.dtype == np.float32
  np.testing.assert_allclose(ours, hf_logits(path, x), atol=1e-4, rtol=0)


def test_llama_architecture_matches_transformers(tmp_path):
  """Llama = Qwen2 without q/k/v biases (SmolLM2's architecture)."""
  config = transformers.LlamaConfig(
      vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=1, rope_theta=1e5, rms_norm_eps=1e-5,
      tie_word_embeddings=True, initializer_range=0.2)
  torch.manual_seed(0)
  transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
  model, params = hf.load_pretrained(str(tmp_path))
  assert not model.config.qkv_bias and model.config.num_kv_heads == 1
  assert "bias" not in params["layers_0"]["self_attn"]["q_proj"]
  x = tokens(vocab=256)
  ours = np.asarray(model.apply({"params": params}, jnp.asarray(x)))
  np.testing.assert_allclose(ours, hf_logits(str(tmp_path), x), atol=1e-4, rtol=0)


def test_both_rope_theta_spellings_are_read():
  base = hf.read_config(TIED)
  assert "rope_theta" in base and "rope_parameters" not in base
  assert hf.model_config_from_hf(base).rope_theta == 1e4
  assert "rope_parameters" in hf.read_config(UNTIED)
  assert hf.model_config_from_hf(UNTIED).rope_theta == 1e4


@pytest.mark.parametrize("change,match", [
    ({"model_type": "gemma"}, "model_type='gemma'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    ({"use_sliding_window": True}, "sliding-window"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_unsupported_configs_are_rejected(change, match):
  with pytest.raises(ValueError, match=match):
    hf.model_config_from_hf({**hf.read_config(TIED), **change})


def test_export_config_round_trips():
  for path in (TIED, UNTIED):
    cfg = hf.model_config_from_hf(path)
    assert hf.model_config_from_hf(hf.hf_config_from_model(cfg)) == cfg


def _shardings(cfg, mesh_cfg):
  mesh = parallel.make_mesh(mesh_cfg)
  abstract = jax.eval_shape(
      lambda: Qwen2(cfg).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"])
  return parallel.param_shardings(abstract, mesh, parallel.logical_rules(mesh_cfg))


@pytest.mark.parametrize("mesh_cfg", [parallel.MeshConfig(data=2, fsdp=2, tensor=2),
                                      parallel.MeshConfig(data=1, fsdp=4, tensor=2)],
                         ids=["d2f2t2", "f4t2"])
def test_sharded_load_equals_single_host_load(mesh_cfg, monkeypatch):
  assert jax.device_count() == 8
  cfg = hf.model_config_from_hf(UNTIED)
  _, reference = hf.load_pretrained(UNTIED)
  shardings = _shardings(cfg, mesh_cfg)
  read_sizes = {}
  original_read = hf_load._read

  def recording_read(reader, spec, index, dtype):
    out = original_read(reader, spec, index, dtype)
    read_sizes[spec.name] = max(read_sizes.get(spec.name, 0), out.size)
    return out
  monkeypatch.setattr(hf_load, "_read", recording_read)
  params = hf.load_params(UNTIED, cfg, shardings)

  flat_params = flax.traverse_util.flatten_dict(params, sep="/")
  flat_ref = flax.traverse_util.flatten_dict(reference, sep="/")
  flat_shardings = flax.traverse_util.flatten_dict(shardings, sep="/")
  assert flat_params.keys() == flat_ref.keys() == flat_shardings.keys()
  for name, value in flat_params.items():
    assert value.sharding == flat_shardings[name], name
    assert value.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(value), np.asarray(flat_ref[name]), err_msg=name)
  # Sharded tensors are read in parts: no single read holds the whole embedding or lm_head.
  for name, spec in (("embed_tokens/embedding", "model.embed_tokens.weight"),
                     ("lm_head/kernel", "lm_head.weight")):
    assert not flat_shardings[name].is_fully_replicated
    assert read_sizes[spec] < flat_ref[name].size


@pytest.mark.parametrize("field,value", [("vocab_size", 1024), ("num_kv_heads", 4),
                                         ("tie_embeddings", False), ("intermediate_size", 256)])
def test_mismatched_config_error_names_the_field(field, value):
  cfg = dataclasses.replace(hf.model_config_from_hf(TIED), **{field: value})
  with pytest.raises(ValueError, match=f"model.{field}: checkpoint has"):
    hf.load_params(TIED, cfg)


def test_missing_and_unknown_tensors_are_errors(tmp_path):
  from safetensors.numpy import save_file
  from safetensors import safe_open
  with safe_open(os.path.join(TIED, "model.safetensors"), "numpy") as f:
    tensors = {k: f.get_tensor(k) for k in f.keys()}
  shutil.copy(os.path.join(TIED, "config.json"), tmp_path / "config.json")
  extra = dict(tensors, **{"model.layers.0.self_attn.o_proj.bias": np.zeros(64, np.float32)})
  save_file(extra, str(tmp_path / "model.safetensors"))
  with pytest.raises(ValueError, match="o_proj.bias"):
    hf.load_pretrained(str(tmp_path))
  missing = {k: v for k, v in tensors.items() if "layers.1.mlp.up_proj" not in k}
  save_file(missing, str(tmp_path / "model.safetensors"))
  with pytest.raises(ValueError, match="layers.1.mlp.up_proj"):
    hf.load_pretrained(str(tmp_path))
