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


def _files(path):
  return {f: open(os.path.join(path, f), "rb").read() for f in sorted(os.listdir(path))}


def test_export_refuses_a_non_empty_out_unless_overwrite(run, tmp_path):
  """An earlier export (and a file of the user's) is not touched without --overwrite; with
  it, the folder is replaced as a whole by the new export."""
  workdir, _ = run
  out = tmp_path / "hf"
  export.export_run(workdir, str(out))
  (out / "notes.txt").write_text("mine")
  before = _files(out)
  with pytest.raises(FileExistsError, match="not empty.*--overwrite"):
    export.export_run(workdir, str(out), fp8=True)
  assert _files(out) == before
  export.export_run(workdir, str(out), fp8=True, overwrite=True)
  assert "quantization_config" in json.load(open(out / "config.json"))
  assert not (out / "notes.txt").exists()
  assert sorted(os.listdir(tmp_path)) == ["hf"]   # no temporary folder left


def test_failed_export_leaves_the_earlier_export_intact(run, tmp_path, monkeypatch):
  workdir, _ = run
  out = tmp_path / "hf"
  export.export_run(workdir, str(out))
  before = _files(out)

  def broken(path):
    yield from ()
    raise OSError("read error in the middle of the checkpoint")
  monkeypatch.setattr(export, "iter_checkpoint_params", broken)
  with pytest.raises(OSError, match="read error"):
    export.export_run(workdir, str(out), overwrite=True)
  assert _files(out) == before
  assert sorted(os.listdir(tmp_path)) == ["hf"]


def test_export_refuses_the_run_directory_as_out(run, tmp_path):
  workdir, _ = run
  config = open(os.path.join(workdir, "config.json")).read()
  for out in (workdir, os.path.dirname(workdir), os.path.join(workdir, "checkpoints")):
    with pytest.raises(ValueError, match="run directory|checkpoints"):
      export.export_run(workdir, out, overwrite=True)
  assert open(os.path.join(workdir, "config.json")).read() == config
  rundir.read_config(workdir)   # still the run's TrainConfig


def test_export_of_a_live_run_takes_the_newest_when_its_step_is_removed(tmp_path, monkeypatch):
  """The training run's checkpoint.keep removes the step being read: the export retries with
  the newest committed step instead of failing with whatever the half-read gives."""
  workdir = str(tmp_path / "run")
  os.makedirs(workdir)
  rundir.write_config(workdir, TrainConfig(model=MODEL))
  params = random_params(MODEL)
  ckpt = Checkpointer(workdir, CheckpointConfig(async_save=False, keep=5))
  for step in (7, 9):
    ckpt.save(step, {"step": np.int32(step), "params": params}, None)
  ckpt.close()
  real = export.iter_checkpoint_params
  removed = []

  def removed_while_read(path):
    step_dir = os.path.dirname(path)
    if not removed:   # the trainer saves step 11 and drops step 9 as we start reading 9
      import shutil
      shutil.copytree(step_dir, os.path.join(os.path.dirname(step_dir), "11"))
      shutil.rmtree(step_dir)
      removed.append(step_dir)
      raise FileNotFoundError(f"{path}/manifest.ocdbt")
    return real(path)
  monkeypatch.setattr(export, "iter_checkpoint_params", removed_while_read)
  line = export.export_run(workdir, str(tmp_path / "hf"))
  assert line.startswith("exported step 11 ") and removed
  _, loaded = hf.load_pretrained(str(tmp_path / "hf"))
  jax.tree.map(np.testing.assert_array_equal, loaded, bf16(params))


def test_export_reads_only_verified_committed_checkpoints(run, tmp_path):
  """A step folder orbax never finished is not a checkpoint; a damaged one is named."""
  import shutil
  workdir = str(tmp_path / "run")
  shutil.copytree(run[0], workdir)
  os.makedirs(os.path.join(workdir, "checkpoints", "9"))        # a save killed early
  line = export.export_run(workdir, str(tmp_path / "a"))
  assert line.startswith("exported step 7 ")
  data = [os.path.join(r, f) for r, _, fs in os.walk(os.path.join(workdir, "checkpoints", "7"))
          for f in fs if "/d/" in os.path.join(r, f)]
  with open(max(data, key=os.path.getsize), "r+b") as f:
    f.seek(100)
    f.write(b"\x00\x01\x02\x03")
  with pytest.raises(ValueError, match="checkpoint 7 .* is damaged: .*checksum"):
    export.export_run(workdir, str(tmp_path / "b"))
  assert not (tmp_path / "b").exists()


def test_export_files_are_world_readable_and_the_read_is_quiet(run, tmp_path, caplog):
  """safetensors writes 0600 files (a model server run by another user could not read them);
  reading the step's `state` item logged orbax's spurious "Metadata file does not exist"."""
  import logging  # pylint: disable=import-outside-toplevel
  workdir, _ = run
  out = str(tmp_path / "hf")
  umask = os.umask(0o022)
  try:
    with caplog.at_level(logging.INFO):
      export.export_run(workdir, out, fp8=True)
  finally:
    os.umask(umask)
  modes = {name: os.stat(os.path.join(out, name)).st_mode & 0o777 for name in os.listdir(out)}
  assert modes and all(mode == 0o644 for mode in modes.values()), modes
  assert not [r.getMessage() for r in caplog.records
              if "Metadata file does not exist" in r.getMessage()]
