"""One call run on a daemon thread, its result (or its exception) collected later.

The start-up overlaps work that spends its time outside the GIL: XLA's compile of the train
step, and an orbax restore or a jitted init (I/O, device transfers, compiled code), beside
the tracing on the main thread. A daemon thread, so that a Ctrl-C during the start-up never
waits for work nobody will use.
"""

import threading
import time
from collections.abc import Callable
from typing import Any


class Background:
  """fn() started now on a daemon thread; result() waits and returns it or raises its error."""

  def __init__(self, fn: Callable[[], Any], name: str):
    self.seconds = 0.0   # how long fn ran, once done
    self._outcome: tuple[Any] | BaseException | None = None
    self._done = threading.Event()
    self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True,
                                    name=f"infir2-{name}")
    self._thread.start()

  def _run(self, fn) -> None:
    t0 = time.perf_counter()
    try:
      self._outcome = (fn(),)
    except BaseException as e:  # pylint: disable=broad-except  (re-raised by result())
      self._outcome = e
    finally:
      self.seconds = time.perf_counter() - t0
      self._done.set()

  def wait(self, timeout: float | None = None) -> bool:
    """Waits for fn to end (at most `timeout` seconds); whether it has."""
    return self._done.wait(timeout)

  def result(self) -> Any:
    self._done.wait()
    if isinstance(self._outcome, BaseException):
      raise self._outcome
    return self._outcome[0]
