"""HF Qwen2/Llama checkpoints (config.json + safetensors) <-> our Qwen2 config and params.

Tensor names: HF `model.layers.{i}.self_attn.q_proj.weight` [out, in] is our
`layers_{i}/self_attn/q_proj/kernel` [in, out] (transposed); embeddings, norms and biases keep
their layout; `lm_head.weight` [V, D] is `lm_head/kernel` [D, V] and is absent when tied.

Loading never materialises a whole model on the host: tensors are read lazily with
safetensors' `safe_open`, and with target shardings each device reads only its own slice.
"""

import dataclasses
import json
import os
from collections.abc import Iterator
from typing import Any

import flax.traverse_util
import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16/float8 with numpy for safetensors' reader)
import numpy as np
from safetensors import safe_open

from infir2_jax.model import ModelConfig, Qwen2

SUPPORTED_MODEL_TYPES = ("qwen2", "llama")
# Tensors some exporters add that carry no parameters.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# ModelConfig fields that an HF checkpoint determines (the rest are run choices).
ARCH_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
               "num_kv_heads", "head_size", "rope_theta", "rms_norm_eps", "tie_embeddings",
               "qkv_bias")


def read_config(path: str) -> dict[str, Any]:
  """config.json of an HF checkpoint directory (or the file itself) as a dict."""
  file = os.path.join(path, "config.json") if os.path.isdir(path) else path
  if not os.path.isfile(file):
    raise FileNotFoundError(f"no HF config.json at {file}")
  with open(file) as f:
    return json.load(f)


def _rope_theta(hf: dict[str, Any]) -> float:
  """Top-level `rope_theta` (Qwen2.5 files) or transformers-5 `rope_parameters`."""
  params = hf.get("rope_parameters") or {}
  scaling = hf.get("rope_scaling") or {}
  for where, p in (("rope_parameters", params), ("rope_scaling", scaling)):
    kind = p.get("rope_type", p.get("type", "default"))
    if kind != "default":
      raise ValueError(f"HF config {where}.rope_type={kind!r} is not supported; only plain "
                       "RoPE ('default') is implemented")
  theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
  return float(theta)


def model_config_from_hf(config: dict[str, Any] | str, **overrides) -> ModelConfig:
  """ModelConfig of an HF Qwen2 or Llama config (a dict, a config.json or a directory).

  Args:
    config: the parsed config.json, or a path to it or to its directory.
    **overrides: run choices that the checkpoint does not fix (dtype, param_dtype,
      attention, remat, init_std). Default compute dtype is float32, for checking.

  Returns:
    A ModelConfig whose architecture fields (ARCH_FIELDS) follow the checkpoint.
  """
  hf = read_config(config) if isinstance(config, str) else dict(config)
  model_type = hf.get("model_type")
  if model_type not in SUPPORTED_MODEL_TYPES:
    raise ValueError(f"HF config model_type={model_type!r} is not supported; valid: "
                     f"{SUPPORTED_MODEL_TYPES}")
  if hf.get("hidden_act", "silu") != "silu":
    raise ValueError(f"HF config hidden_act={hf['hidden_act']!r}; only 'silu' (SwiGLU) is "
                     "supported")
  layer_types = hf.get("layer_types") or ()
  if hf.get("use_sliding_window") or any(t != "full_attention" for t in layer_types):
    raise ValueError("HF config uses sliding-window attention (use_sliding_window/layer_types); "
                     "only full attention is supported")
  if hf.get("mlp_bias"):
    raise ValueError("HF config mlp_bias=True is not supported (the MLP has no biases)")
  if model_type == "qwen2":
    qkv_bias = True   # Qwen2 always has q/k/v biases and no o_proj bias
  else:
    qkv_bias = bool(hf.get("attention_bias", False))
    if qkv_bias:
      raise ValueError("Llama config attention_bias=True (biases on q/k/v AND o_proj) is not "
                       "supported; the model has no o_proj bias")
  heads = int(hf["num_attention_heads"])
  head_dim = hf.get("head_dim") or 0
  if head_dim and head_dim * heads == hf["hidden_size"]:
    head_dim = 0  # the implied value: keep the config canonical
  fields = dict(
      vocab_size=int(hf["vocab_size"]), hidden_size=int(hf["hidden_size"]),
      intermediate_size=int(hf["intermediate_size"]), num_layers=int(hf["num_hidden_layers"]),
      num_heads=heads, num_kv_heads=int(hf.get("num_key_value_heads") or heads),
      head_dim=int(head_dim), rope_theta=_rope_theta(hf),
      rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)), qkv_bias=qkv_bias,
      dtype="float32")
  fields.update(overrides)
  return ModelConfig(**fields)


