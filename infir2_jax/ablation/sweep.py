"""Sweeps: a grid of training runs (recipe x seed x any config key), run locally or on SLURM.

  python -m infir2_jax.ablation.sweep --config=configs/sweeps/default.py --workdir=runs/sweep
  python -m infir2_jax.ablation.sweep ... --parallel=2       # two local training processes
  python -m infir2_jax.ablation.sweep ... --print_commands   # one train command per run (and
                                                             # the runs' sweep metadata)
  python -m infir2_jax.ablation.sweep ... --print_commands --slurm > sweep.sbatch  # SLURM array
  python -m infir2_jax.ablation.report runs/sweep            # the statistics and plots

The grid (what a sweep config file declares, and each run's command): ablation/grid.py.
Each run is `python -m infir2_jax.train` in WORKDIR/<run name>/. A run that finished gets a
DONE file (its final metrics) and is skipped next time; a run that died is started again
with the same command, and the trainer resumes it from its checkpoints. A run that stopped
on a non-finite loss gets a FAILED file with diverged=true and is not retried (the same
seed would diverge again) unless --retry_failed.
"""

import dataclasses
import datetime
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time

from infir2_jax.ablation.grid import (
    Run, SweepSpec, check_runs, expand, resolve_base, spec_from_config, train_command)
from infir2_jax.train import rundir

# A sweep's directory: the trainer's run directories (train/rundir.py) and these markers.
SWEEP_FILE = "sweep.json"      # WORKDIR/sweep.json: the spec, the runs, each session's wall time
RUN_FILE = "sweep_run.json"    # WORKDIR/<run>/sweep_run.json: the run's axes and overrides
DONE_FILE = "DONE"             # WORKDIR/<run>/DONE: final metrics of a finished run
FAILED_FILE = "FAILED"         # WORKDIR/<run>/FAILED: exit status and log tail of a failed run
LOG_FILE = "train.log"         # WORKDIR/<run>/train.log: the run's stdout and stderr
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_status(run_dir: str) -> str:
  """"done" | "diverged" | "failed" | "partial" (started, not finished) | "new".

  A run without markers (trained from --print_commands) is done when its metrics reach the
  step count of its config.json.
  """
  if os.path.exists(os.path.join(run_dir, DONE_FILE)):
    return "done"
  failed = rundir.read_json(os.path.join(run_dir, FAILED_FILE))
  if failed is not None:
    return "diverged" if failed.get("diverged") else "failed"
  if not os.path.exists(run_dir):
    return "new"
  steps = (rundir.config_dict(run_dir) or {}).get("steps")
  last = rundir.final_metrics(run_dir).get("step")
  return "done" if steps is not None and last == steps else "partial"


def _prepare_run_dir(run: Run, workdir: str) -> str:
  """Creates WORKDIR/<run>/ with its sweep_run.json; refuses a directory of another run."""
  run_dir = os.path.join(workdir, run.name)
  os.makedirs(run_dir, exist_ok=True)
  path = os.path.join(run_dir, RUN_FILE)
  record = {"name": run.name, "axes": dict(run.axes), "overrides": dict(run.overrides)}
  old = rundir.read_json(path)
  if old is not None and json.loads(json.dumps(old["overrides"])) != json.loads(
      json.dumps(record["overrides"])):
    raise ValueError(f"{run_dir} was trained with other overrides ({old['overrides']}) than "
                     f"this sweep gives it ({record['overrides']}); use another --workdir")
  rundir.write_json(path, record)
  return run_dir


