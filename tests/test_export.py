"""Export of a run's orbax checkpoint to HF: transformers loads it and computes our logits."""

import dataclasses
import importlib.util
import json
import os

import flax.linen as nn
import flax.traverse_util
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

from infir2_jax import export
from infir2_jax import hf
from infir2_jax.config import CheckpointConfig, TrainConfig
from infir2_jax.data.config import DataConfig
from infir2_jax.hf import save as hf_save
from infir2_jax.model import ModelConfig, Qwen2, abstract_params
from infir2_jax.train import rundir
from infir2_jax.train.checkpoint import Checkpointer, restore_params

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# Widths are multiples of 128 so the FP8 blocks are whole (k/v: 64 = one partial block).
MODEL = ModelConfig(vocab_size=8192, hidden_size=128, intermediate_size=256, num_layers=2,
                    num_heads=4, num_kv_heads=2, rope_theta=1e4, dtype="float32")
SYSTEM = 'You are "terse".\nAnswer briefly.'


def random_params(cfg, seed=0):
  """Our param tree with every leaf random (norms and biases too), attention far from uniform."""
  shapes = jax.eval_shape(lambda: Qwen2(cfg).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))
  flat = flax.traverse_util.flatten_dict(nn.unbox(shapes["params"]), sep="/")
  rs = np.random.RandomState(seed)
  out = {}
  for name, s in sorted(flat.items()):
    noise = rs.standard_normal(s.shape).astype(np.float32)
    value = (1 + 0.2 * noise if name.endswith("scale") else 0.3 * noise if name.endswith("bias")
             else 0.5 * noise if "embed" in name else noise / np.sqrt(s.shape[0]))
    out[name] = value.astype(np.float32)
  return flax.traverse_util.unflatten_dict(out, sep="/")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """A run directory as the trainer leaves it: config.json + checkpoints/<step>/state."""
  workdir = str(tmp_path_factory.mktemp("run"))
  cfg = TrainConfig(model=MODEL, data=DataConfig(format="chat", system_prompt=SYSTEM))
  rundir.write_config(workdir, cfg)
  params = random_params(MODEL)
  state = {"step": np.int32(7), "params": params, "opt_state": optax.adamw(1e-3).init(params)}
  ckpt = Checkpointer(workdir, CheckpointConfig(async_save=False))
  ckpt.save(7, state, None)
  ckpt.close()
  return workdir, params


def ours(params, tokens, cfg=MODEL):
  return np.asarray(jax.jit(Qwen2(cfg).apply)({"params": params}, jnp.asarray(tokens)))


def theirs(path, tokens):
  model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
  with torch.no_grad():
    return model(torch.tensor(tokens)).logits.numpy()


def bf16(params):
  return jax.tree.map(lambda p: np.asarray(p).astype(ml_dtypes.bfloat16).astype(np.float32), params)


def test_bf16_export_round_trips_through_transformers(run, tmp_path):
  workdir, params = run
  out = str(tmp_path / "hf")
  print(export.export_run(workdir, out, max_shard_bytes=1 << 20))   # several shards + index
  assert os.path.isfile(os.path.join(out, "model.safetensors.index.json"))
  config = json.load(open(os.path.join(out, "config.json")))
  assert config["architectures"] == ["Qwen2ForCausalLM"] and config["rope_theta"] == 1e4
  assert config["tie_word_embeddings"] and config["torch_dtype"] == "bfloat16"

  tokens = np.random.RandomState(0).randint(0, MODEL.vocab_size, (2, 16))
  hf_logits = theirs(out, tokens)
  # Same bf16 weights, both in f32: equal to f32 rounding.
  np.testing.assert_allclose(ours(bf16(params), tokens), hf_logits, atol=1e-4, rtol=0)
  # Against our f32 masters: only the bf16 rounding of the weights differs.
  reference = ours(params, tokens)
  assert np.abs(reference - hf_logits).max() < 0.02 * np.abs(reference).max()
  # And our own loader reads the export back to the bf16-rounded masters.
  _, loaded = hf.load_pretrained(out)
  jax.tree.map(np.testing.assert_array_equal, loaded, bf16(params))


