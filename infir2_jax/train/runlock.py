"""One trainer per run directory: an OS lock (flock) on WORKDIR/.lock, with pid and host.

The kernel drops the lock when its process dies, however it dies, so a stale lock of a
killed trainer never blocks the next one. The file keeps who holds it, for the message
the second trainer gets. In a multi-process job process 0 takes the lock for all.
"""

import contextlib
import datetime
import fcntl
import json
import os
import socket

import jax

from infir2_jax.errors import UserError
from infir2_jax.train import rundir


class RunDirLocked(UserError, RuntimeError):
  """Another live trainer holds the run directory."""


class RunLock:
  """flock(LOCK_EX | LOCK_NB) on WORKDIR/.lock; acquire() raises RunDirLocked if taken."""

  def __init__(self, workdir: str):
    self.workdir = workdir
    self.path = os.path.join(workdir, rundir.LOCK_FILE)
    self._fd = None

  def acquire(self) -> None:
    os.makedirs(self.workdir, exist_ok=True)
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = _read_holder(fd)
      os.close(fd)
      raise RunDirLocked(
          f"{os.path.abspath(self.workdir)} is in use by another trainer ({holder}): two "
          "trainers would mix their checkpoints and metrics. Wait for it to finish or stop "
          "it, or give this run another --workdir") from None
    except OSError as e:  # a filesystem without flock (some network mounts): go on unlocked
      print(f"warning: cannot lock {self.path} ({e}); nothing stops a second trainer on "
            "this run directory")
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                             "since": datetime.datetime.now().isoformat(timespec="seconds")
                             }).encode())
    self._fd = fd

  def release(self) -> None:
    if self._fd is not None:  # the file stays: deleting a lock file races with the next taker
      fcntl.flock(self._fd, fcntl.LOCK_UN)
      os.close(self._fd)
      self._fd = None


def _read_holder(fd: int) -> str:
  try:
    info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    return f"pid {info['pid']} on host {info['host']}, since {info['since']}"
  except (ValueError, KeyError, OSError):
    return "holder unknown"


@contextlib.contextmanager
def hold(workdir: str):
  """Holds the run directory's lock for the block (process 0; the others follow its verdict)."""
  lock = RunLock(workdir)
  error = None
  if jax.process_index() == 0:
    try:
      lock.acquire()
    except RunDirLocked as e:
      error = e
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    taken = multihost_utils.broadcast_one_to_all(jax.numpy.int32(error is not None))
    if int(taken) and error is None:
      error = RunDirLocked(f"{os.path.abspath(workdir)} is in use by another trainer "
                           "(see process 0's message)")
  if error is not None:
    raise error
  try:
    yield lock
  finally:
    lock.release()
