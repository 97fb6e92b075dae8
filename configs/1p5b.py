"""Qwen2.5-1.5B, continual pre-training with the InfiR2 FP8 recipe (one GPU or many).

  python -m infir2_jax.train --config=configs/1p5b.py --workdir=runs/1p5b
  python -m infir2_jax.train --config=configs/1p5b.py --config.mesh.tensor=2   # TP 2, as the paper
  python -m infir2_jax.train --config=configs/1p5b.py \
      --config.init.hf_checkpoint=/path/to/Qwen2.5-1.5B                       # from real weights
  python -m infir2_jax.train --config=configs/1p5b.py:lean                    # the least memory
  python -m infir2_jax.train --config=configs/1p5b.py:scanned                 # the fastest compile

The default is the fastest step measured: unrolled layers (each its own GEMM plan, no stacking
copies) that keep the backward's FP8 operands (remat save_dots_fp8; for bf16 it is save_dots).
On one H200 at 2 x 8192 with the fused loss, infir2's step took 337.6 ms / 50.9 GiB against
398.9 ms / 48.7 GiB scanned with save_dots, in the same run (session 22,
benchmarks/results/train_step_h200_1p5b_s22_8k_remat.json), for ~60 s of cold compile
instead of ~37. At this config's own batch (8 x 4096 tokens) the H200 compiler allocates
88.8 GiB for it, 78.1 scanned, 78.5 for bf16 (deviceless; the GPU adds ~6 GiB;
benchmarks/results/peak_buffers_1p5b_s22_default_8x4096.json): one H200 holds it, an 80-GB
card needs the batch split over GPUs or gradient accumulation.

Variants: "smoke" (the real shapes, a few steps); "lean" (Adam's moments in FP8: 42.4 GiB
peak, 0.70x bf16's 60.2, in 333.9 ms a step, 1.016x the default's, session 21,
benchmarks/results/train_step_h200_1p5b_s21_8k_fusedloss.json); "scanned" (one compiled layer
body for all 28, save_dots: the old default, 1.18x the default's step time, 0.96x its peak,
compiles ~1.6x faster); "fast" (the same as the default; it was the name of this
configuration before it became the default, kept so that older commands still run).

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
  config.model.remat = "save_dots_fp8"  # the backward's FP8 operands kept: no re-quantizing
  config.model.scan_layers = False     # each layer its own GEMM plan, no stacking copies
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
  elif variant == "lean":
    config.opt.moments = "fp8"             # 2.1 bytes a param for Adam's moments, not 8
  elif variant == "scanned":
    config.model.scan_layers = True        # one compiled layer body: the fastest compile
    config.model.remat = "save_dots"
  elif variant not in (None, "", "fast"):  # "fast": the default's name before it was default
    raise ConfigError(f"unknown variant {variant!r} of configs/1p5b.py; valid: 'smoke', "
                      "'lean', 'scanned', 'fast' (= the default)")
  return config
