"""Export a run's checkpoint as an HF checkpoint: bf16 (or block-scaled FP8) safetensors.

  python -m infir2_jax.export --workdir=runs/sft1 --out=runs/sft1/hf [--step=N] [--fp8]

Reads the run's config and its checkpoint's params layer by layer (orbax partial restore: the
host never holds more than one layer in float32 plus one output shard) and writes them with
infir2_jax.hf.save (its docstring describes the files and the FP8 layout).
"""

from infir2_jax.data.tokenizer import load_tokenizer
from infir2_jax.hf.save import export_params
from infir2_jax.train import rundir
from infir2_jax.train.checkpoint import iter_checkpoint_params


def export_run(workdir: str, out_dir: str, step: int | None = None, fp8: bool = False,
               max_shard_bytes: int = 4 << 30) -> str:
  """Exports WORKDIR's checkpoint (latest, or `step`) to out_dir; returns a summary line."""
  cfg = rundir.read_config(workdir)
  path, step = rundir.checkpoint_item(workdir, step)
  tokenizer = load_tokenizer(cfg.data.tokenizer, cache_dir=cfg.data.cache_dir)
  files = export_params(iter_checkpoint_params(path), cfg.model, out_dir, fp8=fp8,
                        tokenizer=tokenizer, chat=cfg.data.format == "chat",
                        system_prompt=cfg.data.system_prompt, max_shard_bytes=max_shard_bytes)
  kind = "FP8 (128x128 blocks)" if fp8 else "bf16"
  return (f"exported step {step} of {workdir} to {out_dir}: {kind}, {len(files)} safetensors "
          f"file(s), {cfg.model.num_params() / 1e6:.1f}M params")


def main(argv):
  from absl import flags  # pylint: disable=g-import-not-at-top
  from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top
  del argv
  absl_logging.set_verbosity(absl_logging.WARNING)   # orbax logs every read at INFO
  f = flags.FLAGS
  print(export_run(f.workdir, f.out, None if f.step < 0 else f.step, f.fp8))


if __name__ == "__main__":
  from absl import app, flags  # pylint: disable=g-import-not-at-top
  flags.DEFINE_string("workdir", None, "Run directory (config.json + checkpoints/).", required=True)
  flags.DEFINE_string("out", None, "Output HF checkpoint directory.", required=True)
  flags.DEFINE_integer("step", -1, "Checkpoint step to export (-1 = the latest).")
  flags.DEFINE_bool("fp8", False, "Write block-scaled FP8 projection weights (vLLM/SGLang).")
  app.run(main)
