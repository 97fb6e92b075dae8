"""Fault injection against your own training setup: SIGKILLs at random moments, damaged
checkpoints; reports whether the run came out as if nothing had happened.

  python scripts/fault_injection.py [--families=all|cheap|kills,signals,damage,config,...]
      [--quick] [--kills=10] [--signals=5] [--seed=0] [--during_save=0.3]
      [--during_eval=0.2] [--damage=all|none|flip_byte,random_4k,...] [--jobs=2]
      [--workdir=/tmp/fault_injection] [--out=fault_injection.json] [--reuse_reference]
      [--rounds=1]
      [trainer flags: --config=... --config.a.b=v ...]

1. The reference: the trainer (`python -m infir2_jax.train` with your flags) runs once,
   uninterrupted.
2. Kills: the same command is started again and again in a second run directory and killed
   with SIGKILL `--kills` times, at a random moment of the remaining training (or, with
   probability --during_save, while a checkpoint is being written), then run to the end.
   Per kill: the last step logged, whether a checkpoint write was in flight, the step the
   next start resumed from, the steps lost, and the trainer's child processes (grain
   workers) still alive 10 s after the kill.
3. Damage: for each kind, a copy of the reference run has its newest checkpoint damaged and
   the command is run again; it must fall back to the previous checkpoint and train to the
   same end.
4. Signals: as 2, with SIGTERM and then SIGINT (`--signals` each): the trainer must save at
   the next step and exit 143 / 130; the run must still end as the reference.
5. The families of scripts/fault_families.py (nonsense configs, damaged files, broken
   data, exports and imports, configs changed on resume, diverging numerics, full disks,
   concurrent trainers/exports/evaluations): each fault is one start whose outcome is put
   in a class (ok, data lost, corrupt state used, silently wrong, hang, leak, unclear
   error); `--families=cheap` runs the ones that need no training.
They run in the order reference, damage, families, then the kill and signal rounds
(`--rounds`, the longest part); OUT.partial.json holds what has run until OUT is written.
Each faulted run is compared with the reference: every train and eval loss, and the final
checkpoint (every array of the state, and the data iterator's position), bit for bit; and
TensorBoard: each step's loss scalar present (purge semantics) and no torn event file.
The JSON report goes to --out; a table is printed. Exit status 1 when anything differed.

Bit-identical resumes need a deterministic backend (CPU; on GPUs XLA's reductions may not
be). The trainer's flags must not include --workdir (the script sets it).
"""

import argparse
import datetime
import glob
import json
import os
import platform
import random
import shutil
import signal
import struct
import subprocess
import sys
import time

import numpy as np
import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from infir2_jax.train import checkpoint as checkpoint_lib  # noqa: E402
from infir2_jax.train import rundir  # noqa: E402
from infir2_jax.train import preemption  # noqa: E402
import fault_families  # noqa: E402  (scripts/ is sys.path[0])

DAMAGE_KINDS = ("flip_byte", "random_4k", "truncate", "data_position", "state_metadata",
                "delete_data_item", "empty_newer_step", "delete_checksums", "flip_unverified",
                "truncate_checksums", "delete_step_metadata", "zero_state_file",
                "data_item_garbage", "foreign_checkpoint")
# Damage the trainer must report (or refuse), not only fall back from: a foreign checkpoint
# restores fine, so only a check of its identity sees it.
REPORTED = fault_families.REPORTED


# Running the trainer.

def _command(trainer_args, workdir):
  return [sys.executable, "-m", "infir2_jax.train", *trainer_args, f"--workdir={workdir}"]


def _start(trainer_args, workdir, log):
  return subprocess.Popen(_command(trainer_args, workdir), cwd=ROOT, stdout=log,
                          stderr=subprocess.STDOUT)


def run_to_end(trainer_args, workdir, timeout):
  """Runs the trainer to its end; returns (seconds, seconds until its first new step)."""
  before = len(_train_records(workdir))
  t0 = time.monotonic()
  first = None
  with open(os.path.join(os.path.dirname(workdir), os.path.basename(workdir) + ".log"),
            "ab") as log:
    proc = _start(trainer_args, workdir, log)
    while proc.poll() is None:
      if first is None and len(_train_records(workdir)) > before:
        first = time.monotonic() - t0
      if time.monotonic() - t0 > timeout:
        proc.kill()
        raise TimeoutError(f"the trainer ran longer than {timeout} s in {workdir}")
      time.sleep(0.05)
  seconds = time.monotonic() - t0
  if proc.returncode:
    raise RuntimeError(f"the trainer failed ({proc.returncode}) in {workdir}; see {log.name}")
  return seconds, seconds if first is None else first


