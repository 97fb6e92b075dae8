"""SFT stage 2 (InfiAlign-SFT-165k), starting from stage 1's final weights: the paper's settings.

  python -m infir2_jax.train --config=configs/sft_stage2.py --workdir=runs/sft_stage2 \
      --config.data.source='/path/to/InfiAlign-SFT-165k/*.jsonl' --config.mesh.tensor=2
  python -m infir2_jax.export --workdir=runs/sft_stage2 --out=runs/sft_stage2/hf [--fp8]

CPU demo (from the stage-1 demo, on the shipped HumanEval code chats):
  python -m infir2_jax.train --config=configs/sft_stage2.py:demo --workdir=runs/sft_demo2

Same optimisation as stage 1 (configs/sft_stage1.py documents it and the step count:
5 x 165k / 64 = 12,891 steps if every row held one sample). Stage 2 starts from stage 1's
float32 master weights through `init.from_run` = stage 1's workdir (the optimizer starts
fresh, as in the release scripts, which load stage 1's weights into a new run). To start from
an HF export instead: --config.init.from_run= --config.init.hf_checkpoint=DIR.
"""

import importlib.util
import os

from infir2_jax.config import ConfigError

NUM_SAMPLES = 165_000      # InfiAlign-SFT-165k


def _stage1():
  spec = importlib.util.spec_from_file_location(
      "config_sft_stage1", os.path.join(os.path.dirname(__file__), "sft_stage1.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def get_config(variant: str | None = None):
  stage1 = _stage1()
  if variant == "demo":
    return stage1.demo_config(stage=2)
  if variant:
    raise ConfigError(f"unknown variant {variant!r} of configs/sft_stage2.py; valid: 'demo'")
  config = stage1.get_config()
  stage1.apply_sft_settings(config, NUM_SAMPLES)
  config.data.source = "InfiAlign-SFT-165k/*.jsonl"  # set to your copy of the data
  config.init.from_run = "runs/sft_stage1"           # stage 1's workdir (its latest step)
  return config
