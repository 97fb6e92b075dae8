"""Faults that need real processes (issue 23): SIGTERM / SIGINT save and stop cleanly, one
trainer per run directory, grain workers die with a SIGKILLed trainer, and SIGKILLs at
random moments (the fault-injection script): nothing lost, TensorBoard complete."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from infir2_jax.train import rundir, runlock
from infir2_jax.train.trainer import train
from test_trainer import tiny_config, train_losses

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = {"batch_size": 8, "seq_len": 64, "model.hidden_size": 128,
        "model.intermediate_size": 256, "model.num_layers": 2, "model.num_heads": 2,
        "model.num_kv_heads": 1, "opt.warmup_steps": 2, "eval.batches": 2,
        "log.progress_bar": False}


def _args(**overrides):
  return [f"--config.{k}={v}" for k, v in {**TINY, **overrides}.items()]


class Trainer:
  """`python -m infir2_jax.train` in a subprocess, its output collected line by line."""

  def __init__(self, workdir, **overrides):
    self.proc = subprocess.Popen(
        [sys.executable, "-m", "infir2_jax.train", f"--workdir={workdir}", *_args(**overrides)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    self.lines = []
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()

  def _read(self):
    for line in self.proc.stdout:
      self.lines.append(line.rstrip("\n"))

  def wait_for(self, text, timeout=240):
    deadline = time.monotonic() + timeout
    while not any(text in l for l in self.lines):
      if self.proc.poll() is not None:
        self._reader.join(5)
        if any(text in l for l in self.lines):
          return
        raise AssertionError(f"exited {self.proc.returncode} before {text!r}:\n"
                             + "\n".join(self.lines[-30:]))
      assert time.monotonic() < deadline, f"no {text!r} in:\n" + "\n".join(self.lines[-30:])
      time.sleep(0.05)

  def finish(self, timeout=240):
    code = self.proc.wait(timeout)
    self._reader.join(5)
    return code

  @property
  def output(self):
    return "\n".join(self.lines)


PREEMPT = {"steps": 12, "checkpoint.every_steps": 100, "eval.every_steps": 0}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("uninterrupted"))
  train(tiny_config(**PREEMPT), workdir)
  return train_losses(workdir)


@pytest.mark.slow
@pytest.mark.parametrize("signum,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_saves_at_the_next_step_and_exits_cleanly(tmp_path, uninterrupted, signum,
                                                         code):
  """SLURM's SIGTERM (and Ctrl-C) mid-run: a checkpoint of the next step boundary, exit
  128 + signal without a traceback; the resumed run equals the uninterrupted one bit for bit
  (SIGINT used to abort with 134)."""
  workdir = str(tmp_path)
  trainer = Trainer(workdir, **PREEMPT)
  trainer.wait_for("step 4:")
  trainer.proc.send_signal(signum)
  assert trainer.finish() == code, trainer.output
  name = signal.Signals(signum).name
  stopped = [l for l in trainer.lines if l.startswith(f"stopped by {name} after step ")]
  assert stopped and "Traceback" not in trainer.output, trainer.output
  step = int(stopped[0].split(" after step ")[1].split(":")[0])
  assert 4 <= step < 12 and rundir.checkpoint_steps(workdir) == [step]
  assert max(train_losses(workdir)) == step
  if signum == signal.SIGTERM:   # resuming from that checkpoint loses nothing
    train(tiny_config(**PREEMPT), workdir)
    assert train_losses(workdir) == uninterrupted


@pytest.mark.slow
def test_second_trainer_on_a_run_directory_is_refused(tmp_path):
  """Started together on one workdir: one trains, the other stops at once with a message
  naming the holder; the run's metrics and checkpoints are one run's."""
  workdir = str(tmp_path)
  a, b = Trainer(workdir, steps=6), Trainer(workdir, steps=6, **{"opt.lr": 1e-3})
  codes = [a.finish(), b.finish()]
  assert sorted(codes) == [0, 1], (codes, a.output, b.output)
  loser = (a, b)[codes.index(1)]
  assert "is in use by another trainer (pid " in loser.output, loser.output
  steps = [r["step"] for r in map(json.loads, open(os.path.join(workdir, "metrics.jsonl")))
           if "loss" in r]
  assert steps == [1, 2, 3, 4, 5, 6]
  assert rundir.checkpoint_steps(workdir) == [6]
  assert not os.path.exists(rundir.damaged_dir(workdir))


_HOLD = ("import sys, time; sys.path.insert(0, {root!r}); from infir2_jax.train import runlock;"
         "l = runlock.RunLock({workdir!r}); l.acquire(); print('held', flush=True); "
         "time.sleep(120)")


def test_lock_of_a_killed_trainer_does_not_block(tmp_path):
  workdir = str(tmp_path)
  holder = subprocess.Popen([sys.executable, "-c", _HOLD.format(root=ROOT, workdir=workdir)],
                            stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(runlock.RunDirLocked, match=f"pid {holder.pid} on host"):
      train(tiny_config(steps=1), workdir)   # refused before any work
  finally:
    holder.send_signal(signal.SIGKILL)
    holder.wait()
  lock = runlock.RunLock(workdir)   # the dead holder's lock file is still there
  lock.acquire()
  lock.release()


@pytest.mark.parametrize("fault", ["delete", "replace", "delete everything"])
def test_lock_survives_the_deletion_of_any_file_in_the_run_directory(tmp_path, fault):
  """Issue 36: the lock was an flock on .lock's inode, so deleting .lock let a second trainer
  in. The holder stays named (from the kernel's lock table when .lock is gone)."""
  workdir = str(tmp_path)
  (tmp_path / "metrics.jsonl").write_text("{}\n")
  holder = subprocess.Popen([sys.executable, "-c", _HOLD.format(root=ROOT, workdir=workdir)],
                            stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline().strip() == "held"
    if fault == "replace":   # a new .lock file of another inode, as an editor would write
      os.replace(_write(tmp_path / "x", "{}"), os.path.join(workdir, rundir.LOCK_FILE))
    else:
      for name in os.listdir(workdir) if fault == "delete everything" else [rundir.LOCK_FILE]:
        os.remove(os.path.join(workdir, name))
    with pytest.raises(runlock.RunDirLocked, match=f"in use by another trainer "
                       f"\\(pid {holder.pid} on host"):
      train(tiny_config(steps=1), workdir)
  finally:
    holder.send_signal(signal.SIGKILL)
    holder.wait()
  lock = runlock.RunLock(workdir)   # and the dead holder's lock does not block
  lock.acquire()
  lock.release()


def test_a_refused_trainer_leaves_the_holders_new_run_directory_alone(tmp_path, monkeypatch):
  """Two trainers started together on a new --workdir: the refused one had looked before the
  holder made the folder, took it for its own failed start and removed it, holder's files
  and all."""
  workdir = str(tmp_path / "new")
  holder = subprocess.Popen([sys.executable, "-c", _HOLD.format(root=ROOT, workdir=workdir)],
                            stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline().strip() == "held"
    _write(tmp_path / "new" / "config.json", "{}")
    monkeypatch.setattr(rundir, "missing_root", lambda path: workdir)  # "it did not exist"
    with pytest.raises(runlock.RunDirLocked):
      train(tiny_config(steps=1), workdir)
    assert sorted(os.listdir(workdir)) == [rundir.LOCK_FILE, "config.json"]
  finally:
    holder.send_signal(signal.SIGKILL)
    holder.wait()


def _write(path, text):
  path.write_text(text)
  return str(path)


@pytest.mark.slow
def test_grain_workers_die_with_a_killed_trainer(tmp_path):
  """data.num_workers=2, SIGKILL: the workers (~240 MB each) used to live on for minutes."""
  trainer = Trainer(str(tmp_path), steps=200, **{"data.num_workers": 2,
                                                 "checkpoint.every_steps": 0,
                                                 "eval.every_steps": 0})
  trainer.wait_for("step 2:")
  workers = psutil.Process(trainer.proc.pid).children(recursive=True)
  assert len(workers) >= 2, workers
  trainer.proc.send_signal(signal.SIGKILL)
  trainer.finish()
  _, alive = psutil.wait_procs(workers, timeout=15)
  for p in alive:
    p.kill()
  assert not alive, [p.pid for p in alive]


@pytest.mark.slow
def test_fault_injection_script_sigkills_lose_nothing(tmp_path):
  """The script on the tiny run: 2 rounds (--rounds, each its own run directory) of one
  SIGKILL each (half aimed at a checkpoint write in flight); every loss, the final state
  and TensorBoard equal the uninterrupted run's in both (TensorBoard used to lack the steps
  its writer had not flushed, and to keep torn files)."""
  out = str(tmp_path / "report.json")
  result = subprocess.run(
      [sys.executable, os.path.join(ROOT, "scripts", "fault_injection.py"), "--families=kills", "--kills=1",
       "--rounds=2",
       "--during_save=0.5", "--damage=none", f"--workdir={tmp_path / 'runs'}",
       f"--out={out}", *_args(steps=12, **{"checkpoint.every_steps": 4,
                                           "eval.every_steps": 8})],
      cwd=ROOT, capture_output=True, text=True, timeout=900)
  assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
  report = json.load(open(out))
  assert os.path.isdir(tmp_path / "runs" / "killed_r2")
  for key in ("kills", "kills_r2"):
    summary = report[key]["summary"]
    assert summary["kills"] >= 1 and summary["leaked_processes"] == 0
    assert summary["final_state_equal"] and summary["losses_equal"] and summary["evals_equal"]
    assert summary["tensorboard_missing_steps"] == 0 and summary["tensorboard_torn_files"] == 0
