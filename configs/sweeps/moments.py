"""Adam's stored moments (opt.moments = fp32 | bf16 | fp8) x 3 seeds, infir2, on a CPU.

  python -m infir2_jax.ablation.sweep --config=configs/sweeps/moments.py \\
      --workdir=runs/moments_sweep --parallel=2
  python -m infir2_jax.ablation.report runs/moments_sweep --out_dir=reports/moments_sweep

`--config=configs/sweeps/moments.py:six_seeds` then adds seeds 3-5 of fp32 and fp8 to the
same workdir.

The default sweep's base model, data and step budget (configs/sweeps/default.py: 100 steps
of 8 x 128 tokens of the embedded 5M-parameter model), with the recipe fixed to infir2 and the
grid over how Adam's moments are stored. Runs of one seed share the initialization and the
batches, so differences are paired by seed; the report compares each choice to fp32 moments
(report.compare names the axis; equivalence at 1% of fp32's loss, as the default sweep).
"""

import os

import ml_collections

from infir2_jax.config import ConfigError, get_config_dict

MOMENTS = ("fp32", "bf16", "fp8")


def get_config(variant: str | None = None):
  if variant not in (None, "tiny", "six_seeds"):
    raise ConfigError(f"unknown variant {variant!r} of configs/sweeps/moments.py; valid: "
                      "'tiny', 'six_seeds'")
  default = os.path.join(os.path.dirname(os.path.abspath(__file__)), "default.py")
  c = get_config_dict(default + (":tiny" if variant == "tiny" else ""))
  c.overrides.precision = dict(c.overrides.precision, recipe="infir2")
  c.overrides.precision.telemetry_every_steps = 0   # not what this sweep is about
  c.grid = ml_collections.ConfigDict()
  c.grid.opt = dict(moments=MOMENTS)
  c.grid.seed = (0, 1, 2) if variant != "tiny" else (0, 1)
  if variant == "six_seeds":  # fp8 vs fp32 with 3 more seeds (same workdir: done runs stay)
    c.grid.opt = dict(moments=("fp32", "fp8"))
    c.grid.seed = (0, 1, 2, 3, 4, 5)
  c.report = dict(c.report, compare="opt.moments", reference="fp32")
  return c
