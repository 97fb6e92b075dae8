"""SIGTERM (SLURM's warning before it kills a job) and SIGINT: stop at the next step boundary.

The trainer saves a checkpoint of that step, waits for it to be written and raises
Preempted, a SystemExit with code 128 + the signal number (143 for SIGTERM, 130 for
SIGINT), as a shell reports a process ended by that signal; re-running the same command
resumes. A signal that comes during the last step, its evaluation or its save stops
nothing: the run completes, says so (after_last_step) and exits 0. A second SIGINT
interrupts at once (KeyboardInterrupt).

In a multi-process job the processes must stop at the same step, which a signal each
process sees at its own moment cannot give: there the handlers stay as they are and SIGTERM
is left to JAX's preemption sync manager (jax.distributed), which agrees on one step.
"""

import signal
import threading

import jax


class Preempted(SystemExit):
  """Raised after the stop checkpoint is written; `code` is 128 + the signal number."""

  def __init__(self, signum: int, message: str):
    super().__init__(128 + signum)
    self.signum, self.message = signum, message

  def __str__(self) -> str:
    return self.message


AFTER_LAST_STEP = "as the run ended"   # in after_last_step's line (scripts/fault_injection.py)


def after_last_step(signum: int, steps: int, checkpoints: str) -> str:
  """What the trainer says when a stop signal came as the run ended: it had nothing left to
  stop, so it exits 0 (a scheduler must not requeue a finished job)."""
  return (f"received {signal.Signals(signum).name} {AFTER_LAST_STEP}: all {steps} steps are done "
          f"and checkpoint {steps} is in {checkpoints}; the run is complete (exit 0)")


class StopRequests:
  """Installs the handlers while active (main thread only); `stop_at(step)` says when."""

  def __init__(self):
    self.signum: int | None = None
    self._previous = {}

  def __enter__(self):
    if threading.current_thread() is not threading.main_thread():
      return self  # signal handlers can only be set there; the caller keeps its own
    if jax.process_count() > 1:
      return self
    for signum in (signal.SIGINT, signal.SIGTERM):
      self._previous[signum] = signal.signal(signum, self._handle)
    return self

  def __exit__(self, *exc):
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)
    self._previous = {}
    return False

  def _handle(self, signum, frame):
    del frame
    if self.signum == signal.SIGINT and signum == signal.SIGINT:
      raise KeyboardInterrupt  # the second Ctrl-C: stop now, without the checkpoint
    if self.signum is None:
      self.signum = signum
      print(f"\nreceived {signal.Signals(signum).name}: saving a checkpoint at the next step "
            "boundary, then stopping" + (" (Ctrl-C again to abort at once)"
                                         if signum == signal.SIGINT else ""), flush=True)

  def stop_at(self, step: int) -> bool:
    """True when the loop should save and stop after `step`."""
    if self.signum is not None:
      return True
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      try:
        reached = multihost_utils.reached_preemption_sync_point(step)
      except RuntimeError:  # jax_enable_preemption_service is off
        return False
      if reached:
        self.signum = signal.SIGTERM
      return reached
    return False
