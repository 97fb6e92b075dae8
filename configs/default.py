"""The embedded default: a 5.2M-parameter Qwen2, 250 steps of 16 x 256 tokens of Shakespeare.

  python -m infir2_jax.train                                    # this config
  python -m infir2_jax.train --config.precision.recipe=infir2   # same run in FP8
  python -m infir2_jax.train --config=configs/default.py:smoke  # a 20-step smoke run

Every key and its meaning: infir2_jax/config.py and the dataclasses it names.
"""

from infir2_jax.config import ConfigError, default_config


def get_config(variant: str | None = None):
  config = default_config()
  if variant == "smoke":
    config.steps = 20
    config.batch_size = 4
    config.seq_len = 128
    config.checkpoint.every_steps = 10
    config.eval.every_steps = 10
    config.eval.batches = 2
    config.opt.warmup_steps = 5        # a quarter of the run (the default 30 would not fit)
  elif variant:
    raise ConfigError(f"unknown variant {variant!r} of configs/default.py; valid: 'smoke'")
  return config
