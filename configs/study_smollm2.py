"""The GPU-scale precision study (issue 38): continual pre-training of SmolLM2-135M, 5 x 3 runs.

  python -m infir2_jax.ablation.study --study=configs/study_smollm2.py --budget_s=1200 \
      --results=reports/gpu_study/runs        # one slice; re-run until the grid is done
  python -m infir2_jax.ablation.study_report --results=reports/gpu_study/runs \
      --out_dir=reports/gpu_study             # the report alone (the study rebuilds it too)
  python -m infir2_jax.ablation.study --study=configs/study_smollm2.py:tiny ...  # CPU, minutes

Weights: SmolLM2-135M-Instruct's real (Q4_1-dequantized) weights, converted once to an HF
directory at SMOLLM2_HF by scripts/check_smollm2.py (reports/gpu_study/README.md says how
to bring them onto a GPU machine that reaches no registry). Data: the committed Shakespeare
works and the CPython standard library, one source held out by document (5% of the text):
4.86M SmolLM2 tokens in all (Shakespeare 1.56M, stdlib 3.30M over 683 files, measured with
its tokenizer), 4,599,207 for training (the trainer's count: 696 documents, 29 held out).
A run reads STEPS x 4 x 2048 = 16.4M tokens: every training document repeats ~3.6 times
(epochs), both sources alike. Checked on a CPU (2 steps at seq 256, infir2_wgrad_dy_bf16):
the weights load (134.5M params, FP8 in 210 of 211 projections), validation loss 3.741 at
step 0, telemetry and scanned steps compile (the telemetry step: 4 min 20 s on 2 cores).

Step count, planned from an assumed, not measured, throughput: no H200 figure of a model
this small exists in benchmarks/results (the 1.5B trains at ~40k tokens/s, 45% MFU). At
~1.2 GFLOP per token (6 x 135M + attention at 2048), 25% MFU gives ~50 ms per 8192-token
bf16 step alone on the GPU; FP8 recipes on XLA's dequantize path (576 is no multiple of 128)
assumed 1.5x that; with start-up and compilation ~4-5 min per run, and 4 runs sharing the
GPU at ~1.7x one run's throughput, the 15 runs need ~40 min of one H200: under the ~2 h cap
even at half the assumed speed. The first slice measures (its runs' wall times are in
RESULTS/<run>/DONE); if they say otherwise, change STEPS alone before any run is finished
(a results folder refuses another grid).
"""

import ml_collections

from infir2_jax.config import ConfigError

STEPS = 2000               # the one field to set from the first measured slice
LOG_EVERY = 10             # telemetry is logged on log steps only: its period is a multiple
SMOLLM2_HF = "/tmp/smollm2_hf"   # the converted HF directory (weights + tokenizer.json)
RECIPES = ("bf16", "infir2", "infir2_fp32_scale", "infir2_e5m2_grad", "infir2_wgrad_dy_bf16")


def get_config(variant: str | None = None):
  c = ml_collections.ConfigDict()
  c.base = ""                                 # the default train config, changed below
  o = c.overrides = ml_collections.ConfigDict()
  # SmolLM2-135M's architecture (its config.json; the loader checks every field).
  o.model = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                 num_heads=9, num_kv_heads=3, head_dim=0, rope_theta=1e5,
                 rms_norm_eps=9.999999747378752e-06,  # 1e-5 as float32, as config.json has it
                 tie_embeddings=True, qkv_bias=False, dtype="bfloat16", param_dtype="float32",
                 attention="auto",          # cuDNN on GPU
                 max_documents=64,          # stdlib files are short: many per 2048-token row
                 scan_layers=True)          # one compiled layer (telemetry steps unroll)
  o.init = dict(hf_checkpoint=SMOLLM2_HF)
  o.data = dict(source="shakespeare,stdlib", tokenizer=SMOLLM2_HF, val_fraction=0.05)
  o.steps = STEPS
  o.batch_size = 4
  o.seq_len = 2048
  # The paper's WSD schedule (configs/1p5b.py): 1e-4 peak, 12.5% warm-up, last 20% decays
  # linearly to 1e-5.
  o.opt = dict(schedule="wsd", lr=1e-4, warmup_steps=STEPS // 8, decay_fraction=0.2,
               min_lr_ratio=0.1, weight_decay=0.1, clip_norm=1.0)
  o.eval = dict(every_steps=STEPS // 8, batches=16)       # 16 x 4 x 2048 = 131k val tokens
  o.precision = dict(   # FP8 numerics at 4 points
      telemetry_every_steps=max(LOG_EVERY, STEPS // 4 // LOG_EVERY * LOG_EVERY))
  o.checkpoint = dict(every_steps=STEPS // 4, keep=1)    # a stopped run resumes from here
  o.log = dict(every_steps=LOG_EVERY, progress_bar=False, tensorboard=False)
  c.grid = ml_collections.ConfigDict()
  c.grid.precision = dict(recipe=RECIPES)
  c.grid.seed = (0, 1, 2)
  # Report: equivalence to bf16 within 1% of its validation loss (why: the report's README).
  c.report = dict(reference="bf16", margin=0.01, last_k=20, alpha=0.05)
  c.study = dict(parallel=4, threads_per_run=0)
  if variant == "tiny":   # the whole pipeline on a CPU: a random tiny Qwen2, 2 x 2 runs
    o.model = dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2,
                   num_kv_heads=1, scan_layers=True, max_documents=64)
    o.init = dict(hf_checkpoint="")
    o.data = dict(source="shakespeare", val_fraction=0.05)
    o.steps, o.batch_size, o.seq_len = 8, 2, 64
    o.opt = dict(schedule="wsd", lr=1e-3, warmup_steps=2, decay_fraction=0.25)
    o.eval = dict(every_steps=4, batches=2)
    o.precision = dict(telemetry_every_steps=4)
    o.checkpoint = dict(every_steps=2, keep=1, async_save=False)
    o.log = dict(every_steps=1, progress_bar=False, tensorboard=False)
    c.grid.precision.recipe = ("bf16", "infir2")
    c.grid.seed = (0, 1)
    c.report = dict(reference="bf16", margin=0.01, last_k=3, alpha=0.05, min_steps=4)
    c.study = dict(parallel=2, threads_per_run=1)
  elif variant:
    raise ConfigError(f"unknown variant {variant!r} of configs/study_smollm2.py; valid: 'tiny'")
  return c
