"""Qwen2.5-7B, continual pre-training with the InfiR2 FP8 recipe; needs FSDP and/or TP.

  python -m infir2_jax.train --config=configs/7b.py --config.mesh.fsdp=8 --workdir=runs/7b

Architecture = HF Qwen/Qwen2.5-7B config.json (untied LM head).
"""

import os

from infir2_jax.config import get_config_dict


def get_config(variant: str | None = None):
  base = os.path.join(os.path.dirname(__file__), "1p5b.py")
  config = get_config_dict(base + (f":{variant}" if variant else ""))  # 1p5b's training setup
  config.model.vocab_size = 152064
  config.model.hidden_size = 3584
  config.model.intermediate_size = 18944
  config.model.num_layers = 28
  config.model.num_heads = 28
  config.model.num_kv_heads = 4
  config.model.head_dim = 0            # 3584 / 28 = 128
  config.model.tie_embeddings = False
  config.model.remat = "full"
  # Scanned, as every 7B row was measured; ":lean" and ":fast" unrolled, as they always were.
  config.model.scan_layers = variant not in ("lean", "fast")
  # The default keeps the whole-row loss, as its rows were measured. ":lean" is issue 35's
  # <= 78 GiB configuration: FP8 moments (the fused FP8 AdamW step), the fused LM head and
  # loss 1024 tokens at a time, unrolled full remat. Deviceless it allocates 66.7 GiB, 2048
  # tokens at a time 70.3 (benchmarks/results/peak_buffers_7b_s26_bf16_fp8_grads.json;
  # the H200's autotuned compile added 4.4 GiB in session 25). With 2048 and the head's
  # gradient in float32 it measured 1255.2 ms / 78.9 GiB (session 25).
  lean = variant == "lean"
  config.model.loss_fused = lean
  config.model.loss_chunk = 1024 if lean else 0
  return config