def _output(workdir):
  with open(os.path.join(os.path.dirname(workdir), os.path.basename(workdir) + ".log"),
            errors="replace") as f:
    return f.read()


def _train_records(workdir):
  path = os.path.join(workdir, rundir.METRICS_FILE)
  if not os.path.exists(path):
    return []
  out = []
  with open(path) as f:
    for line in f:
      try:
        record = json.loads(line)
      except json.JSONDecodeError:
        continue
      if "loss" in record:
        out.append(record["step"])
  return out


def _writing_checkpoint(workdir):
  return bool(glob.glob(os.path.join(rundir.checkpoints_dir(workdir),
                                     "*" + rundir.ORBAX_TMP_MARK + "*")))


def _descendants(pid):
  try:
    return psutil.Process(pid).children(recursive=True)
  except psutil.NoSuchProcess:
    return []


def one_kill(trainer_args, workdir, rng, step_time, total_steps, during_save, kills_left,
             log, signum=signal.SIGKILL, during_eval=0.0, eval_every=0):
  """Starts the trainer, sends it `signum` at a random moment (or while a checkpoint is
  written, or right after an eval step's train row: during its evaluation); returns what
  happened. SIGTERM and SIGINT must end it (exit 143 / 130) after a checkpoint.

  The moment is uniform in the next 2 / (kills_left + 1) of the remaining training, so the
  kills spread over the whole run rather than bunching up at its end.
  """
  logged_before = len(_train_records(workdir))
  log_start = os.lseek(log.fileno(), 0, os.SEEK_CUR)   # the child appends from here
  proc = _start(trainer_args, workdir, log)
  t0 = time.monotonic()
  resumed = None
  while resumed is None:  # the first step this start logs tells where it resumed
    if proc.poll() is not None:
      return {"finished_before_kill": True, "returncode": proc.returncode}
    records = _train_records(workdir)
    if len(records) > logged_before:
      resumed = records[logged_before] - 1
    time.sleep(0.02)
  aim = rng.random()
  aim_save = aim < during_save
  aim_eval = not aim_save and eval_every and aim < during_save + during_eval
  if aim_eval:   # the eval of step N runs right after step N's train row is logged
    target = (max(_train_records(workdir)) // eval_every + 1) * eval_every
    while proc.poll() is None and max(_train_records(workdir)) < min(target, total_steps):
      time.sleep(0.005)
  elif aim_save:
    deadline = time.monotonic() + (total_steps - resumed) * step_time * 2
    while not _writing_checkpoint(workdir) and proc.poll() is None:
      if time.monotonic() > deadline:
        break
      time.sleep(0.002)
  else:
    remaining = max(total_steps - max(_train_records(workdir)), 0) * step_time
    end = time.monotonic() + rng.uniform(0, 2 * remaining / (kills_left + 1))
    while time.monotonic() < end and proc.poll() is None:
      time.sleep(0.01)
  children = _descendants(proc.pid)
  during_write = _writing_checkpoint(workdir)
  if proc.poll() is not None:
    return {"finished_before_kill": True, "resumed_from": resumed}
  proc.send_signal(signum)
  try:
    returncode = proc.wait(timeout=None if signum == signal.SIGKILL else 600)
  except subprocess.TimeoutExpired:
    proc.kill()
    returncode = "hang"
  with open(log.name, "rb") as f:  # this start's output: did it say the run had ended?
    f.seek(log_start)
    said_ended = preemption.AFTER_LAST_STEP in f.read().decode(errors="replace")
  at = time.monotonic() - t0
  records = _train_records(workdir)
  _, leaked = psutil.wait_procs(children, timeout=10)
  for c in leaked:  # do not leave them behind on this machine either
    c.kill()
  return {"seconds_after_start": round(at, 2), "resumed_from": resumed,
          "signal": signal.Signals(signum).name, "returncode": returncode,
          "aimed_at_eval": bool(aim_eval),
          "last_step_logged": max(records) if records else 0, "aimed_at_save": aim_save,
          "during_checkpoint_write": during_write,
          "committed_checkpoints": rundir.checkpoint_steps(workdir),
          "leaked_processes": len(leaked), "said_run_ended": said_ended}


# Damage.

def _biggest(directory):
  files = [os.path.join(r, f) for r, _, fs in os.walk(directory) for f in fs]
  return max(files, key=os.path.getsize)


def damage(workdir, kind, rng):
  """Damages the newest checkpoint of `workdir` in one way; returns a description."""
  step = rundir.checkpoint_steps(workdir)[-1]
  step_dir = rundir.step_dir(workdir, step)
  state = os.path.join(step_dir, rundir.STATE_ITEM)
  if kind in ("flip_byte", "random_4k", "truncate"):
    path = _biggest(state)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
      if kind == "truncate":
        f.truncate(size // 2)
      else:
        offset = rng.randrange(max(size - 4096, 1))
        f.seek(offset)
        if kind == "flip_byte":
          byte = f.read(1)[0]
          f.seek(offset)
          f.write(bytes([byte ^ 0x01]))
        else:
          f.write(os.urandom(4096))
    return f"{kind} in {os.path.relpath(path, workdir)}"
  if kind == "data_position":
    (path,) = glob.glob(os.path.join(step_dir, rundir.DATA_ITEM, "*.json"))
    text = open(path).read()
    state_ = json.loads(text)
    state_["next_index"] = max(int(state_["next_index"]) - 3, 0)
    with open(path, "w") as f:
      f.write(json.dumps(state_, indent=4))
    return f"data iterator moved to {state_['next_index']}"
  if kind == "state_metadata":
    with open(os.path.join(state, "_METADATA"), "wb") as f:
      f.write(os.urandom(64))
    return "state/_METADATA replaced by random bytes"
  if kind == "delete_data_item":
    shutil.rmtree(os.path.join(step_dir, rundir.DATA_ITEM))
    return "data item deleted"
  if kind == "empty_newer_step":
    os.makedirs(rundir.step_dir(workdir, step + 1000))
    return f"empty folder checkpoints/{step + 1000}"
  manifest = os.path.join(step_dir, "checksums.json")
  if kind in ("delete_checksums", "flip_unverified"):
    os.remove(manifest)
    if kind == "flip_unverified":   # then nothing but the restore itself can see the flip
      damage(workdir, "flip_byte", rng)
    return "checksums.json deleted" + (", then a byte flipped" if kind != "delete_checksums"
                                       else "")
  if kind == "truncate_checksums":
    with open(manifest, "r+b") as f:
      f.truncate(os.path.getsize(manifest) // 2)
    return "checksums.json cut to half"
  if kind == "delete_step_metadata":
    os.remove(os.path.join(step_dir, rundir.ORBAX_STEP_METADATA))
    return f"{rundir.ORBAX_STEP_METADATA} deleted"
  if kind == "zero_state_file":
    path = _biggest(state)
    with open(path, "r+b") as f:
      f.write(bytes(os.path.getsize(path)))
    return f"{os.path.relpath(path, workdir)} overwritten with zeros"
  if kind == "data_item_garbage":
    (path,) = glob.glob(os.path.join(step_dir, rundir.DATA_ITEM, "*.json"))
    with open(path, "w") as f:
      f.write("{not json")
    return "data iterator state replaced by invalid JSON"
  raise ValueError(f"unknown damage {kind!r}; valid: {DAMAGE_KINDS}")


def foreign_checkpoint(args, trainer_args, workdir):
  """Replaces the newest checkpoint of `workdir` by the same step of another run (another
  seed, same shapes): it restores fine; only the run's identity tells it apart."""
  step = rundir.checkpoint_steps(workdir)[-1]
  other = os.path.join(args.workdir, "foreign")
  if rundir.checkpoint_steps(other)[-1:] != [step]:
    shutil.rmtree(other, ignore_errors=True)
    run_to_end([*trainer_args, "--config.seed=1", f"--config.steps={step}"], other,
               args.timeout)
  shutil.rmtree(rundir.step_dir(workdir, step))
  shutil.copytree(rundir.step_dir(other, step), rundir.step_dir(workdir, step))
  return f"checkpoint {step} replaced by checkpoint {step} of a run with seed 1"


# Comparing with the reference.

def _metrics(workdir):
  train, evals = {}, {}
  for r in rundir.read_metrics(workdir):
    if "loss" in r:
      train[r["step"]] = r["loss"]
    elif "eval_loss" in r:
      evals[r["step"]] = r["eval_loss"]
  return train, evals


def _final_state(workdir):
  path, step = rundir.checkpoint_item(workdir)
  state = checkpoint_lib.read_state(path)
  data = sorted(glob.glob(os.path.join(os.path.dirname(path), rundir.DATA_ITEM, "*.json")))
  return step, state, [json.load(open(p)) for p in data]


def _states_equal(a, b):
  import jax  # pylint: disable=g-import-not-at-top
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  return (jax.tree.structure(a) == jax.tree.structure(b)
          and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb)))


def _event_records(path):
  from tensorboardX.record_writer import masked_crc32c  # pylint: disable=g-import-not-at-top
  data, pos, out = open(path, "rb").read(), 0, []
  while pos < len(data):
    if len(data) - pos < 12:
      return out, True
    header = data[pos:pos + 8]
    (length,) = struct.unpack("<Q", header)
    if struct.unpack("<I", data[pos + 8:pos + 12])[0] != masked_crc32c(header):
      return out, True
    if pos + 16 + length > len(data):
      return out, True
    out.append(data[pos + 12:pos + 12 + length])
    pos += 16 + length
  return out, False


def tensorboard_losses(workdir):
  """({step: loss} as TensorBoard shows it (a session START at step S hides the earlier
  events with step >= S), number of torn event files)."""
  from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top
  tb = os.path.join(workdir, rundir.TENSORBOARD_DIR)
  losses, torn = {}, 0
  for name in sorted(os.listdir(tb)) if os.path.isdir(tb) else []:
    records, cut = _event_records(os.path.join(tb, name))
    torn += cut
    for payload in records:
      event = event_pb2.Event.FromString(payload)
      if event.HasField("session_log") and event.session_log.status == 1:
        losses = {s: v for s, v in losses.items() if s < event.step}
      for value in event.summary.value:
        if value.tag == "loss":
          losses[event.step] = value.simple_value
  return losses, torn


def compare(reference, workdir):
  """What of `workdir` equals the reference run, bit for bit."""
  ref_train, ref_eval = _metrics(reference)
  got_train, got_eval = _metrics(workdir)
  ref_step, ref_state, ref_data = _final_state(reference)
  step, state, data = _final_state(workdir)
  tb, torn = tensorboard_losses(workdir)
  tb_ok = sorted(tb) == sorted(got_train) and all(
      tb[s] == np.float32(got_train[s]) for s in tb)
  return {"losses_equal": got_train == ref_train, "evals_equal": got_eval == ref_eval,
          "final_step": step, "final_state_equal": step == ref_step
          and _states_equal(state, ref_state) and data == ref_data,
          "tensorboard_missing_steps": len(set(got_train) - set(tb)),
          "tensorboard_matches_metrics": tb_ok, "tensorboard_torn_files": torn}


# The experiment.

def _commit():
  try:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                          capture_output=True).stdout.strip()
  except OSError:
    return ""


