"""Writes the tiny random HF Qwen2 checkpoints in tests/fixtures/hf_tiny/ (offline, ~1 s).

  .venv/bin/python scripts/make_hf_fixture.py

Two variants of one architecture (vocab 512, hidden 64, 2 layers, 4 query / 2 KV heads,
rope_theta 1e4 so that the model default 1e6 would be caught):
  qwen2_tied/    tied embeddings, one model.safetensors, config.json in the style of released
                 Qwen2.5 checkpoints (top-level `rope_theta`, `torch_dtype`);
  qwen2_untied/  separate lm_head, two shards + model.safetensors.index.json, config.json as
                 transformers 5 writes it (`rope_parameters`, `dtype`).
Weights are bf16 (half the size; loaders upcast exactly). Every tensor is random, norms and
biases included (HF initialises norms to 1 and biases to 0, which would hide mix-ups), with
a scale large enough that attention is far from uniform (so RoPE errors show in the logits).
"""

import json
import os
import sys

import torch
import transformers

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                   "tests", "fixtures", "hf_tiny")
ARCH = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0, rms_norm_eps=1e-6,
            max_position_embeddings=512, bos_token_id=1, eos_token_id=2)


def randomize(model: torch.nn.Module, seed: int) -> None:
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=gen)
      if name.endswith("norm.weight"):
        p.copy_(1.0 + 0.2 * noise)
      elif name.endswith(".bias"):
        p.copy_(0.3 * noise)
      elif "embed_tokens" in name or "lm_head" in name:
        p.copy_(0.5 * noise)
      else:  # [out, in] projections: ~unit-variance outputs for unit-variance inputs
        p.copy_(noise / p.shape[1] ** 0.5)


def make(name: str, tie: bool, seed: int, qwen25_style: bool, shard: bool) -> None:
  config = transformers.Qwen2Config(tie_word_embeddings=tie, **ARCH)
  torch.manual_seed(seed)
  model = transformers.Qwen2ForCausalLM(config)
  randomize(model, seed)
  model = model.to(torch.bfloat16)
  out = os.path.join(OUT, name)
  os.makedirs(out, exist_ok=True)
  for f in os.listdir(out):
    os.remove(os.path.join(out, f))
  model.save_pretrained(out, max_shard_size="150KB" if shard else "50MB")
  os.remove(os.path.join(out, "generation_config.json")) if os.path.exists(
      os.path.join(out, "generation_config.json")) else None
  if qwen25_style:  # what released Qwen2.5 config.json files look like
    with open(os.path.join(out, "config.json")) as f:
      cfg = json.load(f)
    cfg["rope_theta"] = cfg.pop("rope_parameters")["rope_theta"]
    cfg["torch_dtype"] = cfg.pop("dtype")
    cfg.pop("layer_types", None)
    with open(os.path.join(out, "config.json"), "w") as f:
      json.dump(cfg, f, indent=2, sort_keys=True)
  print(name, sorted(os.listdir(out)))


def main() -> int:
  make("qwen2_tied", tie=True, seed=0, qwen25_style=True, shard=False)
  make("qwen2_untied", tie=False, seed=1, qwen25_style=False, shard=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
