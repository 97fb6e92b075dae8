"""What to do after a non-finite step: advice that fits where the run diverged.

The generic way on ("lower the learning rate, resume from the last good checkpoint") cannot
help when the run diverged at the first step after resuming: then the checkpoint it resumed
from diverges on its next step itself, and resuming from it with the same settings fails the
same way. Nor does a checkpoint matter when a new run diverges at step 1.
"""

import os

from infir2_jax.train import rundir


def advice(step: int, start_step: int, last_good: int | None, checkpoints_dir: str,
           lr: float, saved_steps: list[int] = ()) -> str:
  """The sentences after "the state of that step was not saved." in the NaN error.

  Args:
    step: the step whose loss, grad norm or new state was not finite.
    start_step: the step this start resumed from (0: a new run).
    last_good: the newest finite checkpoint (None: none was saved).
    checkpoints_dir: WORKDIR/checkpoints.
    lr: the run's opt.lr.
    saved_steps: the committed checkpoint steps (for "an earlier checkpoint").
  """
  skip = f"skip this batch with --config.skip_steps=\"({step},)\""
  if start_step and step == start_step + 1 and last_good == start_step:
    earlier = [s for s in saved_steps if s < start_step]
    other = (f"resume from an earlier checkpoint ({', '.join(map(str, earlier))}) by moving "
             f"{os.path.join(checkpoints_dir, str(start_step))} out of {checkpoints_dir} "
             "(keep it)" if earlier else
             "start over from an earlier point (no earlier checkpoint is kept: raise "
             "checkpoint.keep next time)")
    return (f"This start resumed from checkpoint {start_step} and diverged at its very next "
            f"step: checkpoint {start_step} itself diverges on step {step}, so resuming from "
            "it with the same settings fails again. To go on, change what step "
            f"{step} does: {skip} (if that batch is to blame), or lower --config.opt.lr "
            f"well below {lr:g} (the change is recorded), or {other}")
  if not start_step and step == 1:
    return ("A new run diverged at its first step, from its initial parameters: no "
            f"checkpoint is to blame. Check --config.opt.lr (now {lr:g}), opt.eps, "
            f"model.init_std and the precision recipe, or {skip}")
  where = (f"step {last_good} in {checkpoints_dir}" if last_good is not None
           else "none (no checkpoint was saved)")
  start = "it resumes from that checkpoint" if last_good else "it starts over"
  return (f"Last good checkpoint: {where}. To go on, re-run with a lower --config.opt.lr "
          f"({start}; the change is recorded in {rundir.CONFIG_CHANGES_FILE}), or {skip}")
