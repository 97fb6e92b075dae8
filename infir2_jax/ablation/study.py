"""A study: a fixed grid of training runs, run in slices that fit a time budget each.

  python -m infir2_jax.ablation.study --study=configs/study_smollm2.py --budget_s=1200 \
      --results=reports/gpu_study/runs [--workdir=/tmp/infir2_study] [--parallel=3]

Each call runs the next runs of the grid (seed-major: every recipe of a seed before the next
seed) that fit in --budget_s, estimated from the wall times of the runs already finished
(none finished: the first wave of --parallel runs measures), `parallel` trainers at once on
one device. Finished runs are skipped. Each run that ends is exported at once to --results
(ablation/results.py: metrics, telemetry, config; no checkpoints), so a killed call loses
only the runs in flight: those resume from their checkpoints in --workdir when it still
exists (the same machine), or restart cleanly. Past --budget_s + --grace_s the runs in
flight are stopped with SIGTERM (the trainer checkpoints first). Then the report is rebuilt
(ablation/study_report.py). A study config is a sweep config (ablation/grid.py) with a
`study` section: parallel (trainers at once), threads_per_run (XLA:CPU threads, 0 = default).
"""

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time

from infir2_jax.ablation import results as results_lib
from infir2_jax.ablation import study_report
from infir2_jax.ablation import sweep
from infir2_jax.ablation.grid import Run, SweepSpec, check_runs, expand, train_command
from infir2_jax.ablation.study_config import StudyError, load_study
from infir2_jax.train import rundir

FINISHED = ("done", "diverged")
ATTEMPTS_FILE = "study_attempts.json"  # WORKDIR/<run>/: wall times of attempts stopped early  # a diverged run is a result (the report lists it), not retried


def _status(results_dir: str, workdir: str, name: str) -> str:
  """A run's status in the results folder, else in the work directory."""
  exported = sweep.run_status(os.path.join(results_dir, name))
  if exported in FINISHED:
    return exported
  return sweep.run_status(os.path.join(workdir, name))


def estimate_s(run: Run, results_dir: str, parallel: int) -> float | None:
  """Seconds `run` takes with `parallel` runs sharing the device, from the finished runs.

  The same recipe's runs first, then any run; a time measured with k runs at once counts as
  k/parallel of the device, so it is scaled by parallel/k when parallel > k (never down: a
  device that was not saturated would make the estimate optimistic). Runs that finished in
  one attempt are what a planned run takes; a run resumed after a stop records the sum of
  its attempts (a second start-up and the steps past its last checkpoint again: session 19's
  infir2_fp32_scale, 772 s against 270-409 for the others, which made every later slice of
  420-460 s plan nothing), so those count only where no single-attempt run is measured.
  None: nothing measured.
  """
  recipe = dict(run.axes).get("precision.recipe")
  same, other, same_resumed, other_resumed = [], [], [], []
  for name in sorted(os.listdir(results_dir)) if os.path.isdir(results_dir) else []:
    done = rundir.read_json(os.path.join(results_dir, name, sweep.DONE_FILE))
    if not done or not done.get("wall_s"):
      continue
    axes = (rundir.read_json(os.path.join(results_dir, name, sweep.RUN_FILE)) or {}).get(
        "axes", {})
    k = max(1, int(done.get("parallel") or 1))
    t = float(done["wall_s"]) * max(1.0, parallel / k)
    is_same = axes.get("precision.recipe") == recipe
    if int(done.get("attempts") or 1) > 1:
      (same_resumed if is_same else other_resumed).append(t)
    else:
      (same if is_same else other).append(t)
  times = same or other or same_resumed or other_resumed
  return max(times) if times else None


def _remaining_fraction(workdir: str, run: Run) -> float:
  """The share of a partial run still to train (checkpointed steps done); 1 for a new run."""
  steps = dict(run.overrides).get("steps")
  ckpts = rundir.checkpoint_steps(os.path.join(workdir, run.name)) if os.path.isdir(
      os.path.join(workdir, run.name)) else []
  if not steps or not ckpts:
    return 1.0
  return max(0.25, 1.0 - max(ckpts) / steps)   # start-up and compilation remain


