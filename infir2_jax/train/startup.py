"""A run's start-up and its last words: phase timings, what the console says, and the state.

The trainer builds a run in phases, cheap checks first (config, data, the abstract state
and its memory), then the expensive ones (compiling the step, allocating the state).
`PhaseClock` times each phase and prints one line before the first step; `closing_summary`
is the run's last message: the final losses, the wall time, where it all is, what to run
next.
"""

import contextlib
import logging
import math
import os
import shlex
import shutil
import sys
import time

import jax
import numpy as np

from infir2_jax.config import TrainConfig
from infir2_jax.data import packing
from infir2_jax.errors import DataError
from infir2_jax.model import projections
from infir2_jax.precision import gemm, resolve_recipe
from infir2_jax.train import continuation, rundir

# How the compiled HLO names a Pallas Mosaic GPU kernel call.
MOSAIC_GPU_CALL = 'custom_call_target="mosaic_gpu'


class PhaseClock:
  """Wall time of the named start-up phases, in the order they ran."""

  def __init__(self):
    self.t0 = time.perf_counter()
    self.phases: dict[str, float] = {}
    self.beside: dict[str, float] = {}   # phases that ran on another thread, beside these
    self.startup_s = 0.0  # set by line(), at the end of the start-up

  @contextlib.contextmanager
  def phase(self, name: str):
    t0 = time.perf_counter()
    try:
      yield
    finally:
      self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - t0

  def elapsed(self) -> float:
    return time.perf_counter() - self.t0

  def line(self) -> str:
    """"start-up 14.2 s: config checks 0.1 s, data 1.3 s, ...; beside them: init 2.0 s"
    (the rest: model building)."""
    self.startup_s = self.elapsed()
    join = lambda phases: ", ".join(f"{name} {s:.1f} s" for name, s in phases.items())
    beside = f"; beside them: {join(self.beside)}" if self.beside else ""
    return f"start-up {self.startup_s:.1f} s to the first step: {join(self.phases)}{beside}"


def eval_batch_count(cfg: TrainConfig, data, log=print) -> int:
  """Validation batches per evaluation: eval.batches, or all there are when fewer (said so).

  A config written for a large corpus (configs/1p5b.py asks for 8) still runs on a small
  one; 0 evaluations are asked for when eval.every_steps is 0, and when data.val_fraction=0
  without data.val_source asked for no validation split (one change turns validation off).
  """
  if cfg.eval.every_steps <= 0:
    return 0
  available = data.num_eval_batches()
  if available == 0 and cfg.data.val_fraction == 0 and not cfg.data.val_source:
    log("note: data.val_fraction=0 (and no data.val_source): no validation split, so no "
        "evaluation (eval.every_steps is ignored)")
    return 0
  if available == 0:
    raise DataError("eval.every_steps > 0 but there is no validation split: set "
                    "data.val_fraction > 0 or data.val_source, or --config.eval.every_steps=0")
  wanted = cfg.eval.batches if cfg.eval.batches > 0 else available
  if wanted > available:
    log(f"note: eval.batches={wanted} but the validation split has {available} batch(es) of "
        f"{cfg.batch_size}x{cfg.seq_len} tokens ({data.stats['val'].tokens:,} tokens): "
        f"evaluating on all {available}")
    return available
  return wanted


def abstract_batch(cfg: TrainConfig, pad_id: int, sharding) -> dict[str, jax.ShapeDtypeStruct]:
  """The global batch's shapes and dtypes (as the data pipeline builds them), for compiling."""
  row = packing.empty_rows(1, cfg.seq_len, pad_id)
  return {k: jax.ShapeDtypeStruct((cfg.batch_size, cfg.seq_len), v.dtype, sharding=sharding)
          for k, v in row.items()}


def init_source(cfg: TrainConfig, start_step: int) -> str:
  """Where the run's weights come from, as the start-up line says it."""
  if start_step:
    return f"resumed from step {start_step}"
  if cfg.init.hf_checkpoint:
    return f"weights from the HF checkpoint {cfg.init.hf_checkpoint}"
  if cfg.init.from_run:
    which = "latest step" if cfg.init.from_run_step < 0 else f"step {cfg.init.from_run_step}"
    return f"weights from run {cfg.init.from_run} ({which}), fresh optimizer"
  return f"from scratch (random init, seed {cfg.seed})"