def _eval_every(trainer_args):
  flags = [a.split("=", 1)[1] for a in trainer_args if a.startswith("--config.eval.every_steps=")]
  return int(flags[-1]) if flags else 50


def kills_experiment(args, trainer_args, reference, steps, step_time, signum=signal.SIGKILL,
                     count=None, round_index=0):
  """`count` signals to one run, each at a new start (one_kill), then the run to its end.
  Round r > 0 (--rounds) is another run directory with its own random moments."""
  count = args.kills if count is None else count
  name = "killed" if signum == signal.SIGKILL else signal.Signals(signum).name.lower()
  name += f"_r{round_index + 1}" if round_index else ""
  workdir = os.path.join(args.workdir, name)
  shutil.rmtree(workdir, ignore_errors=True)
  rng = random.Random(args.seed + signum + 1000 * round_index)
  kills = []
  with open(workdir + ".log", "wb") as log:
    for i in range(count):
      kill = one_kill(trainer_args, workdir, rng, step_time, steps, args.during_save,
                      count - i, log, signum, args.during_eval, _eval_every(trainer_args))
      kills.append(kill)
      print(f"{name} {i + 1}/{count}: {kill}", flush=True)
      if kill.get("finished_before_kill"):
        break
  before = len(_train_records(workdir))
  run_to_end(trainer_args, workdir, args.timeout)
  records = _train_records(workdir)
  last_resumed = records[before] - 1 if len(records) > before else steps
  next_resumed = [k.get("resumed_from", steps) for k in kills[1:]] + [last_resumed]
  for kill, resumed in zip(kills, next_resumed):
    if "last_step_logged" in kill:
      kill["next_start_resumed_from"] = resumed
      kill["steps_lost"] = kill["last_step_logged"] - resumed
  killed = [k for k in kills if "last_step_logged" in k]
  summary = {"kills": len(killed),
             "resumed_from_a_checkpoint": sum(k["next_start_resumed_from"] > 0 for k in killed),
             "kills_during_checkpoint_write": sum(k["during_checkpoint_write"] for k in killed),
             "steps_lost": sum(k["steps_lost"] for k in killed),
             "leaked_processes": sum(k["leaked_processes"] for k in killed),
             **compare(reference, workdir)}
  return {"kills": kills, "summary": summary, "faults": _kill_faults(signum, kills, summary)}