def _finish(run: Run, run_dir: str, rc: int, wall_s: float, log_offset: int = 0) -> str:
  """Writes DONE or FAILED for a run whose process exited with `rc`; returns its status.

  log_offset: where this process's output starts in the run's log (earlier attempts precede).
  """
  for name in (DONE_FILE, FAILED_FILE):
    if os.path.exists(os.path.join(run_dir, name)):
      os.remove(os.path.join(run_dir, name))
  final = rundir.final_metrics(run_dir)
  if rc == 0:
    rundir.write_json(os.path.join(run_dir, DONE_FILE), {"name": run.name, "final": final,
                                                  "wall_s": wall_s, "finished": _now()})
    return "done"
  tail = ""
  if os.path.exists(os.path.join(run_dir, LOG_FILE)):
    with open(os.path.join(run_dir, LOG_FILE), errors="replace") as f:
      f.seek(log_offset)
      tail = f.read()[-4000:]
  diverged = "NonFiniteLossError" in tail
  rundir.write_json(os.path.join(run_dir, FAILED_FILE), {
      "name": run.name, "returncode": rc, "diverged": diverged, "final": final,
      "wall_s": wall_s, "log_tail": tail[-1500:], "finished": _now()})
  return "diverged" if diverged else "failed"


def _now() -> str:
  return datetime.datetime.now().isoformat(timespec="seconds")


def _child_env(threads: int, workdir: str) -> dict[str, str]:
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  # One XLA compilation cache per sweep: the seeds of a recipe compile once, and the sweep's
  # wall time does not depend on what ran on this machine before.
  env.setdefault("INFIR2_COMPILATION_CACHE",
                 os.path.join(os.path.abspath(workdir), ".jax_cache"))
  env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
  if threads > 0:  # several runs on a few cores: one XLA thread pool each, no oversubscription
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false "
                        f"intra_op_parallelism_threads={threads}").strip()
  return env


def pending_runs(runs: list[Run], workdir: str, retry_failed: bool = False) -> list[Run]:
  skip = {"done"} | (set() if retry_failed else {"diverged"})
  return [r for r in runs if run_status(os.path.join(workdir, r.name)) not in skip]


