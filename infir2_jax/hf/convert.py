"""The mapping between HF Qwen2/Llama checkpoints and our model: config fields, tensor names.

Tensor names: HF `model.layers.{i}.self_attn.q_proj.weight` [out, in] is our
`layers_{i}/self_attn/q_proj/kernel` [in, out] (transposed); embeddings, norms and biases keep
their layout; `lm_head.weight` [V, D] is `lm_head/kernel` [D, V] and is absent when tied.
"""

import dataclasses
import os
from typing import Any

from infir2_jax import errors
from infir2_jax.model import ModelConfig

SUPPORTED_MODEL_TYPES = ("qwen2", "llama")
# Tensors some exporters add that carry no parameters.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Block-scaled FP8 checkpoints (DeepSeek-V3 / Qwen FP8 / our --fp8 export): a float8 weight
# W [out, in] comes with W_scale_inv [ceil(out/b0), ceil(in/b1)], its dequantization
# multiplier per block (w = q * scale_inv), b = quantization_config.weight_block_size.
FP8_SCALE_SUFFIX = "_scale_inv"
FP8_DEFAULT_BLOCK = (128, 128)
# ModelConfig fields that an HF checkpoint determines (the rest are run choices).
ARCH_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
               "num_kv_heads", "head_size", "rope_theta", "rms_norm_eps", "tie_embeddings",
               "qkv_bias")


def read_config(path: str) -> dict[str, Any]:
  """config.json of an HF checkpoint directory (or the file itself) as a dict."""
  file = os.path.join(path, "config.json") if os.path.isdir(path) else path
  if not os.path.isfile(file):
    raise FileNotFoundError(f"no HF config.json at {file}")
  return errors.read_json_file(file, "download or export the checkpoint again (a copy cut "
                              "short, or a disk that filled)")


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


def fp8_block_size(config: dict[str, Any] | str) -> tuple[int, int]:
  """The weight block of a block-scaled FP8 checkpoint (quantization_config), else 128x128."""
  hf = read_config(config) if isinstance(config, str) else config
  quant = hf.get("quantization_config") or {}
  if quant and quant.get("quant_method") not in (None, "fp8"):
    raise ValueError(f"HF config quantization_config.quant_method="
                     f"{quant.get('quant_method')!r} is not supported; only block-scaled 'fp8' "
                     "(weight_scale_inv) checkpoints and unquantized ones load")
  block = quant.get("weight_block_size") or FP8_DEFAULT_BLOCK
  if len(block) != 2 or any(int(b) <= 0 for b in block):
    raise ValueError(f"HF config quantization_config.weight_block_size={block!r}: need two "
                     "positive sizes")
  return int(block[0]), int(block[1])


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
