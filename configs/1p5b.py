"""Qwen2.5-1.5B, continual pre-training with the InfiR2 FP8 recipe (one GPU or many).

  python -m infir2_jax.train --config=configs/1p5b.py --workdir=runs/1p5b
  python -m infir2_jax.train --config=configs/1p5b.py --config.mesh.tensor=2   # TP 2, as the paper
  python -m infir2_jax.train --config=configs/1p5b.py \
      --config.init.hf_checkpoint=/path/to/Qwen2.5-1.5B                       # from real weights
  python -m infir2_jax.train --config=configs/1p5b.py:fast                    # the fastest step
  python -m infir2_jax.train --config=configs/1p5b.py:lean                    # the least memory

Variants: "smoke" (the real shapes, a few steps); "fast" (unrolled layers that keep the FP8
residuals: on one H200 at 2 x 8192 infir2's step took 351.5 ms against 407 scanned, 0.921x
bf16 unrolled, for 65.0 GiB peak instead of 60.2 and ~75 s of cold compile instead of ~44;
benchmarks/results/train_step_h200_1p5b_s16_8k_unrolled.json); "lean" (fast, with Adam's
moments in FP8: 42.4 GiB peak, 0.70x bf16's 60.2, in 333.9 ms a step, 1.016x fast's,
session 21, benchmarks/results/train_step_h200_1p5b_s21_8k_fusedloss.json).

Every variant computes the LM head and loss 2048 tokens at a time as one custom derivative
(model.loss_chunk, model.loss_fused; train/loss.py): no [tokens, vocab] float32 logits,
14 GiB less at 2 x 8192 for the same step time (session 21, the same json).

Architecture = HF Qwen/Qwen2.5-1.5B config.json. Schedule: the paper's WSD, scaled to `steps`.
"""

from infir2_jax.config import ConfigError, default_config


def get_config(variant: str | None = None):
  config = default_config()
  config.model.vocab_size = 151936
  config.model.hidden_size = 1536
  config.model.intermediate_size = 8960
  config.model.num_layers = 28
  config.model.num_heads = 12
  config.model.num_kv_heads = 2
  config.model.head_dim = 0            # 1536 / 12 = 128
  config.model.rope_theta = 1e6
  config.model.rms_norm_eps = 1e-6
  config.model.tie_embeddings = True
  config.model.attention = "auto"      # cuDNN flash attention on GPU
  config.model.remat = "save_dots"
  config.model.scan_layers = True      # one compiled layer: FP8 step compiles ~10x faster
  config.model.loss_chunk = 2048       # the LM head and loss 2048 tokens at a time, fused:
  config.model.loss_fused = True       # no float32 logits, -14 GiB, same time (session 21)

  config.data.tokenizer = "qwen2.5"
  config.precision.recipe = "infir2"

  config.seq_len = 4096
  config.batch_size = 8
  config.steps = 40_000
  config.opt.lr = 1e-4                 # paper: 1e-4 -> 1e-5 with WSD
  config.opt.min_lr_ratio = 0.1
  config.opt.schedule = "wsd"
  config.opt.warmup_steps = 5000
  config.opt.decay_fraction = 0.2
  config.opt.weight_decay = 0.1
  config.checkpoint.every_steps = 1000
  config.eval.every_steps = 1000
  if variant == "smoke":               # shapes of the real model, a few steps
    config.steps = 10
    config.seq_len = 1024
    config.model.loss_chunk = 1024     # a chunk must divide the row
    config.batch_size = 2
    config.opt.warmup_steps = 2
    config.checkpoint.every_steps = 0
    config.eval.every_steps = 0
  elif variant in ("fast", "lean"):
    config.model.scan_layers = False       # no stacking copies; each layer its own GEMM plan
    config.model.remat = "save_dots_fp8"   # keep the backward's FP8 operands: no re-quantizing
    if variant == "lean":
      config.opt.moments = "fp8"           # 2.1 bytes a param for Adam's moments, not 8
  elif variant:
    raise ConfigError(f"unknown variant {variant!r} of configs/1p5b.py; valid: 'smoke', "
                      "'fast', 'lean'")
  return config
