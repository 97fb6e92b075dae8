"""Benchmark helpers: device timing of a jitted function, and the metadata a results file records."""
import os
import statistics
import subprocess
import sys
import time

import jax

_TIMING = {"method": None}


def device_ms(fn, args, iters=20, warmup=2):
  """Median device time (ms) of fn(*args): CUPTI kernel time, else host wall time.

  CUPTI sums the kernels of one call (launch gaps excluded), the figure the
  device-time rule of METHOD.md asks for. Without CUPTI, falls back to the
  wall time of back-to-back calls divided by their number.
  """
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  if _TIMING["method"] in (None, "cupti"):
    try:
      from jax.experimental.mosaic.gpu import profiler
      _, times = profiler.measure(fn, iterations=iters)(*args)
      if times:
        _TIMING["method"] = "cupti"
        return statistics.median(times)
    except Exception as e:  # noqa: BLE001 - any CUPTI failure: use the fallback
      print(f"CUPTI timing failed ({type(e).__name__}: {e}); using host timing", flush=True)
  _TIMING["method"] = "host"
  samples = []
  for _ in range(5):
    t0 = time.perf_counter()
    for _ in range(iters):
      out = fn(*args)
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - t0) * 1e3 / iters)
  return statistics.median(samples)


def run_info(argv, with_device: bool = True):
  """Command, commit, device and versions for a results file.

  with_device=False leaves out what needs a JAX backend (for a parent process that must not
  take GPU memory from its children).
  """
  def git(*a):
    try:
      return subprocess.run(["git", *a], capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001
      return ""
  dev = jax.devices()[0] if with_device else None
  return {
      "command": " ".join([os.path.basename(sys.executable), *argv]),
      # a device machine gets a copy of the tree without .git: the caller passes the commit
      "git_commit": (lambda h: h if len(h) == 40 else os.environ.get(
          "INFIR2_GIT_COMMIT", "(unknown: no git checkout here)"))(git("rev-parse", "HEAD")),
      "git_dirty": bool(git("status", "--porcelain")) if git("rev-parse", "HEAD") else
                   os.environ.get("INFIR2_GIT_DIRTY", "unknown"),
      "device": getattr(dev, "device_kind", str(dev)) if with_device else "see each result",
      "num_sms": getattr(dev, "core_count", None),
      "jax_version": jax.__version__,
      "timing": "median of device times (CUPTI kernel sum per call) unless 'timing_method' says host",
      "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
  }


def timing_method():
  return _TIMING["method"]