def run_sweep(spec: SweepSpec, workdir: str, *, parallel: int = 1, threads_per_run: int = 0,
              retry_failed: bool = False, only: list[int] | None = None,
              command_fn=train_command, log=print, deadline: float | None = None,
              on_finish=None) -> dict[str, str]:
  """Runs the sweep's unfinished runs, `parallel` processes at a time. Returns name -> status.

  Args:
    only: indices into expand(spec) to consider (the SLURM array task), None = all.
    command_fn: (spec, run, workdir, python) -> argv; tests replace the trainer with a stub.
    deadline: time.perf_counter() value past which no run starts and the running ones get
      SIGTERM (the trainer saves a checkpoint and stops); they stay "partial", to resume.
    on_finish: called as on_finish(run, run_dir, status, wall_s) when a run's process ends
      (also when stopped at the deadline: status "partial").
  """
  if parallel < 1:
    raise ValueError(f"--parallel must be >= 1, got {parallel}")
  runs = expand(spec)
  if only is not None:
    bad = [i for i in only if not 0 <= i < len(runs)]
    if bad:
      raise ValueError(f"run index {bad} out of range: the sweep has {len(runs)} runs")
    runs = [runs[i] for i in only]
  os.makedirs(workdir, exist_ok=True)
  todo = pending_runs(runs, workdir, retry_failed)
  status = {r.name: run_status(os.path.join(workdir, r.name)) for r in runs}
  log(f"sweep: {len(runs)} runs, {len(runs) - len(todo)} finished, {len(todo)} to run, "
      f"{parallel} at a time, in {workdir}")
  start, wall0 = _now(), time.perf_counter()
  env = _child_env(threads_per_run, workdir)
  runnable = dataclasses.replace(spec, base=resolve_base(spec.base))  # from any directory
  active: dict[str, tuple] = {}  # name -> (run, dir, process, start, log file, log offset)
  queue = list(todo)
  stopping = False

  def reap(block: bool):
    nonlocal stopping
    while active:
      if deadline is not None and not stopping and time.perf_counter() > deadline:
        stopping = True
        queue.clear()
        for _, _, proc, _, _, _ in active.values():
          proc.terminate()
      for name, (run, run_dir, proc, t0, logf, offset) in list(active.items()):
        if proc.poll() is None:
          continue
        logf.close()
        del active[name]
        if stopping and proc.returncode != 0:  # stopped at the deadline: no marker; resumes
          status[name] = run_status(run_dir)
          log(f"{name}: stopped at the time budget ({status[name]})")
          if on_finish is not None:
            on_finish(run, run_dir, status[name], time.perf_counter() - t0)
          return
        status[name] = _finish(run, run_dir, proc.returncode, time.perf_counter() - t0, offset)
        if on_finish is not None:
          on_finish(run, run_dir, status[name], time.perf_counter() - t0)
        final = rundir.final_metrics(run_dir)
        done = sum(s in ("done", "diverged") for s in status.values())
        log(f"[{done}/{len(runs)}] {name}: {status[name]} in {time.perf_counter() - t0:.0f} s"
            + (f", loss {final['loss']:.4f}" if "loss" in final else "")
            + (f", eval_loss {final['eval_loss']:.4f}" if "eval_loss" in final else ""))
        return
      if not block:
        return
      time.sleep(0.5)

  previous = signal.signal(signal.SIGTERM, _raise_interrupt)
  try:
    while queue or active:
      if deadline is not None and time.perf_counter() > deadline:
        queue.clear()
      while queue and len(active) < parallel:
        run = queue.pop(0)
        run_dir = _prepare_run_dir(run, workdir)
        argv = command_fn(runnable, run, workdir, sys.executable)
        logf = open(os.path.join(run_dir, LOG_FILE), "a")
        logf.write(f"\n# {_now()} {shlex.join(argv)}\n")
        logf.flush()
        proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, env=env)
        active[run.name] = (run, run_dir, proc, time.perf_counter(), logf, logf.tell())
        log(f"started {run.name} (pid {proc.pid})")
      reap(block=True)
  except KeyboardInterrupt:
    for _, _, proc, _, _, _ in active.values():  # our own children only; checkpoints stay
      proc.terminate()
    for _, _, proc, _, logf, _ in active.values():
      proc.wait()
      logf.close()
    log("sweep interrupted: re-run the same command to resume")
    raise
  finally:
    signal.signal(signal.SIGTERM, previous)
    _record_session(spec, workdir, start, time.perf_counter() - wall0, parallel,
                    [r.name for r in todo])
  return status


def _raise_interrupt(signum, frame):
  raise KeyboardInterrupt(f"signal {signum}")


def prepare(spec: SweepSpec, workdir: str) -> list[Run]:
  """Writes WORKDIR/sweep.json and each run's sweep_run.json (for --print_commands)."""
  runs = expand(spec)
  for run in runs:
    _prepare_run_dir(run, workdir)
  _record_session(spec, workdir, _now(), 0.0, 0, [])
  return runs


def _record_session(spec, workdir, start, wall_s, parallel, ran):
  path = os.path.join(workdir, SWEEP_FILE)
  record = rundir.read_json(path) or {}
  sessions = record.get("sessions", [])
  if ran:
    argv = sys.argv
    command = (shlex.join(["python", "-m", "infir2_jax.ablation.sweep", *argv[1:]])
               if argv and argv[0].endswith("sweep.py") else shlex.join(argv))
    sessions.append({"start": start, "wall_s": round(wall_s, 1), "parallel": parallel,
                     "runs": ran, "cpus": os.cpu_count(), "platform": platform.platform(),
                     "command": command})
  rundir.write_json(path, {"spec": spec.to_dict(), "runs": [r.name for r in expand(spec)],
                    "sessions": sessions})