def test_exported_tokenizer_and_chat_template(run, tmp_path):
  from infir2_jax.data import chat
  from infir2_jax.data.tokenizer import load_tokenizer
  workdir, _ = run
  out = str(tmp_path / "hf")
  export.export_run(workdir, out)
  tok = transformers.AutoTokenizer.from_pretrained(out)
  ours_tok = load_tokenizer("default")
  text = "Hello, world! 12345\n\n  def f(x): return x ** 2"
  assert tok(text)["input_ids"] == ours_tok.encode(text).ids
  assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
  for messages in ([{"role": "user", "content": "What is 1+1?"}],
                   [{"role": "system", "content": "Be exact."},
                    {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
                    {"role": "user", "content": "Why?"}]):
    assert (tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            == chat.render(messages, SYSTEM, add_generation_prompt=True))
  generation = json.load(open(os.path.join(out, "generation_config.json")))
  assert generation["eos_token_id"] == [ours_tok.token_to_id("<|im_end|>"),
                                        ours_tok.token_to_id("<|endoftext|>")]


def read_torch(path):
  from safetensors import safe_open
  tensors = {}
  for file in sorted(f for f in os.listdir(path) if f.endswith(".safetensors")):
    with safe_open(os.path.join(path, file), "pt") as f:
      tensors.update({k: f.get_tensor(k) for k in f.keys()})
  return tensors


def test_fp8_export_layout_and_accuracy(run, tmp_path):
  workdir, params = run
  bf16_dir, fp8_dir = str(tmp_path / "bf16"), str(tmp_path / "fp8")
  export.export_run(workdir, bf16_dir)
  export.export_run(workdir, fp8_dir, fp8=True)
  config = json.load(open(os.path.join(fp8_dir, "config.json")))
  assert config["quantization_config"] == {
      "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
      "weight_block_size": [128, 128]}
  ref, fp8 = read_torch(bf16_dir), read_torch(fp8_dir)
  quantized = [k for k in fp8 if k.endswith("_proj.weight")]
  assert len(quantized) == 7 * MODEL.num_layers
  assert set(fp8) == set(ref) | {k + "_scale_inv" for k in quantized}
  for name, t in fp8.items():
    if name in quantized:
      out_dim, in_dim = ref[name].shape
      scale = fp8[name + "_scale_inv"]
      assert t.dtype == torch.float8_e4m3fn and tuple(t.shape) == (out_dim, in_dim)
      assert scale.dtype == torch.float32
      assert tuple(scale.shape) == (-(-out_dim // 128), -(-in_dim // 128))
      # weight_scale_inv is the dequantization multiplier: amax / 448 of each 128x128 block
      # (of the f32 master, which the bf16 export rounds; compare loosely).
      w = ref[name].float().numpy()
      amax = np.array([[np.abs(w[i:i + 128, j:j + 128]).max() for j in range(0, in_dim, 128)]
                       for i in range(0, out_dim, 128)])
      np.testing.assert_allclose(scale.numpy(), amax / 448, rtol=1e-2)
      deq = (t.float() * scale.repeat_interleave(128, 0)[:out_dim]
             .repeat_interleave(128, 1)[:, :in_dim]).numpy()
      rel = np.linalg.norm(deq - w) / np.linalg.norm(w)
      assert rel < 0.04, (name, rel)   # e4m3: 3 mantissa bits
    elif not name.endswith("_scale_inv"):
      assert t.dtype == torch.bfloat16 and torch.equal(t, ref[name]), name  # embed, norms, biases


@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None,
                    reason="transformers needs accelerate to load FP8 checkpoints")
def test_transformers_loads_fp8_export_and_matches_dequantized_weights(run, tmp_path):
  """On CPU transformers dequantizes FP8 checkpoints (q * weight_scale_inv) on load."""
  workdir, params = run
  out = str(tmp_path / "fp8")
  export.export_run(workdir, out, fp8=True)
  # Our params with each projection replaced by its FP8 round trip, embeddings etc. in bf16.
  flat = flax.traverse_util.flatten_dict(bf16(params), sep="/")
  for name, value in flax.traverse_util.flatten_dict(params, sep="/").items():
    if name.endswith("_proj/kernel"):
      tensors = hf_save.hf_tensors({name: value}, MODEL, fp8=True)
      q, s = (tensors[k] for k in sorted(tensors))   # "...weight", "...weight_scale_inv"
      scale = np.kron(s, np.ones((128, 128), np.float32))[:q.shape[0], :q.shape[1]]
      deq = q.astype(np.float32) * scale
      flat[name] = deq.T
  tokens = np.random.RandomState(1).randint(0, MODEL.vocab_size, (2, 16))
  expected = ours(flax.traverse_util.unflatten_dict(flat, sep="/"), tokens)
  np.testing.assert_allclose(theirs(out, tokens), expected, atol=1e-4, rtol=0)


def test_llama_style_model_exports_as_llama(tmp_path):
  cfg = dataclasses.replace(MODEL, qkv_bias=False, tie_embeddings=False, vocab_size=512)
  params = random_params(cfg, seed=2)
  hf_save.export_params(params, cfg, str(tmp_path))
  assert json.load(open(tmp_path / "config.json"))["architectures"] == ["LlamaForCausalLM"]
  tokens = np.random.RandomState(2).randint(0, 512, (1, 12))
  np.testing.assert_allclose(theirs(str(tmp_path), tokens), ours(bf16(params), tokens, cfg),
                             atol=1e-4, rtol=0)


def test_bad_step_is_an_error(run, tmp_path):
  with pytest.raises(ValueError, match="step 3 is not a checkpoint.*available: \\[7\\]"):
    export.export_run(run[0], str(tmp_path), step=3)


def test_restore_params_only_into_target_shardings(run):
  """Params of a run (no optimizer state) straight into NamedShardings, e.g. for SFT stage 2."""
  from infir2_jax import parallel
  workdir, params = run
  mesh_cfg = parallel.MeshConfig(data=2, fsdp=2, tensor=2)
  abstract = abstract_params(MODEL)
  shardings = parallel.param_shardings(abstract, parallel.make_mesh(mesh_cfg),
                                           parallel.logical_rules(mesh_cfg))
  target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        nn.unbox(abstract), shardings)
  restored = restore_params(workdir, target)
  for r, s, p in zip(jax.tree.leaves(restored), jax.tree.leaves(shardings),
                     jax.tree.leaves(params)):
    assert r.sharding == s and r.dtype == jnp.float32
    np.testing.assert_array_equal(r, p)