def _kill_faults(signum, kills, summary):
  """One fault per kill: the run as a whole must end as the reference; SIGTERM / SIGINT
  must end the trainer by themselves, with 143 / 130."""
  equal = summary["final_state_equal"] and summary["losses_equal"] and summary["evals_equal"]
  family = f"{signal.Signals(signum).name} at random points, checkpoint writes, evals"
  faults = []
  for k in kills:
    if "last_step_logged" not in k:
      continue
    where = ("checkpoint write" if k["during_checkpoint_write"] else
             "evaluation" if k.get("aimed_at_eval") else "random point")
    outcome = ("hang" if k["returncode"] == "hang" else "leak" if k["leaked_processes"]
               else "silently wrong" if not equal else "ok")
    # A stop signal ends the trainer with 128 + signum, or, when it came as the last step
    # ended, with 0 and a line that says the run is complete (preemption.after_last_step).
    finished = k["returncode"] == 0 and k.get("said_run_ended")
    if signum != signal.SIGKILL and outcome == "ok" and not (
        k["returncode"] == 128 + signum or finished):
      outcome = "unclear error"
    faults.append(fault_families.fault(family, f"during a {where}", f"step {k['last_step_logged']}",
                                       outcome, f"exit {k['returncode']}, resumed from "
                                       f"{k['next_start_resumed_from']}, lost {k['steps_lost']}"))
  return faults