def slurm_script(spec_path: str, workdir: str, num_runs: int, sbatch: list[str],
                 python: str = ".venv/bin/python", config_args: list[str] = ()) -> str:
  """A SLURM array job: task i runs (or resumes) run i of the sweep and marks it DONE."""
  lines = ["#!/bin/bash",
           f"# {num_runs} runs of the sweep {spec_path}; submit with: sbatch THIS_FILE",
           "#SBATCH --job-name=infir2-sweep", f"#SBATCH --array=0-{num_runs - 1}",
           "#SBATCH --output=%x-%A_%a.out"]
  lines += [f"#SBATCH {arg}" for arg in sbatch]
  lines += ["set -euo pipefail", 'cd "${SLURM_SUBMIT_DIR:-.}"',
            shlex.join([python, "-m", "infir2_jax.ablation.sweep", f"--config={spec_path}",
                        *config_args, f"--workdir={workdir}"])
            + " --run_index=$SLURM_ARRAY_TASK_ID", ""]
  return "\n".join(lines)


def main(argv=None) -> None:
  from absl import app, flags
  from ml_collections import config_flags
  argv = sys.argv if argv is None else argv
  config_flag = config_flags.DEFINE_config_file(
      "config", None, "Sweep config file: configs/sweeps/NAME.py[:variant]; override its "
      "keys with --config.grid.seed='(0, 1)', --config.overrides.steps=50, ...",
      lock_config=False, sys_argv=argv)
  flags.DEFINE_string("workdir", None, "Sweep directory: one sub-directory per run.")
  flags.DEFINE_integer("parallel", 1, "Runs trained at the same time (local processes).")
  flags.DEFINE_integer("threads_per_run", 0, "XLA:CPU threads per run (0 = XLA's default).")
  flags.DEFINE_bool("print_commands", False, "Print one train command per run; train nothing "
                    "(writes the sweep's metadata into --workdir for the report).")
  flags.DEFINE_bool("slurm", False, "With --print_commands: print a SLURM array script.")
  flags.DEFINE_list("sbatch", ["--gpus-per-task=1", "--cpus-per-task=16", "--time=08:00:00"],
                    "Extra #SBATCH lines of the --slurm script.")
  flags.DEFINE_integer("run_index", None, "Run only run #i of the grid (a SLURM array task).")
  flags.DEFINE_bool("retry_failed", False, "Also re-run runs that diverged (non-finite loss).")
  flags.mark_flags_as_required(["config", "workdir"])
  FLAGS = flags.FLAGS
  config_args = [a for a in argv[1:] if a.startswith("--config.")]

  def _main(args):
    if len(args) > 1:
      raise app.UsageError(f"unexpected arguments: {args[1:]}")
    spec = spec_from_config(config_flag.value)
    spec_path = config_flags.get_config_filename(FLAGS["config"])
    runs = expand(spec)
    if FLAGS.print_commands:
      prepare(spec, FLAGS.workdir)  # so the report knows each run's axes
      if FLAGS.slurm:
        print(slurm_script(spec_path, FLAGS.workdir, len(runs), FLAGS.sbatch,
                           config_args=config_args), end="")
      else:
        for run in runs:
          print(shlex.join(train_command(spec, run, FLAGS.workdir)))
      return
    check_runs(spec, runs)
    status = run_sweep(spec, FLAGS.workdir, parallel=FLAGS.parallel,
                       threads_per_run=FLAGS.threads_per_run, retry_failed=FLAGS.retry_failed,
                       only=None if FLAGS.run_index is None else [FLAGS.run_index])
    diverged = sorted(n for n, s in status.items() if s == "diverged")
    if diverged:  # a result, not an error: the report lists them
      print(f"sweep: {len(diverged)} run(s) diverged (non-finite loss): {diverged}")
    bad = {n: s for n, s in status.items() if s not in ("done", "diverged")}
    if bad:
      sys.exit(f"sweep: runs not finished: {bad}; re-run the same command to resume")
    print(f"sweep: finished; report: python -m infir2_jax.ablation.report {FLAGS.workdir}")

  app.run(_main, argv=argv)


if __name__ == "__main__":
  main()