def plan(pending: list[Run], results_dir: str, workdir: str, budget_s: float,
         parallel: int) -> tuple[list[Run], float | None]:
  """The next runs (in grid order) that finish within budget_s on `parallel` slots, and the
  slice's estimated wall time (None: nothing measured yet, the first wave measures)."""
  estimates = [estimate_s(r, results_dir, parallel) for r in pending]
  if pending and estimates[0] is None:
    return pending[:parallel], None
  slots = [0.0] * parallel
  chosen = []
  for run, est in zip(pending, estimates):
    est = (est if est is not None else max(e for e in estimates if e is not None))
    est *= _remaining_fraction(workdir, run)
    i = min(range(parallel), key=slots.__getitem__)
    if slots[i] + est > budget_s:
      break   # the grid's order is kept: the next session starts here
    slots[i] += est
    chosen.append(run)
  return chosen, (max(slots) if chosen else 0.0)


def device_name() -> str:
  """The GPU's name (nvidia-smi), else the CPU's: recorded with every run and session."""
  try:
    out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=20, check=True).stdout
    names = [line.strip() for line in out.splitlines() if line.strip()]
    if names:
      return f"{len(names)} x {names[0]}"
  except (OSError, subprocess.SubprocessError):
    pass
  return f"cpu ({os.cpu_count()} cores, {platform.machine()})"


def _check_same_grid(spec: SweepSpec, results_dir: str) -> dict:
  """The results' record; refuses results of other runs (the report settings may change)."""
  record = rundir.read_json(os.path.join(results_dir, sweep.SWEEP_FILE)) or {}
  old = {k: v for k, v in (record.get("spec") or {}).items() if k != "report"}
  new = {k: v for k, v in _as_json(spec.to_dict()).items() if k != "report"}
  if old and old != new:
    raise StudyError(f"{results_dir} holds runs of another grid ({old}); this study config "
                     f"gives {new}. Restore the config, or use another --results")
  return record


def _as_json(obj):
  """obj as it reads back from JSON (tuples become lists), for comparing with a stored spec."""
  return json.loads(json.dumps(obj, default=str))


def _now() -> str:
  return datetime.datetime.now().isoformat(timespec="seconds")


def run_study(spec: SweepSpec, results_dir: str, workdir: str, *, budget_s: float,
              parallel: int = 1, threads_per_run: int = 0, grace_s: float | None = None,
              command_fn=train_command, log=print, command: str = "") -> dict[str, str]:
  """Runs one slice of the study (see the module docstring). Returns name -> status."""
  if not budget_s > 0:
    raise StudyError(f"--budget_s must be > 0, got {budget_s}")
  if parallel < 1:
    raise StudyError(f"--parallel must be >= 1, got {parallel}")
  t0 = time.perf_counter()
  os.makedirs(results_dir, exist_ok=True)
  record = _check_same_grid(spec, results_dir)
  for left in results_lib.remove_partial(results_dir):
    log(f"removed {left}: a half-written export of a killed session")
  runs = expand(spec)
  device = device_name()
  session = {"start": _now(), "wall_s": 0.0, "budget_s": budget_s, "parallel": parallel,
             "device": device, "cpus": os.cpu_count(), "platform": platform.platform(),
             "command": command, "runs": []}
  sessions = record.get("sessions", []) + [session]

  def save_record():
    session["wall_s"] = round(time.perf_counter() - t0, 1)
    rundir.write_json(os.path.join(results_dir, sweep.SWEEP_FILE),
                      {"spec": spec.to_dict(), "runs": [r.name for r in runs],
                       "sessions": sessions})

  def export(run, run_dir, status, wall_s):
    # Earlier attempts stopped at a budget count too: the estimate is the whole run's time.
    attempts_path = os.path.join(run_dir, ATTEMPTS_FILE)
    attempts = (rundir.read_json(attempts_path) or {"wall_s": []})["wall_s"] + [wall_s]
    if status in FINISHED:
      results_lib.export_run(run_dir, results_dir, run.name, {
          "wall_s": round(sum(attempts), 1), "attempts": len(attempts), "parallel": parallel,
          "device": device, "session": session["start"]})
      session["runs"].append(run.name)
    elif os.path.isdir(run_dir):
      rundir.write_json(attempts_path, {"wall_s": attempts})
    save_record()

  save_record()   # the session counts from here, even if it is killed
  # A run that finished after the last export (a kill in between) is exported now.
  for run in runs:
    run_dir = os.path.join(workdir, run.name)
    if (not results_lib.is_finished(results_dir, run.name)
        and sweep.run_status(run_dir) in FINISHED):
      marker = rundir.read_json(os.path.join(run_dir, sweep.DONE_FILE)) or {}
      export(run, run_dir, sweep.run_status(run_dir), marker.get("wall_s") or 0.0)
  pending = [r for r in runs if not results_lib.is_finished(results_dir, r.name)]
  chosen, est = plan(pending, results_dir, workdir, budget_s, parallel)
  log(f"study: {len(runs)} runs, {len(runs) - len(pending)} finished, {len(pending)} to go; "
      f"this slice: {len(chosen)} run(s), {parallel} at a time, estimated "
      + ("unknown (the first runs measure)" if est is None else f"{est:.0f} s")
      + f" of a {budget_s:.0f} s budget, on {device}")
  status = {r.name: _status(results_dir, workdir, r.name) for r in runs}
  if chosen:
    check_runs(spec, chosen)
    index = {r.name: i for i, r in enumerate(runs)}
    grace = 0.1 * budget_s if grace_s is None else grace_s
    if parallel > 1:  # N JAX processes on one GPU: each gets its share of the memory
      os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{0.92 / parallel:.3f}")
    try:
      status.update(sweep.run_sweep(
          spec, workdir, parallel=parallel, threads_per_run=threads_per_run,
          only=[index[r.name] for r in chosen], command_fn=command_fn, log=log,
          deadline=t0 + budget_s + grace, on_finish=export))
    finally:
      save_record()
  done = sum(results_lib.is_finished(results_dir, r.name) for r in runs)
  log(f"study: {done} of {len(runs)} runs finished in {results_dir}; this session "
      f"{time.perf_counter() - t0:.0f} s")
  return status


