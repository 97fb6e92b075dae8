"""A checkpoint save that fails stops the run at once with one clear line (issue 36, item 5):
a file-size limit (EFBIG), a read-only checkpoints/ folder; never a hang (orbax waited 300 s
for the folder it could not make), never training on past the failed save; and none of
orbax's logged tracebacks from its save threads before that line (--debug shows them)."""

import logging
import os
import re
import resource
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from infir2_jax import errors
from infir2_jax.config import CheckpointConfig
from infir2_jax.train import checkpoint as checkpoint_lib
from infir2_jax.train import integrity, rundir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _state(mib=2):
  """MiB of random float32 (orbax compresses: a constant array would take no space)."""
  w = np.random.default_rng(0).standard_normal((mib, 1 << 18)).astype(np.float32)
  return {"step": np.int32(1), "params": {"w": w}}


class _FileSizeLimit:
  """RLIMIT_FSIZE for this process (Python ignores SIGXFSZ: writes fail with EFBIG)."""

  def __init__(self, limit):
    self.limit, self.old = limit, resource.getrlimit(resource.RLIMIT_FSIZE)

  def __enter__(self):
    resource.setrlimit(resource.RLIMIT_FSIZE, (self.limit, self.old[1]))

  def __exit__(self, *exc):
    resource.setrlimit(resource.RLIMIT_FSIZE, self.old)


def _orbax_errors(caplog):
  return [r for r in caplog.records if r.levelno >= logging.ERROR
          and f"{os.sep}orbax{os.sep}" in r.pathname]


def test_a_background_save_past_the_file_size_limit_is_seen_by_the_next_poll(tmp_path, caplog,
                                                                               monkeypatch):
  monkeypatch.delenv(errors.DEBUG_ENV, raising=False)
  caplog.set_level(logging.INFO)
  ckpt = checkpoint_lib.Checkpointer(str(tmp_path), CheckpointConfig(), owner=True)
  ckpt.save(1, jax.device_put(_state()), None)
  ckpt.wait()
  with _FileSizeLimit(64 << 10):
    ckpt.save(2, jax.device_put(_state()), None)   # returns: the write is in the background
    deadline = time.monotonic() + 60
    with pytest.raises(checkpoint_lib.SaveFailed) as error:
      while time.monotonic() < deadline:   # what the loop does before each step
        ckpt.poll()
        time.sleep(0.05)
  message = str(error.value)
  assert "\n" not in message and message.startswith("checkpoint 2 could not be saved in ")
  assert "file-size limit" in message and "65536 bytes" in message, message
  assert "resume from checkpoint 1" in message, message
  ckpt.close()   # reported once: closing does not raise it again
  assert rundir.checkpoint_steps(str(tmp_path)) == [1]
  assert not [d for d in os.listdir(ckpt.directory) if rundir.ORBAX_TMP_MARK in d]
  # orbax's tracebacks from its save threads (future.py, async_checkpointer.py, ...) were
  # dropped: the SaveFailed line is what the user sees
  assert not _orbax_errors(caplog), [r.getMessage()[:200] for r in _orbax_errors(caplog)]
  captured = checkpoint_lib._QUIET_SAVES.captured   # pylint: disable=protected-access
  assert captured and 27 in [code for _, code in captured], captured   # EFBIG, kept
  assert not checkpoint_lib._QUIET_SAVES.active   # pylint: disable=protected-access


def _record(level, pathname):
  return logging.LogRecord("absl", level, pathname, 1, "boom", None, None)


def test_only_orbax_errors_during_a_save_are_dropped(tmp_path, monkeypatch):
  """The filter is scoped: other code's errors, orbax's warnings, orbax's errors while no save
  is in flight, and everything under --debug / INFIR2_DEBUG=1 still log."""
  monkeypatch.delenv(errors.DEBUG_ENV, raising=False)
  orbax_file = os.path.join(checkpoint_lib._ORBAX_DIR,   # pylint: disable=protected-access
                            "checkpoint", "_src", "futures", "future.py")
  ours = os.path.join(ROOT, "infir2_jax", "train", "trainer.py")
  quiet = checkpoint_lib._QUIET_SAVES   # pylint: disable=protected-access
  ckpt = checkpoint_lib.Checkpointer(str(tmp_path), CheckpointConfig(), owner=True)
  assert quiet.filter(_record(logging.ERROR, orbax_file))   # no save yet
  ckpt.save(1, jax.device_put(_state(1)), None)
  assert not quiet.filter(_record(logging.ERROR, orbax_file))
  assert quiet.filter(_record(logging.ERROR, ours))
  assert quiet.filter(_record(logging.WARNING, orbax_file))
  monkeypatch.setenv(errors.DEBUG_ENV, "1")
  assert quiet.filter(_record(logging.ERROR, orbax_file))
  monkeypatch.delenv(errors.DEBUG_ENV)
  ckpt.wait()   # whole: orbax's errors are not about a save of ours any more
  assert quiet.filter(_record(logging.ERROR, orbax_file))
  ckpt.close()
  assert not quiet.active


def _read_only(path):
  if os.geteuid() == 0:   # root writes through permissions: a read-only mount instead
    if os.system(f"mount -t tmpfs -o size=16m tmpfs {path}") != 0:
      pytest.skip("needs to mount a tmpfs")
    return f"mount -o remount,ro {path}", f"umount {path}"
  return f"chmod 555 {path}", f"chmod 755 {path}"


