"""SFT stage 1 (InfiAlign-SFT-72k) of Qwen2.5-1.5B with the InfiR2 FP8 recipe: the paper's settings.

  python -m infir2_jax.train --config=configs/sft_stage1.py --workdir=runs/sft_stage1 \
      --config.init.hf_checkpoint=/path/to/Qwen2.5-1.5B-Instruct \
      --config.data.source='/path/to/InfiAlign-SFT-72k/*.jsonl' --config.mesh.tensor=2
  python -m infir2_jax.export --workdir=runs/sft_stage1 --out=runs/sft_stage1/hf
  python -m infir2_jax.train --config=configs/sft_stage2.py --workdir=runs/sft_stage2  # from it

CPU demo (the small default model on the shipped CHAMP competition-math chats, minutes),
starting from the pretrained embedded default (`python -m infir2_jax.train` -> runs/default):
  python -m infir2_jax.train --config=configs/sft_stage1.py:demo --workdir=runs/sft_demo1
  python -m infir2_jax.inference.evaluate --workdir=runs/sft_demo1 --limit=16

Settings (paper, and the release's docs/SFT.md + scripts/SFT/*.sh): Adam lr 2e-5, betas
0.9/0.95, no weight decay, cosine with 5% warm-up down to 0.1 x lr (the scripts' min-lr
ratio), 5 epochs, global batch 64, per-token loss on assistant tokens only, 32k context,
full recomputation. Data: `{"messages": [...]}` JSONL rendered with the Qwen2.5 template.

Steps: the paper's global batch is 64 samples (dynamic batching up to 32k tokens per GPU);
ours is 64 packed rows of seq_len tokens, each holding one or more samples. `steps` below
assumes one sample per row (5 x 72k / 64 = 5625), an upper bound: the run's first line
prints "N steps/epoch" for the packed data, and 5 epochs is `--config.steps=5N
--config.opt.warmup_steps=N/4` (5% of 5N).
"""

import importlib.util
import os

from infir2_jax.config import ConfigError

NUM_SAMPLES = 72_000       # InfiAlign-SFT-72k
EPOCHS = 5
GLOBAL_BATCH = 64


def _base(name: str):
  spec = importlib.util.spec_from_file_location(
      f"config_{name}", os.path.join(os.path.dirname(__file__), f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def apply_sft_settings(config, num_samples: int):
  """The paper's SFT optimisation settings, for a dataset of num_samples conversations."""
  config.steps = -(-EPOCHS * num_samples // GLOBAL_BATCH)
  config.batch_size = GLOBAL_BATCH
  config.opt.lr = 2e-5
  config.opt.schedule = "cosine"
  config.opt.warmup_steps = round(0.05 * config.steps)   # 5% warm-up
  config.opt.min_lr_ratio = 0.1        # release scripts: --min-lr = lr / 10
  config.opt.b1, config.opt.b2 = 0.9, 0.95
  config.opt.weight_decay = 0.0
  config.opt.clip_norm = 1.0           # Megatron's default
  config.data.format = "chat"          # Qwen2.5 chat template, loss on assistant tokens
  config.precision.recipe = "infir2"
  return config


def get_config(variant: str | None = None):
  if variant == "demo":
    return demo_config(stage=1)
  if variant:
    raise ConfigError(f"unknown variant {variant!r} of configs/sft_stage1.py; valid: 'demo'")
  config = _base("1p5b").get_config()  # Qwen2.5-1.5B architecture, qwen2.5 tokenizer
  apply_sft_settings(config, NUM_SAMPLES)
  config.seq_len = 32768               # the paper's 32k context
  config.grad_accum_steps = 8          # 8 micro-batches of 8 rows: one 32k row per GPU on 8
  config.model.remat = "full"          # the paper: full recomputation
  config.data.source = "InfiAlign-SFT-72k/*.jsonl"   # set to your copy of the data
  config.data.val_fraction = 0.01
  config.init.hf_checkpoint = ""       # set: the CPT result or Qwen2.5-1.5B(-Instruct)
  config.checkpoint.every_steps = 1000
  config.eval.every_steps = 500
  config.eval.batches = 4
  return config


def demo_config(stage: int):
  """The embedded default model SFT'd on shipped data on a CPU: CHAMP math, then HumanEval."""
  config = _base("default").get_config()
  apply_sft_settings(config, num_samples=1)
  config.init.from_run = "runs/default" if stage == 1 else "runs/sft_demo1"  # pretrained first
  config.data.source = "default" if stage == 1 else "humaneval"  # CHAMP train / HumanEval
  config.data.system_prompt = ""       # short prompts: more of each row is learnable tokens
  config.seq_len = 1024                # fits all but the longest 1-2% of the chats
  config.batch_size = 8
  config.grad_accum_steps = 1
  config.steps = 40 if stage == 1 else 50   # 5 epochs: the runs print 8 and 10 steps/epoch
  config.opt.lr = 1e-3                 # a small model mostly learning the format: not 2e-5
  config.opt.warmup_steps = round(0.05 * config.steps)
  config.checkpoint.every_steps = 0    # save at the end only
  config.eval.every_steps = 10
  config.eval.batches = 0              # all of the (small) validation split
  return config
