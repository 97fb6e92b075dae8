"""Continuing a run with other `steps`: where its schedule's decay goes, and the lr it resumes at.

A WSD schedule (warm-up, stable, decay) is laid out over the run's steps. Recomputing it
over a new `steps` on a resume would move the lr at once (a finished run's 3.7e-4 became
1.5e-3 at the next step). Instead, on a resume whose config has other steps than the run's:

  - a run still in warm-up or in the stable phase moves its decay to the new end (said so);
  - a run whose decay has begun keeps it where it was (opt.schedule_steps = the run's
    length) and trains on at the final lr, or with opt.rewind_to_stable restarts from the
    checkpoint saved where the decay began and decays at the new end; the checkpoints after
    it move to checkpoints_rewound/ (rundir), its later metrics rows to
    metrics_superseded.jsonl;
  - cosine and constant schedules keep the run's layout (past it: the final lr).

Whatever the plan, a resume whose lr at its first step leaves the range the run's own
schedule spans there (a deliberate opt.lr change too) is warned about.
"""

import dataclasses
import os
import warnings

import numpy as np

from infir2_jax.config import TrainConfig
from infir2_jax.errors import ConfigError
from infir2_jax.train import resume, rundir
from infir2_jax.train.optim import final_lr, make_schedule, schedule_length, stable_end


@dataclasses.dataclass(frozen=True)
class Plan:
  cfg: TrainConfig                 # the config to train with (opt.schedule_steps set as needed)
  notes: tuple[str, ...] = ()      # lines for the console, in order
  rewind_to: int | None = None     # restart from this checkpoint (later ones moved aside)


def _lr(cfg: TrainConfig, index: int) -> float:
  with warnings.catch_warnings():   # a clamped warm-up was warned about when it was set
    warnings.simplefilter("ignore")
    return float(make_schedule(cfg.opt, cfg.steps, warn=False)(max(index, 0)))


def _same_schedule(a: TrainConfig, b: TrainConfig, start: int) -> bool:
  """Whether a and b give the same lr to every step after `start` that either trains."""
  end = max(a.steps, b.steps)
  if end <= start:
    return True
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    steps = np.arange(start, end)
    return bool(np.allclose(make_schedule(a.opt, a.steps, warn=False)(steps),
                            make_schedule(b.opt, b.steps, warn=False)(steps), rtol=1e-6, atol=0))


def _with_schedule_steps(cfg: TrainConfig, length: int) -> TrainConfig:
  opt = dataclasses.replace(cfg.opt, schedule_steps=0 if length == cfg.steps else length)
  return dataclasses.replace(cfg, opt=opt)


def plan(cfg: TrainConfig, workdir: str) -> Plan:
  """How `cfg` continues the run in `workdir` from its newest checkpoint (cfg unchanged for a
  new run, or one whose schedule the config does not change)."""
  old_values = rundir.config_dict(workdir)
  saved = rundir.checkpoint_steps(workdir)
  if old_values is None or not saved:
    return Plan(cfg)
  old, step = resume.config_of(old_values), saved[-1]
  if step >= cfg.steps:
    return Plan(cfg)
  new, notes, rewind_to = _layout(old, cfg, step, saved)
  jump = _jump(old, new, step if rewind_to is None else rewind_to)
  return Plan(new, tuple(notes) + ((jump,) if jump else ()), rewind_to)