def hf_config_from_model(cfg: ModelConfig, **extra) -> dict[str, Any]:
  """config.json contents for our model: Qwen2ForCausalLM, or LlamaForCausalLM without biases.

  Writes top-level `rope_theta` and `torch_dtype` (as released Qwen2.5 checkpoints do, read by
  vLLM/SGLang and by transformers 4 and 5). `extra` adds or overrides keys.
  """
  qwen = cfg.qkv_bias
  out = {
      "architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"],
      "model_type": "qwen2" if qwen else "llama",
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
      "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
      "head_dim": cfg.head_size, "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps,
      "rope_theta": cfg.rope_theta, "tie_word_embeddings": cfg.tie_embeddings,
      "max_position_embeddings": 32768, "attention_dropout": 0.0,
      "initializer_range": cfg.init_std, "use_cache": True, "torch_dtype": "bfloat16",
  }
  if qwen:
    out.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.num_layers)
  else:
    out.update(attention_bias=False, mlp_bias=False)
  out.update(extra)
  return out


def check_compatible(hf_cfg: ModelConfig, model_cfg: ModelConfig, source: str = "") -> None:
  """Raises ValueError naming every architecture field where the two configs disagree."""
  bad = [f"model.{name}: checkpoint has {getattr(hf_cfg, name)!r}, config has "
         f"{getattr(model_cfg, name)!r}"
         for name in ARCH_FIELDS if getattr(hf_cfg, name) != getattr(model_cfg, name)]
  if bad:
    fix = " ".join(f"--config.model.{n}={getattr(hf_cfg, n)}" for n in ARCH_FIELDS
                   if n != "head_size" and getattr(hf_cfg, n) != getattr(model_cfg, n))
    raise ValueError(f"HF checkpoint {source} does not match the model config:\n  "
                     + "\n  ".join(bad) + (f"\nSet: {fix}" if fix else ""))


@dataclasses.dataclass(frozen=True)
class TensorSpec:
  """Where a param lives in an HF checkpoint: tensor name and whether it is stored [out, in]."""
  name: str
  transpose: bool


def tensor_specs(cfg: ModelConfig) -> dict[str, TensorSpec]:
  """Our param path ("layers_0/self_attn/q_proj/kernel") -> its HF tensor."""
  specs = {"embed_tokens/embedding": TensorSpec("model.embed_tokens.weight", False),
           "norm/scale": TensorSpec("model.norm.weight", False)}
  if not cfg.tie_embeddings:
    specs["lm_head/kernel"] = TensorSpec("lm_head.weight", True)
  for i in range(cfg.num_layers):
    ours, theirs = f"layers_{i}", f"model.layers.{i}"
    for norm in ("input_layernorm", "post_attention_layernorm"):
      specs[f"{ours}/{norm}/scale"] = TensorSpec(f"{theirs}.{norm}.weight", False)
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
      name = f"{theirs}.self_attn.{proj}"
      specs[f"{ours}/self_attn/{proj}/kernel"] = TensorSpec(f"{name}.weight", True)
      if cfg.qkv_bias and proj != "o_proj":
        specs[f"{ours}/self_attn/{proj}/bias"] = TensorSpec(f"{name}.bias", False)
    for proj in ("gate_proj", "up_proj", "down_proj"):
      specs[f"{ours}/mlp/{proj}/kernel"] = TensorSpec(f"{theirs}.mlp.{proj}.weight", True)
  return specs


class SafetensorsReader:
  """Lazy reader of a checkpoint's tensors: model.safetensors or shards with an index."""

  def __init__(self, path: str):
    self.path = path
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
      with open(index) as f:
        self.files = {name: os.path.join(path, file)
                      for name, file in json.load(f)["weight_map"].items()}
    else:
      files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
      if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
      self.files = {}
      for file in files:
        with safe_open(os.path.join(path, file), "numpy") as f:
          self.files.update({name: os.path.join(path, file) for name in f.keys()})
    self._open: dict[str, Any] = {}

  def names(self) -> list[str]:
    return list(self.files)

  def slice(self, name: str):
    """safetensors' lazy slice of a tensor: .get_shape(), and [idx] reads only that part."""
    file = self.files[name]
    if file not in self._open:
      self._open[file] = safe_open(file, "numpy")
    return self._open[file].get_slice(name)

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self.slice(name).get_shape())