def damage_experiment(args, trainer_args, reference, kinds):
  rng = random.Random(args.seed + 1)
  results = []
  for kind in kinds:
    workdir = os.path.join(args.workdir, f"damage_{kind}")
    shutil.rmtree(workdir, ignore_errors=True)
    shutil.copytree(reference, workdir)
    damaged_step = rundir.checkpoint_steps(workdir)[-1]
    what = (foreign_checkpoint(args, trainer_args, workdir) if kind == "foreign_checkpoint"
            else damage(workdir, kind, rng))
    failed = None
    try:
      run_to_end(trainer_args, workdir, args.timeout)
    except (RuntimeError, TimeoutError) as e:
      failed = str(e)
    output = _output(workdir)
    lines = [l for l in output.splitlines() if "does not restore" in l or REPORTED.search(l)
             or l.startswith("error: ")]
    result = {"kind": kind, "damage": what, "damaged_step": damaged_step,
              "reported": lines, "failed": failed,
              "moved_aside": sorted(os.listdir(rundir.damaged_dir(workdir)))
              if os.path.isdir(rundir.damaged_dir(workdir)) else []}
    if failed is None:
      result.update(compare(reference, workdir))
    result["outcome"] = _damage_outcome(kind, result)
    results.append(result)
    print(f"damage {kind}: {result}", flush=True)
  return results


def _damage_outcome(kind, r):
  """ok: fell back and ended as the reference, or refused with a clear error line."""
  if r["failed"]:
    if "longer than" in r["failed"]:
      return "hang"
    return "ok" if any(l.startswith("error: ") for l in r["reported"]) else "unclear error"
  equal = r["final_state_equal"] and r["losses_equal"] and r["evals_equal"]
  if kind == "foreign_checkpoint" and not any(REPORTED.search(l) for l in r["reported"]):
    return "corrupt state used" if not equal else "silently wrong"
  return "ok" if equal else "corrupt state used"


def _round_keys(report, first):
  """The report keys of an experiment's rounds: first, first_r2, first_r3, ..."""
  return [k for k in report if k == first or k.startswith(first + "_r")]