def main(argv=None) -> None:
  from absl import app, flags
  flags.DEFINE_string("study", None, "Study config file (a sweep config with a `study` "
                      "section): configs/study_smollm2.py[:variant].")
  flags.DEFINE_float("budget_s", None, "Seconds this call may spend: runs that fit start.")
  flags.DEFINE_float("grace_s", None, "Past budget_s + grace_s the runs in flight are stopped "
                     "(checkpointed, resumed next time); default 10% of budget_s.")
  flags.DEFINE_string("results", None, "Results folder (committed: no checkpoints go there).")
  flags.DEFINE_string("workdir", None, "Run directories with checkpoints; default "
                      "$TMPDIR/infir2_study/<results folder's parent name>.")
  flags.DEFINE_integer("parallel", None, "Trainers at once (default: the config's study.parallel).")
  flags.DEFINE_string("report_dir", None, "Where README.md and the plots go (default: the "
                      "results folder's parent); '' = no report.")
  flags.DEFINE_bool("dry_run", False, "Print the plan of this slice; train nothing.")
  flags.mark_flags_as_required(["study", "budget_s", "results"])
  argv = sys.argv if argv is None else argv

  def _main(args):
    if len(args) > 1:
      raise app.UsageError(f"unexpected arguments: {args[1:]}")
    F = flags.FLAGS
    spec, settings = load_study(F.study)
    parallel = F.parallel or int(settings["parallel"])
    parent = os.path.dirname(os.path.abspath(F.results))
    workdir = F.workdir or os.path.join(tempfile.gettempdir(), "infir2_study",
                                        os.path.basename(parent))
    if F.dry_run:
      pending = [r for r in expand(spec) if not results_lib.is_finished(F.results, r.name)]
      chosen, est = plan(pending, F.results, workdir, F.budget_s, parallel)
      print(f"{len(pending)} run(s) to go; this slice: {[r.name for r in chosen]}, "
            f"estimated {'unknown' if est is None else f'{est:.0f} s'}")
      return
    command = shlex.join(["python", "-m", "infir2_jax.ablation.study", *argv[1:]])
    status = run_study(spec, F.results, workdir, budget_s=F.budget_s, parallel=parallel,
                       threads_per_run=int(settings["threads_per_run"]), grace_s=F.grace_s,
                       command=command)
    report_dir = parent if F.report_dir is None else F.report_dir
    if report_dir:
      print(f"wrote {study_report.build(F.results, report_dir, study=F.study)}")
    failed = sorted(n for n, st in status.items() if st == "failed")
    if failed:   # crashed (not diverged, not stopped at the budget): their train.log says why
      sys.exit(f"study: run(s) failed: {failed}; see {workdir}/<run>/train.log; the next call "
               "retries them")

  app.run(_main, argv=argv)


if __name__ == "__main__":
  main()