def _read(reader: SafetensorsReader, spec: TensorSpec, index: tuple[slice, ...], dtype):
  """The part `index` (in our layout) of a tensor, converted to dtype."""
  tensor = reader.slice(spec.name)
  if spec.transpose:
    return np.ascontiguousarray(tensor[index[1], index[0]].T).astype(dtype)
  return tensor[index].astype(dtype)


def _check_tensors(reader: SafetensorsReader, specs: dict[str, TensorSpec],
                   shapes: dict[str, tuple[int, ...]]) -> None:
  wanted = {s.name for s in specs.values()}
  available = set(reader.names())
  missing = sorted(wanted - available)
  if missing:
    raise ValueError(f"HF checkpoint {reader.path} lacks {len(missing)} tensors the config "
                     f"needs, e.g. {missing[:5]}")
  extra = sorted(n for n in available - wanted
                 if not n.endswith(_IGNORED_SUFFIXES) and n != "lm_head.weight")
  if extra:
    raise ValueError(f"HF checkpoint {reader.path} has {len(extra)} tensors the model has no "
                     f"place for (unsupported architecture?), e.g. {extra[:5]}")
  for path, spec in specs.items():
    stored = reader.shape(spec.name)
    expected = shapes[path][::-1] if spec.transpose else shapes[path]
    if stored != tuple(expected):
      raise ValueError(f"HF tensor {spec.name} has shape {stored}, expected {tuple(expected)} "
                       f"for {path}")


def _param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
  abstract = jax.eval_shape(
      lambda: Qwen2(cfg).init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))
  flat = flax.traverse_util.flatten_dict(abstract["params"], sep="/")
  return {k: tuple(getattr(v, "value", v).shape) for k, v in flat.items()}


def _iter_params(path: str, cfg: ModelConfig) -> Iterator[tuple[Any, str, TensorSpec, tuple]]:
  """(reader, param path, HF tensor, param shape) for every param, after checking them all."""
  reader = SafetensorsReader(path)
  specs = tensor_specs(cfg)
  shapes = _param_shapes(cfg)
  _check_tensors(reader, specs, shapes)
  for name, spec in specs.items():
    yield reader, name, spec, shapes[name]


def load_params(path: str, model_cfg: ModelConfig, shardings=None):
  """Reads an HF checkpoint's tensors into our param tree, one tensor at a time.

  Args:
    path: HF checkpoint directory (config.json, model.safetensors or shards + index).
    model_cfg: the model to load into; its architecture must match config.json
      (a ValueError names each field that does not).
    shardings: optional pytree of NamedSharding matching the params (e.g.
      `sharding.state_shardings(...)["params"]`). With it each tensor is built with
      jax.make_array_from_callback, and every device reads only its own slice from disk;
      without it, tensors land on the default device.

  Returns:
    The (unboxed) params pytree in model_cfg.param_dtype.
  """
  check_compatible(model_config_from_hf(path), model_cfg, path)
  dtype = np.dtype(model_cfg.param_dtype)
  flat_shardings = (None if shardings is None
                    else flax.traverse_util.flatten_dict(shardings, sep="/"))
  out = {}
  for reader, name, spec, shape in _iter_params(path, model_cfg):
    if flat_shardings is None:
      out[name] = jnp.asarray(_read(reader, spec, (slice(None),) * len(shape), dtype))
      continue
    sharding = flat_shardings[name]
    cache = {}   # replicated shards ask for the same index on every device: read it once

    def callback(index, reader=reader, spec=spec, cache=cache):
      key = tuple((s.start, s.stop, s.step) for s in index)
      if key not in cache:
        cache[key] = _read(reader, spec, index, dtype)
      return cache[key]
    out[name] = jax.make_array_from_callback(shape, sharding, callback)
  return flax.traverse_util.unflatten_dict(out, sep="/")


def load_params_sharded(path: str, model_cfg: ModelConfig, shardings):
  """load_params with target shardings: what `--config.init.hf_checkpoint=DIR` calls."""
  return load_params(path, model_cfg, shardings)


def load_pretrained(path: str, *, dtype: str = "float32", param_dtype: str = "float32",
                    **overrides) -> tuple[Qwen2, Any]:
  """(model, params) from an HF Qwen2/Llama checkpoint directory.

  `model.apply({"params": params}, tokens_BxL)` returns float32 logits [B, L, V]. The compute
  dtype defaults to float32 (exact comparison with transformers); pass dtype="bfloat16" for speed.
  """
  cfg = model_config_from_hf(path, dtype=dtype, param_dtype=param_dtype, **overrides)
  return Qwen2(cfg), load_params(path, cfg)