def _table(report):
  rows = ["| fault | runs | resumed | steps lost | final state = reference | losses = "
          "reference | TensorBoard complete, torn files |", "| --- | ---: | --- | ---: | --- | "
          "--- | --- |"]
  for key in _round_keys(report, "kills"):
    s = report[key]["summary"]
    rows.append(f"| SIGKILL at random moments ({s['kills_during_checkpoint_write']} during a "
                f"checkpoint write) | {s['kills']} | {s['resumed_from_a_checkpoint']} from a "
                f"checkpoint, the others from scratch | {s['steps_lost']} | "
                f"{s['final_state_equal']} | {s['losses_equal'] and s['evals_equal']} | "
                f"{s['tensorboard_missing_steps'] == 0}, {s['tensorboard_torn_files']} |")
  for d in report.get("damage", []):
    if d["failed"]:
      rows.append(f"| {d['damage']} (checkpoint {d['damaged_step']}) | 1 | failed: "
                  f"{d['outcome']} | - | - | - | - |")
      continue
    moved = ", ".join(d["moved_aside"]) or "-"
    rows.append(f"| {d['damage']} (checkpoint {d['damaged_step']}) | 1 | moved aside: {moved} "
                f"| - | {d['final_state_equal']} | {d['losses_equal'] and d['evals_equal']} | "
                f"{d['tensorboard_missing_steps'] == 0}, {d['tensorboard_torn_files']} |")
  return "\n".join(rows)


EXPERIMENTS = ("kills", "signals", "damage")   # need the reference run
ALL_FAMILIES = EXPERIMENTS + tuple(fault_families.FAMILIES)


def _selected(text):
  names = {"all": ALL_FAMILIES, "cheap": fault_families.CHEAP}.get(text)
  names = list(names) if names else [n for n in text.split(",") if n]
  unknown = [n for n in names if n not in ALL_FAMILIES]
  if unknown:
    raise SystemExit(f"error: --families: unknown {unknown}; valid: all, cheap, "
                     f"{', '.join(ALL_FAMILIES)}")
  return names


def _reference(args, trainer_args):
  reference = os.path.join(args.workdir, "reference")
  timing_file = os.path.join(args.workdir, "reference_timing.json")
  timing = json.load(open(timing_file)) if os.path.exists(timing_file) else None
  if not (args.reuse_reference and timing and timing["trainer_args"] == trainer_args):
    shutil.rmtree(reference, ignore_errors=True)
    seconds, startup = run_to_end(trainer_args, reference, args.timeout)
    timing = {"trainer_args": trainer_args, "seconds": seconds, "startup": startup}
    with open(timing_file, "w") as f:
      json.dump(timing, f)
  return reference, timing["seconds"], timing["startup"]


