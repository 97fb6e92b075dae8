"""The default precision ablation: 5 recipes x 3 seeds of the embedded small model, on a CPU.

  python -m infir2_jax.ablation.sweep --config=configs/sweeps/default.py \
      --workdir=runs/default_sweep --parallel=2
  python -m infir2_jax.ablation.report runs/default_sweep
  python -m infir2_jax.ablation.sweep --config=configs/sweeps/default.py:tiny \
      --workdir=/tmp/s  # minutes

Sized to finish in <= 30 minutes on a 2-core CPU (measured: see reports/default_sweep/): the
embedded default model (5M params, 4 layers, width 256; configs/default.py) unchanged, but
trained on 100 x 8 x 128 tokens instead of its 250 x 16 x 256 (see `overrides`; ~0.5-0.65 s
per step here, plus one XLA compilation per recipe). Every recipe of one seed starts from the
same initialization and sees the same batches, so differences are paired by seed.
"""

import ml_collections

from infir2_jax.config import ConfigError

RECIPES = ("bf16", "fp8_tensorwise", "infir2", "infir2_fp32_scale", "infir2_e5m2_grad")


def get_config(variant: str | None = None):
  c = ml_collections.ConfigDict()
  c.base = "configs/default.py"        # train config spec the runs start from
  # Fixed for every run (keys as in the train config). Shrunk from the default run for time:
  c.overrides = ml_collections.ConfigDict()
  c.overrides.steps = 100                       # default 250
  c.overrides.batch_size = 8                    # default 16 rows
  c.overrides.seq_len = 128                     # default 256 tokens per row
  c.overrides.opt = dict(warmup_steps=10)       # default 30: the same 10% of the run
  c.overrides.eval = dict(every_steps=25, batches=8)   # the same 8 x 8 x 128 = 8k val tokens
  c.overrides.checkpoint = dict(every_steps=50, keep=1)  # a killed sweep resumes from here
  c.overrides.precision = dict(telemetry_every_steps=50)  # FP8 numerics at steps 50 and 100
  c.overrides.log = dict(progress_bar=False, tensorboard=False)  # plain log lines in train.log
  # The grid: every combination of these values is one run.
  c.grid = ml_collections.ConfigDict()
  c.grid.precision = dict(recipe=RECIPES)
  c.grid.seed = (0, 1, 2)
  # infir2_jax.ablation.report defaults: equivalence to bf16 within 1% of its loss, TOST at 5%.
  c.report = dict(reference="bf16", margin=0.01, last_k=10, alpha=0.05)
  if variant == "tiny":  # a smoke test of the whole pipeline: 2 recipes x 2 seeds, 10 steps
    c.overrides.steps = 10
    c.overrides.batch_size = 4
    c.overrides.opt.warmup_steps = 2
    c.overrides.eval.every_steps = 5
    c.overrides.eval.batches = 2
    c.overrides.checkpoint.every_steps = 5
    c.overrides.precision.telemetry_every_steps = 5
    c.grid.precision.recipe = ("bf16", "infir2")
    c.grid.seed = (0, 1)
    c.report.last_k = 3
  elif variant:
    raise ConfigError(f"unknown variant {variant!r} of configs/sweeps/default.py; valid: 'tiny'")
  return c
