"""One trainer per run directory: OS locks (flock) on WORKDIR itself and on WORKDIR/.lock.

The lock on the directory's own inode is the one that counts: deleting or replacing any file
in the run directory (`.lock` included) cannot release it, so a second trainer is always
refused. `.lock` keeps who holds the run (pid, host, since) for the message the second
trainer gets, and is flocked too, for trainers of older versions that lock only that file.
Where `.lock` was deleted, the holder is found in the kernel's lock table (/proc/locks).
The kernel drops both locks when their process dies, however it dies, so a killed trainer
never blocks the next one. In a multi-process job process 0 takes the lock for all.
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
  """flock(LOCK_EX | LOCK_NB) on WORKDIR and WORKDIR/.lock; acquire() raises RunDirLocked if
  another process holds either."""

  def __init__(self, workdir: str):
    self.workdir = workdir
    self.path = os.path.join(workdir, rundir.LOCK_FILE)
    self._fds: list[int] = []

  def acquire(self) -> None:
    os.makedirs(self.workdir, exist_ok=True)
    try:
      self._lock(os.open(self.workdir, os.O_RDONLY | os.O_DIRECTORY))
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
      locked = self._lock(fd)
    except BaseException:
      self.release()
      raise
    if not locked:
      return
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                             "since": datetime.datetime.now().isoformat(timespec="seconds")
                             }).encode())

  def _lock(self, fd: int) -> bool:
    """Locks `fd` (kept open until release()); False on a filesystem without flock."""
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      os.close(fd)
      raise RunDirLocked(
          f"{os.path.abspath(self.workdir)} is in use by another trainer ({self.holder()}): "
          "two trainers would mix their checkpoints and metrics. Wait for it to finish or "
          "stop it, or give this run another --workdir") from None
    except OSError as e:  # a filesystem without flock (some network mounts): go on unlocked
      os.close(fd)
      print(f"warning: cannot lock {self.workdir} ({e}); nothing stops a second trainer on "
            "this run directory")
      return False
    self._fds.append(fd)
    return True

  def holder(self) -> str:
    """Who holds the run: `.lock`'s pid, host and start, else the kernel's lock table."""
    try:
      with open(self.path) as f:
        info = json.loads(f.read() or "{}")
      if _alive(info["pid"]) or info["host"] != socket.gethostname():
        return f"pid {info['pid']} on host {info['host']}, since {info['since']}"
    except (ValueError, KeyError, TypeError, OSError):
      pass
    pid = _flock_holder(self.workdir)
    if pid is not None:
      return (f"pid {pid} on host {socket.gethostname()} (from the kernel's lock table: "
              f"{rundir.LOCK_FILE} was deleted or rewritten)")
    return "holder unknown"

  def release(self) -> None:
    # The files stay: deleting a lock file races with the next taker.
    for fd in reversed(self._fds):
      fcntl.flock(fd, fcntl.LOCK_UN)
      os.close(fd)
    self._fds = []


def _alive(pid: int) -> bool:
  try:
    os.kill(int(pid), 0)
  except ProcessLookupError:
    return False
  except (PermissionError, ValueError, TypeError):
    return True
  return True


def _flock_holder(path: str) -> int | None:
  """The pid holding a flock on `path`'s inode, from /proc/locks (Linux), or None."""
  try:
    st = os.stat(path)
    with open("/proc/locks") as f:
      lines = f.read().splitlines()
  except OSError:
    return None
  inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
  for line in lines:
    fields = line.split()
    if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == inode:
      return int(fields[4])
  return None


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