def main():
  from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top
  absl_logging.set_verbosity(absl_logging.ERROR)   # orbax's notes on every read
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--families", default="all",
                      help=f"all, cheap ({','.join(fault_families.CHEAP)}: no training) or "
                      f"some of {','.join(ALL_FAMILIES)}")
  parser.add_argument("--quick", action="store_true",
                      help="at most 3 SIGKILLs, 1 SIGTERM and 1 SIGINT, shorter timeouts")
  parser.add_argument("--kills", type=int, default=10)
  parser.add_argument("--signals", type=int, default=5, help="SIGTERMs, and as many SIGINTs")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--during_save", type=float, default=0.3,
                      help="share of the kills aimed at a checkpoint write in flight")
  parser.add_argument("--during_eval", type=float, default=0.2,
                      help="share of the kills aimed at an evaluation")
  parser.add_argument("--damage", default="all", help=f"all, none or some of {DAMAGE_KINDS}")
  parser.add_argument("--jobs", type=int, default=2, help="must-fail starts run side by side")
  parser.add_argument("--workdir", default="/tmp/fault_injection")
  parser.add_argument("--out", default="fault_injection.json")
  parser.add_argument("--timeout", type=float, default=3600)
  parser.add_argument("--rounds", type=int, default=1,
                      help="run the kills and signals this many times, each in a new run "
                      "directory (one run holds ~20 kills before it trains to its end)")
  parser.add_argument("--reuse_reference", action="store_true",
                      help="keep WORKDIR/reference from an earlier call with the same flags")
  args, trainer_args = parser.parse_known_args()
  if any(a.startswith("--workdir") for a in trainer_args):
    parser.error("--workdir is the script's own (the run directories go under it)")
  families = _selected(args.families)
  if args.quick:
    args.kills, args.signals = min(args.kills, 3), min(args.signals, 1)
  kinds = (list(DAMAGE_KINDS) if args.damage == "all" else []
           if args.damage == "none" else args.damage.split(","))
  os.makedirs(args.workdir, exist_ok=True)
  t0 = time.monotonic()
  report = {"command": " ".join([sys.executable, *sys.argv]), "commit": _commit(),
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "device": f"{platform.machine()} CPU, {os.cpu_count()} cores, {platform.system()}",
            "trainer_args": trainer_args, "families": families}
  faults = []

  def save_partial():  # what has run survives a run cut short: OUT.partial.json
    report["faults"] = faults
    with open(args.out + ".partial.json", "w") as f:
      json.dump(report, f, indent=2)

  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  if any(f in EXPERIMENTS for f in families):
    reference, seconds, startup = _reference(args, trainer_args)
    steps = max(_metrics(reference)[0])
    step_time = (seconds - startup) / steps   # wall time per step, checkpoints and evals in
    print(f"reference: {steps} steps in {seconds:.0f} s ({startup:.0f} s to the first step, "
          f"{step_time:.3f} s/step)", flush=True)
    report.update({"steps": steps, "reference_seconds": round(seconds, 1),
                   "startup_seconds": round(startup, 1),
                   "wall_seconds_per_step": round(step_time, 4)})
    if "damage" in families:
      report["damage"] = damage_experiment(args, trainer_args, reference, kinds)
      faults += [fault_families.fault("checkpoint damage", d["kind"], d["damage"],
                                      d["outcome"], "; ".join(d["reported"])[:300])
                 for d in report["damage"]]
      save_partial()
  ctx = fault_families.Context(args, trainer_args)
  for name in families:
    if name in fault_families.FAMILIES:
      try:
        got = fault_families.FAMILIES[name](ctx)
      except Exception as e:  # pylint: disable=broad-except  # the script's, not the program's
        report.setdefault("family_errors", {})[name] = repr(e)[-2000:]
        print(f"family {name} could not run: {e!r}", flush=True)
        continue
      for f in got:
        print(f"{f['family']}: {f['fault']}: {f['outcome']} ({f['detail']})", flush=True)
      faults += got
      save_partial()
  if any(f in EXPERIMENTS for f in families):  # the kill rounds last: they take the longest
    for r in range(args.rounds):
      tag = f"_r{r + 1}" if r else ""
      if "kills" in families and args.kills:
        report["kills" + tag] = kills_experiment(args, trainer_args, reference, steps,
                                                 step_time, round_index=r)
        faults += report["kills" + tag]["faults"]
        save_partial()
      if "signals" in families and args.signals:
        for signum in (signal.SIGTERM, signal.SIGINT):
          report[signum.name + tag] = kills_experiment(args, trainer_args, reference, steps,
                                                       step_time, signum, args.signals, r)
          faults += report[signum.name + tag]["faults"]
          save_partial()
  report["faults"] = faults
  report["wall_seconds"] = round(time.monotonic() - t0, 1)
  report["summary"] = {c: sum(f["outcome"] == c for f in faults)
                       for c in fault_families.CLASSES}
  report["summary_table"] = fault_families.summary_table(faults)
  checks = [report[k]["summary"] for first in ("kills", "SIGTERM", "SIGINT")
            for k in _round_keys(report, first)] + [
      d for d in report.get("damage", []) if not d["failed"]]
  report["all_equal"] = all(c["final_state_equal"] and c["losses_equal"] and c["evals_equal"]
                            and c["tensorboard_missing_steps"] == 0
                            and c["tensorboard_torn_files"] == 0 for c in checks)
  report["all_ok"] = (report["all_equal"] and all(f["outcome"] == "ok" for f in faults)
                      and not report.get("family_errors"))
  with open(args.out, "w") as f:
    json.dump(report, f, indent=2)
  if os.path.exists(args.out + ".partial.json"):
    os.remove(args.out + ".partial.json")
  if "kills" in report or "damage" in report:
    print(_table(report))
  print(report["summary_table"])
  print(f"{len(faults)} faults in {report['wall_seconds']:.0f} s; all ok: {report['all_ok']} "
        f"(report: {args.out})")
  sys.exit(0 if report["all_ok"] else 1)


if __name__ == "__main__":
  main()
