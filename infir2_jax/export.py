"""Export a run's checkpoint as an HF checkpoint: bf16 (or block-scaled FP8) safetensors.

  python -m infir2_jax.export --workdir=runs/sft1 --out=runs/sft1/hf [--step=N] [--fp8]
      [--overwrite]

Reads the run's config and its checkpoint's params layer by layer (orbax partial restore: the
host never holds more than one layer in float32 plus one output shard) and writes them with
infir2_jax.hf.save (its docstring describes the files and the FP8 layout).

Safe on a live run: only committed checkpoints are read, their checksums verified; one that
the run's checkpoint.keep removes while it is read is replaced by the newest one (unless
--step names it). The export is written into a new folder and renamed into place: --out is
never half-written, and a failed export leaves an earlier one there intact. --out must not
be the run directory (or contain it), and a non-empty --out needs --overwrite.
"""

import os

from infir2_jax import errors
from infir2_jax.data.tokenizer import load_tokenizer
from infir2_jax.hf.save import export_params
from infir2_jax.train import integrity, rundir
from infir2_jax.train.checkpoint import iter_checkpoint_params

_ATTEMPTS = 3  # a live run with a small checkpoint.keep may remove the newest step again


def _check_out(workdir: str, out_dir: str) -> None:
  run, out = os.path.realpath(workdir), os.path.realpath(out_dir)
  if out == run or run.startswith(out + os.sep):
    raise ValueError(f"--out={out_dir} is the run directory {workdir} or contains it: the "
                     f"export would replace the run's own files (config.json). Choose another "
                     f"folder, e.g. --out={os.path.join(workdir, 'hf')}")
  checkpoints = os.path.realpath(rundir.checkpoints_dir(workdir))
  if out == checkpoints or out.startswith(checkpoints + os.sep):
    raise ValueError(f"--out={out_dir} is inside the run's checkpoints ({checkpoints})")


def export_run(workdir: str, out_dir: str, step: int | None = None, fp8: bool = False,
               max_shard_bytes: int = 4 << 30, overwrite: bool = False) -> str:
  """Exports WORKDIR's checkpoint (latest, or `step`) to out_dir; returns a summary line."""
  _check_out(workdir, out_dir)
  cfg = rundir.read_config(workdir)
  tokenizer = load_tokenizer(cfg.data.tokenizer, cache_dir=cfg.data.cache_dir)
  for attempt in range(_ATTEMPTS):
    path, got = rundir.checkpoint_item(workdir, step)
    step_dir = os.path.dirname(path)
    try:
      integrity.verify(step_dir)
      files = export_params(iter_checkpoint_params(path), cfg.model, out_dir, fp8=fp8,
                            tokenizer=tokenizer, chat=cfg.data.format == "chat",
                            system_prompt=cfg.data.system_prompt,
                            max_shard_bytes=max_shard_bytes, overwrite=overwrite)
      break
    except integrity.DamagedCheckpoint as e:
      raise ValueError(f"checkpoint {got} of {workdir} is damaged: {e}; export another one "
                       f"with --step (available: {rundir.checkpoint_steps(workdir)})") from None
    except Exception:  # pylint: disable=broad-except
      if os.path.isdir(step_dir):
        raise
      if step is not None or attempt == _ATTEMPTS - 1:  # removed while we read it
        raise RuntimeError(f"checkpoint {got} of {workdir} was removed while it was read (the "
                           "run is still training and keeps only its last checkpoint.keep); "
                           "export a newer one, or after training") from None
  kind = "FP8 (128x128 blocks)" if fp8 else "bf16"
  return (f"exported step {got} of {workdir} to {out_dir}: {kind}, {len(files)} safetensors "
          f"file(s), {cfg.model.num_params() / 1e6:.1f}M params")


def main(argv):
  from absl import flags  # pylint: disable=g-import-not-at-top
  from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top
  del argv
  absl_logging.set_verbosity(absl_logging.WARNING)   # orbax logs every read at INFO
  f = flags.FLAGS
  with errors.cli_errors(f.debug or errors.debug_requested()):
    try:
      print(export_run(f.workdir, f.out, None if f.step < 0 else f.step, f.fp8,
                       overwrite=f.overwrite))
    except (ValueError, FileExistsError, FileNotFoundError, RuntimeError) as e:
      if f.debug or errors.debug_requested():
        raise
      raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
  from absl import app, flags  # pylint: disable=g-import-not-at-top
  flags.DEFINE_string("workdir", None, "Run directory (config.json + checkpoints/).", required=True)
  flags.DEFINE_string("out", None, "Output HF checkpoint directory.", required=True)
  flags.DEFINE_integer("step", -1, "Checkpoint step to export (-1 = the latest).")
  flags.DEFINE_bool("fp8", False, "Write block-scaled FP8 projection weights (vLLM/SGLang).")
  flags.DEFINE_bool("debug", False, "Show the traceback of a user error, not only its "
                    "`error:` line (also INFIR2_DEBUG=1).")
  flags.DEFINE_bool("overwrite", False, "Replace a non-empty --out (once the new export is "
                    "complete).")
  app.run(main)
