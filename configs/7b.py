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
  # Scanned, as every 7B row was measured; ":lean" and ":fast" unrolled, as they always were
  # (deviceless, unrolled full remat allocates 74.2 GiB against 77.1 scanned with FP8 moments).
  config.model.scan_layers = variant not in ("lean", "fast")
  # The fused LM head and loss of configs/1p5b.py is timed at 1.5B only; the 7B keeps the
  # whole-row loss (the chunked one in :lean) until the H200 measures it here.
  config.model.loss_fused = False
  config.model.loss_chunk = 2048 if variant == "lean" else 0
  return config