def precision_line(cfg: TrainConfig, compiled=None) -> str:
  """Whether FP8 is on, in how many projections, and which backend runs its GEMMs.

  With the compiled train step, counts the Pallas kernel calls it really contains.
  """
  paths = [path for path, _, _ in projections(cfg.model)]
  fp8 = [p for p in paths if not resolve_recipe(cfg.precision, p).is_bf16]
  if not fp8:
    return f"precision {cfg.precision.recipe}: BF16 GEMMs everywhere (no FP8)"
  where = f"{len(fp8)} of {len(paths)} projections"
  try:
    kernels = gemm.pallas_kernels(cfg.precision.backend)
  except RuntimeError as e:
    return f"FP8 on ({cfg.precision.recipe}, {where}); backend error: {e}"
  if kernels is None:
    why = ("precision.backend='xla'" if cfg.precision.backend == "xla"
           else "the Pallas kernels need a Hopper GPU")
    return (f"FP8 on: recipe {cfg.precision.recipe} in {where}; GEMMs on the XLA path "
            f"({jax.default_backend()}; {why})")
  calls = None
  if compiled is not None:
    try:
      calls = compiled.as_text().count(MOSAIC_GPU_CALL)
    except Exception:  # noqa: BLE001 - the count is a diagnostic only
      calls = None
  if calls == 0:  # "auto" falls back per GEMM where the kernels do not take the shapes
    return (f"FP8 on: recipe {cfg.precision.recipe} in {where}; GEMMs on the XLA path (the "
            "compiled train step has no Pallas kernel call: the kernels took none of its shapes)")
  count = "" if calls is None else f", {calls} kernel calls in the train step"
  return (f"FP8 on: recipe {cfg.precision.recipe} in {where}; GEMMs on the Pallas kernels "
          f"(Mosaic GPU, backend {cfg.precision.backend!r}{count})")


def fresh_state(params, optimizer, shardings):
  """The step-0 train state around given params: zero Adam moments, placed shard by shard.

  For weights loaded from an HF checkpoint or another run: no random init is compiled or
  run just to be thrown away.
  """
  opt_state = jax.jit(optimizer.init, out_shardings=shardings["opt_state"])(params)
  return {"step": jax.device_put(np.int32(0), shardings["step"]), "params": params,
          "opt_state": opt_state}


def _duration(seconds: float) -> str:
  minutes, s = divmod(int(round(seconds)), 60)
  return f"{minutes} min {s} s" if minutes else f"{seconds:.1f} s"


def python_command() -> str:
  """How to name this interpreter on the next command line: `python` when that is it on PATH
  (an active venv), else its path (`.venv/bin/python` when run as that from the repo)."""
  on_path = shutil.which("python")
  if on_path and os.path.abspath(on_path) == os.path.abspath(sys.executable):
    return "python"
  relative = os.path.relpath(sys.executable)
  return relative if not relative.startswith("..") else sys.executable


def closing_summary(cfg: TrainConfig, workdir: str, last: dict, *, start_step: int,
                    wall_s: float, startup_s: float) -> str:
  """The run's last message: what it reached, how long it took, where it is, what next."""
  ran = cfg.steps - start_step
  losses = []
  if "loss" in last:
    losses.append(f"loss {last['loss']:.4f}")
  if "eval_loss" in last:
    losses.append(f"eval_loss {last['eval_loss']:.4f} (perplexity "
                  f"{math.exp(min(last['eval_loss'], 700)):.4g})")
  head = (f"done: steps {start_step + 1}-{cfg.steps} in {_duration(wall_s)} "
          f"(start-up {_duration(startup_s)})" if ran > 0 else
          f"done: nothing to run, {workdir} had finished its {cfg.steps} steps")
  steps = rundir.checkpoint_steps(workdir) if jax.process_index() == 0 else []
  where = f"checkpoint {steps[-1]}" if steps else "no checkpoint"
  wd, py = shlex.quote(workdir), shlex.quote(python_command())
  lines = [head + (": " + ", ".join(losses) if losses else ""),
           f"run directory {workdir}: metrics.jsonl, tb/, {where}",
           "next:",
           f"  {py} -m infir2_jax.ablation.plot_run {wd}    # loss curves -> {wd}/loss.png",
           f"  {py} -m infir2_jax.generate --workdir={wd} --prompt='...'",
           f"  {py} -m infir2_jax.export --workdir={wd} --out={wd}/hf [--fp8]"]
  if cfg.data.format == "chat":
    lines.append(f"  {py} -m infir2_jax.inference.evaluate --workdir={wd} --limit=16")
  lines.append(continuation.next_run_hint(cfg, workdir))
  logging.info("%s", " | ".join(lines))
  return "\n".join(lines)
