"""grain's worker processes end with the process that started them, however it ends."""

import os
import threading
import time


def exit_with_parent(worker_index: int, worker_count: int) -> None:
  """grain worker_init_fn: a daemon thread that ends this worker once its parent is gone.

  A trainer killed with SIGKILL runs no cleanup; its workers (hundreds of MB each) would
  live on, adopted by init. Polling the parent pid works whichever thread of the trainer
  started the worker (PR_SET_PDEATHSIG follows that thread, not the process).
  """
  del worker_index, worker_count
  parent = os.getppid()

  def watch():
    while os.getppid() == parent:
      time.sleep(0.5)
    os._exit(1)  # pylint: disable=protected-access  # no cleanup to run: the parent is gone

  threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()
