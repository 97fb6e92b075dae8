"""A jax.profiler trace of the steps profile.start_step ... + profile.steps - 1, in
WORKDIR/profile (rundir.PROFILE_DIR): TensorBoard's profile plugin, XProf or Perfetto read it."""

import os

import jax

from infir2_jax.config import ProfileConfig
from infir2_jax.train import rundir


class StepProfiler:
  """start(step) before a step is dispatched, stop(step, outputs) after; traces the asked-for
  steps only (each process its own file, named by host)."""

  def __init__(self, cfg: ProfileConfig, workdir: str, log=print):
    self.first = cfg.start_step
    self.last = cfg.start_step + cfg.steps - 1
    self.directory = os.path.join(os.path.abspath(workdir), rundir.PROFILE_DIR)
    self.log = log
    self.active = False

  def start(self, step: int) -> None:
    if self.first and step == self.first and not self.active:
      jax.profiler.start_trace(self.directory)
      self.active = True

  def stop(self, step: int, outputs=None, force: bool = False) -> None:
    """Ends the trace after the last traced step has run (its outputs waited for), or now
    with `force` (the run stops early)."""
    if not self.active or not (force or step >= self.last):
      return
    if outputs is not None:
      jax.block_until_ready(outputs)
    jax.profiler.stop_trace()
    self.active = False
    self.log(f"profile: steps {self.first}-{min(step, self.last)} traced to {self.directory}")