def test_a_read_only_checkpoints_folder_fails_the_save_at_once(tmp_path):
  """orbax's save used to wait 300 s (the step folder it could not make), then raise a
  TimeoutError naming a signal."""
  directory = rundir.checkpoints_dir(str(tmp_path))
  os.makedirs(directory)
  protect, undo = _read_only(directory)
  try:
    ckpt = checkpoint_lib.Checkpointer(str(tmp_path), CheckpointConfig(), owner=True)
    ckpt.save(1, jax.device_put(_state()), None)
    ckpt.wait()
    assert os.system(protect) == 0
    start = time.monotonic()
    with pytest.raises(checkpoint_lib.SaveFailed, match=r"checkpoint 2 could not be saved in "
                       r".*cannot be written \((Read-only file system|Permission denied)\)"
                       r".*resume from checkpoint 1"):
      ckpt.save(2, jax.device_put(_state()), None)
    assert time.monotonic() - start < 30
    ckpt.close()
  finally:
    os.system(undo)


_FAULTY_TRAINER = """
import os, resource, sys
sys.path[:0] = [{root!r}, os.path.join({root!r}, "tests")]
from infir2_jax.train import checkpoint, trainer
from test_trainer import tiny_config
save = checkpoint.Checkpointer.save
def faulty(self, step, state, it):
  save(self, step, state, it)
  if step == 2:   # checkpoint 2 is whole, then the fault
    self.wait()
    if {fault!r} == "efbig":
      resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.RLIM_INFINITY))
    else:
      assert os.system({protect!r}) == 0
checkpoint.Checkpointer.save = faulty
trainer.train(tiny_config(steps=40, **{{"checkpoint.every_steps": 2, "eval.every_steps": 0,
                                        "log.tensorboard": False}}), {workdir!r})
"""


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["efbig", "read-only"])
def test_the_trainer_stops_at_a_failed_save_with_one_line(tmp_path, fault):
  workdir = str(tmp_path / "run")
  directory = rundir.checkpoints_dir(workdir)
  os.makedirs(directory)
  protect, undo = _read_only(directory) if fault == "read-only" else ("", "")
  try:
    result = subprocess.run(
        [sys.executable, "-c", _FAULTY_TRAINER.format(root=ROOT, fault=fault, protect=protect,
                                                      workdir=workdir)],
        cwd=ROOT, capture_output=True, text=True, timeout=280)
    steps = rundir.checkpoint_steps(workdir)   # before a read-only mount goes
  finally:
    if undo:
      os.system(undo)
  out = result.stdout + result.stderr
  assert result.returncode == 1, out[-3000:]
  error = [l for l in out.splitlines() if "SaveFailed: checkpoint" in l]
  assert error and "could not be saved" in error[0] and "resume from checkpoint 2" in error[0], \
      out[-3000:]
  assert steps == [2]
  trained = max(r["step"] for r in rundir.read_metrics(workdir) if "loss" in r)
  assert trained <= 8, trained   # stopped at the failed save (4), not at the end (40)
  # none of orbax's logged tracebacks (absl's `E1202 ... future.py:387]` lines) before it
  assert not re.search(r"^[EF]\d{4} .*\.py:\d+\]", result.stderr, re.M), result.stderr[:3000]


_TINY = ["--config.batch_size=8", "--config.seq_len=64", "--config.model.hidden_size=128",
         "--config.model.intermediate_size=256", "--config.model.num_layers=2",
         "--config.model.num_heads=2", "--config.model.num_kv_heads=1",
         "--config.opt.warmup_steps=1", "--config.eval.every_steps=0",
         "--config.log.progress_bar=False", "--config.log.tensorboard=False",
         "--config.checkpoint.every_steps=2"]


def _under_file_size_limit(limit, command):
  """`command` run under RLIMIT_FSIZE=limit with SIGXFSZ ignored (writes fail with EFBIG): a
  launcher sets both and execs it (no preexec_fn: this process runs JAX's threads)."""
  launch = ("import os, resource, signal, sys; "
            f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit})); "
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN); os.execv(sys.argv[1], sys.argv[1:])")
  return [sys.executable, "-c", launch, *command]


@pytest.mark.slow
def test_a_save_past_the_file_size_limit_shows_only_the_error_line(tmp_path):
  """`python -m infir2_jax.train` under `ulimit -f 64`: stderr has our one `error:` line and
  none of orbax's logged tracebacks (future.py, async_checkpointer.py,
  checkpoint_manager.py); the checkpoint before the failed save still restores."""
  workdir = str(tmp_path / "run")
  env = {k: v for k, v in os.environ.items() if k != errors.DEBUG_ENV}
  env.update(XLA_FLAGS="", JAX_PLATFORMS="cpu", INFIR2_COMPILATION_CACHE="")
  train = [sys.executable, "-m", "infir2_jax.train", *_TINY, f"--workdir={workdir}"]
  first = subprocess.run([*train, "--config.steps=2"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=280)
  assert first.returncode == 0, first.stderr[-3000:]
  assert rundir.checkpoint_steps(workdir) == [2]
  result = subprocess.run(_under_file_size_limit(64 << 10, [*train, "--config.steps=8"]),
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
  assert result.returncode == 1, result.stderr[-3000:]
  assert "Traceback" not in result.stderr, result.stderr[:3000]
  assert not re.search(r"^[EF]\d{4} .*\.py:\d+\]", result.stderr, re.M), result.stderr[:3000]
  error = [l for l in result.stderr.splitlines() if l.startswith("error: ")]
  assert len(error) == 1, result.stderr[-3000:]
  assert error[0].startswith("error: checkpoint 4 could not be saved in "), error[0]
  assert "file-size limit" in error[0] and "resume from checkpoint 2" in error[0], error[0]
  assert rundir.checkpoint_steps(workdir) == [2]
  path = rundir.step_dir(workdir, 2)
  assert integrity.verify(path)   # checksummed and intact
  state = checkpoint_lib.read_state(rundir.checkpoint_item(workdir, 2)[0])
  assert int(state["step"]) == 2
