"""FP8 attention's forward (infir2_fp8attn) against infir2 x 3 seeds, on a CPU (issue 39).

  python -m infir2_jax.ablation.sweep --config=configs/sweeps/fp8attn.py \\
      --workdir=runs/fp8attn_sweep --parallel=2
  python -m infir2_jax.ablation.report runs/fp8attn_sweep --out_dir=reports/fp8attn_sweep

The default sweep's base model, data and step budget (configs/sweeps/default.py: 100 steps
of 8 x 128 tokens of the embedded 5M-parameter model, documents packed with the document
mask), with the grid over two recipes that differ only in attention: infir2 (BF16
attention, the paper's) and infir2_fp8attn (QK^T and PV in E4M3, backward BF16). Runs of one
seed share the initialization and the batches, so differences are paired by seed; the
report compares infir2_fp8attn to infir2 at the default sweep's 1% margin.
"""

import os

from infir2_jax.config import ConfigError, get_config_dict

RECIPES = ("infir2", "infir2_fp8attn")


def get_config(variant: str | None = None):
  if variant not in (None, "tiny"):
    raise ConfigError(f"unknown variant {variant!r} of configs/sweeps/fp8attn.py; valid: "
                      "'tiny'")
  default = os.path.join(os.path.dirname(os.path.abspath(__file__)), "default.py")
  c = get_config_dict(default + (":tiny" if variant == "tiny" else ""))
  c.grid.precision = dict(recipe=RECIPES)
  c.grid.seed = (0, 1, 2) if variant != "tiny" else (0, 1)
  c.report = dict(c.report, reference="infir2")
  return c