def _layout(old: TrainConfig, cfg: TrainConfig, step: int, saved: list[int]):
  """(config, notes, rewind step) of the schedule a resume at `step` trains with."""
  if cfg.opt.schedule_steps:   # set by hand: the user's layout
    return cfg, [], None
  old_length = schedule_length(old.opt, old.steps)
  kept = _with_schedule_steps(cfg, old_length)
  if _same_schedule(kept, cfg, step):
    return cfg, [], None
  end_old = stable_end(old.opt, old_length)
  wsd = cfg.opt.schedule == old.opt.schedule == "wsd"
  if wsd and step <= end_old:
    if stable_end(cfg.opt, cfg.steps) < step:   # fewer steps: decaying from here is a jump
      return cfg, [], None
    return cfg, [f"schedule: step {step} is before the run's decay (it would begin after "
                 f"step {end_old}); the decay moves to the new end, steps "
                 f"{stable_end(cfg.opt, cfg.steps) + 1}-{cfg.steps}"], None
  final = f"{final_lr(cfg.opt):.3g}"
  if wsd and step > end_old and cfg.opt.rewind_to_stable:
    before = [s for s in saved if s <= end_old]
    if not before:
      raise ConfigError(f"opt.rewind_to_stable: no checkpoint of the run at or before step "
                        f"{end_old}, where its decay began, is left (checkpoints: {saved})")
    rewind_to = before[-1]
    if stable_end(cfg.opt, cfg.steps) < rewind_to:
      raise ConfigError(f"opt.rewind_to_stable: steps={cfg.steps} would decay before step "
                        f"{rewind_to}, the checkpoint it restarts from; raise steps")
    return cfg, [f"schedule: restarting from checkpoint {rewind_to}, the last before the "
                 f"decay (opt.rewind_to_stable); checkpoints {[s for s in saved if s > rewind_to]}"
                 f" move to {rundir.REWOUND_DIR}/; the decay now runs over steps "
                 f"{stable_end(cfg.opt, cfg.steps) + 1}-{cfg.steps}"], rewind_to
  rewind = (" (--config.opt.rewind_to_stable=True restarts from the checkpoint before the "
            "decay and decays at the new end instead)" if wsd else "")
  past = (f"; steps {old_length + 1}-{cfg.steps} train at the final lr {final}"
          if cfg.steps > old_length else "")
  if wsd:
    head = (f"the run's decay began after step {end_old}: it stays where it was (steps "
            f"{end_old + 1}-{old_length})")
  else:
    head = f"the run's {old.opt.schedule} schedule stays laid out over its {old_length} steps"
  return kept, [f"schedule: {head}{past}{rewind}"], None


def _jump(old: TrainConfig, new: TrainConfig, step: int) -> str | None:
  """A warning when the lr of step `step` + 1 under `new` leaves the range the run's own
  schedule spans there (its lr at step `step` and at `step` + 1)."""
  lo, hi = sorted((_lr(old, step - 1), _lr(old, step)))
  lr = _lr(new, step)
  if lo * (1 - 1e-6) <= lr <= hi * (1 + 1e-6):
    return None
  return (f"warning: the learning rate jumps at step {step + 1}: the run's schedule gives "
          f"{_lr(old, step):.4g} there (step {step} trained at {_lr(old, step - 1):.4g}), this "
          f"config {lr:.4g}")


def rewind(workdir: str, step: int) -> list[str]:
  """Moves the checkpoints after `step` to WORKDIR/checkpoints_rewound/; returns them."""
  moved = []
  for s in rundir.step_dirs(workdir):
    if s > step:
      target = rundir.rewound_path(workdir, s)
      os.makedirs(os.path.dirname(target), exist_ok=True)
      os.replace(rundir.step_dir(workdir, s), target)
      moved.append(target)
  return moved


def next_run_hint(cfg: TrainConfig, workdir: str) -> str:
  """The closing summary's line on continuing a finished run: what more steps would do."""
  more = 2 * cfg.steps
  length = schedule_length(cfg.opt, cfg.steps)
  end = stable_end(cfg.opt, cfg.steps)
  if end is None:
    return f"  the same command with --config.steps={more} continues at lr {cfg.opt.lr:.3g}"
  line = (f"  the same command with --config.steps={more} goes on at the final lr "
          f"{final_lr(cfg.opt):.3g} (the decay stays where it was)")
  if cfg.opt.schedule == "wsd" and end < length:
    before = [s for s in rundir.checkpoint_steps(workdir) if s <= end]
    if before:
      line += (f"; add --config.opt.rewind_to_stable=True to restart from step {before[-1]}, "
               "before the decay, and decay at the new end")
  return line
