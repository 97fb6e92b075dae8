"""Benchmark helpers: device timing, batches and an ahead-of-time compiled train step, and
the metadata a results file records."""
import functools
import dataclasses
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import jax
import numpy as np

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


def kernel_breakdown(fn, args, iters=10) -> list[dict] | None:
  """Median device ms of each kernel one fn(*args) call launches, in launch order (CUPTI);
  None without CUPTI. Shows what a timed sum is made of, e.g. a GEMM's XLA-side layout ops."""
  try:
    from jax.experimental.mosaic.gpu import profiler
    jax.block_until_ready(fn(*args))
    _, per_iter = profiler.measure(fn, aggregate=False, iterations=iters)(*args)
  except Exception as e:  # noqa: BLE001 - a diagnostic: absent without CUPTI
    print(f"kernel breakdown unavailable ({type(e).__name__}: {e})", flush=True)
    return None
  if not per_iter:
    return None
  per_iter = per_iter if iters > 1 else [per_iter]
  return [{"kernel": name, "ms": statistics.median(it[i][1] for it in per_iter)}
          for i, (name, _) in enumerate(per_iter[0])]


BATCH_DTYPES = (("inputs", np.int32), ("targets", np.int32), ("segment_ids", np.int32),
                ("positions", np.int32), ("loss_mask", np.float32))


def abstract_batch(rows: int, length: int, sharding=None) -> dict[str, jax.ShapeDtypeStruct]:
  """The train step's batch as ShapeDtypeStructs, for compiling without data."""
  return {k: jax.ShapeDtypeStruct((rows, length), dtype, sharding=sharding)
          for k, dtype in BATCH_DTYPES}


def synthetic_batch(rows: int, length: int, vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
  """A host batch of random token ids: one unpacked document per row, every token counted."""
  ids = np.random.default_rng(seed).integers(0, vocab, (rows, length + 1), dtype=np.int32)
  return {"inputs": ids[:, :-1], "targets": ids[:, 1:],
          "segment_ids": np.ones((rows, length), np.int32),
          "positions": np.tile(np.arange(length, dtype=np.int32), (rows, 1)),
          "loss_mask": np.ones((rows, length), np.float32)}


@dataclasses.dataclass
class CompiledStep:
  """A train step compiled ahead of time, and what running it needs."""
  compiled: Any            # jax.stages.Compiled: (state, batch) -> (state, metrics)
  lower_s: float
  compile_s: float
  mesh: Any
  rules: Any
  init_fn: Any             # rng -> boxed params
  optimizer: Any
  batch_sharding: Any


def compile_train_step(cfg, devices=None) -> CompiledStep:
  """cfg's train step, lowered and compiled from abstract shapes (no device memory used)."""
  import flax.linen as nn
  from infir2_jax import parallel
  from infir2_jax.train.optim import make_apply, make_optimizer, make_schedule
  from infir2_jax.train.step import make_train_step
  from infir2_jax.model import init_params
  from infir2_jax.train.trainer import build_model

  mesh = parallel.make_mesh(cfg.mesh, devices)
  rules = parallel.logical_rules(cfg.mesh, cfg.model, mesh)
  model = build_model(cfg)
  optimizer = make_optimizer(cfg.opt, cfg.steps)
  init_fn = functools.partial(init_params, model)
  structs, _ = parallel.abstract_state(init_fn, optimizer, mesh, rules)
  batch_sharding = parallel.batch_sharding(mesh, rules)
  batch = abstract_batch(cfg.batch_size, cfg.seq_len, batch_sharding)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    step = jax.jit(make_train_step(model, optimizer, make_schedule(cfg.opt, cfg.steps),
                                   cfg.grad_accum_steps,
                                   apply=make_apply(cfg.opt, cfg.steps, optimizer)),
                   donate_argnums=0)
    t0 = time.perf_counter()
    lowered = step.lower(structs, batch)
    lower_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = lowered.compile()
    compile_s = time.perf_counter() - t0
  return CompiledStep(compiled, lower_s, compile_s, mesh, rules, init_fn, optimizer,
                      batch_sharding)


SOURCE_DIRS = ("infir2_jax", "configs", "benchmarks")


def source_digest(root: "str | None" = None) -> str:
  """sha256 (first 16 hex digits) of the Python sources under SOURCE_DIRS, by relative path
  and content, read from the files themselves: it names the code a result came from even
  where the device machine's copy of .git is stale (session 24's results named the commit
  of an earlier call). Recompute it at a commit to match a results file to that commit."""
  import hashlib
  root = root or os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  digest = hashlib.sha256()
  for top in SOURCE_DIRS:
    for dirpath, dirnames, filenames in os.walk(os.path.join(root, top)):
      dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
      for name in sorted(f for f in filenames if f.endswith(".py")):
        path = os.path.join(dirpath, name)
        digest.update(os.path.relpath(path, root).encode() + b"\0")
        with open(path, "rb") as fh:
          digest.update(fh.read() + b"\0")
  return digest.hexdigest()[:16]


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
  # The device machine's copy of the tree may carry a stale .git: the caller's commit wins.
  head = "" if "INFIR2_GIT_COMMIT" in os.environ else git("rev-parse", "HEAD")
  in_checkout = len(head) == 40
  return {
      "command": " ".join([os.path.basename(sys.executable), *argv]),
      "git_commit": head if in_checkout else os.environ.get(
          "INFIR2_GIT_COMMIT", "(unknown: no git checkout here)"),
      "git_dirty": (bool(git("status", "--porcelain")) if in_checkout
                    else {"true": True, "false": False}.get(
                        os.environ.get("INFIR2_GIT_DIRTY", "").lower(), "unknown")),
      "source_digest": source_digest(),
      "device": getattr(dev, "device_kind", str(dev)) if with_device else "see each result",
      "num_sms": getattr(dev, "core_count", None),
      "jax_version": jax.__version__,
      "timing": "median of device times (CUPTI kernel sum per call) unless 'timing_method' says host",
      "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
  }


def timing_method():
  return _TIMING["method"]


class GpuTelemetry:
  """Samples the GPU's SM clock, power and temperature with nvidia-smi while a block runs.

  Tells "the kernel is slower" from "the card ran slower" (power or thermal limits under
  sustained FP8 load). `summary` is filled on exit; with no nvidia-smi it says so and the
  block runs as usual.

      with GpuTelemetry() as telemetry:
        ...
      result["gpu_telemetry"] = telemetry.summary
  """
  FIELDS = ("clocks.sm", "power.draw", "temperature.gpu")

  def __init__(self, interval_ms: int = 100, gpu_index: "int | None" = None,
               executable: str = "nvidia-smi"):
    if gpu_index is None:
      gpu_index = self.visible_gpu_index()
    self._cmd = [executable, f"--query-gpu={','.join(self.FIELDS)}",
                 "--format=csv,noheader,nounits", f"-lms={interval_ms}", f"-i={gpu_index}"]
    self._proc = None
    self._out = None
    self.summary: dict = {}

  def __enter__(self):
    import tempfile
    self._out = tempfile.TemporaryFile("w+")
    try:
      self._proc = subprocess.Popen(self._cmd, stdout=self._out, stderr=subprocess.DEVNULL,
                                    text=True)
    except OSError as e:
      self.summary = {"error": f"{self._cmd[0]} not available: {e}"}
    return self

  def __exit__(self, *exc):
    if self._proc is not None:
      self._proc.terminate()
      try:
        self._proc.wait(timeout=5)
      except subprocess.TimeoutExpired:
        self._proc.kill()
        self._proc.wait()
      self._out.seek(0)
      self.summary = self.parse(self._out.read())
    self._out.close()
    return False

  @staticmethod
  def visible_gpu_index() -> "int | str":
    """The GPU this process computes on, as nvidia-smi numbers it: nvidia-smi ignores
    CUDA_VISIBLE_DEVICES, so a benchmark pinned to GPU 1 would otherwise sample GPU 0."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return first if first else 0  # an index or a GPU-... UUID; nvidia-smi -i takes both

  @classmethod
  def parse(cls, text: str) -> dict:
    """Median/min/max of each field over the CSV lines nvidia-smi printed."""
    rows = []
    for line in text.splitlines():
      parts = [p.strip() for p in line.split(",")]
      try:
        rows.append([float(p) for p in parts])
      except ValueError:
        continue  # "[N/A]", a header or a partial last line
    rows = [r for r in rows if len(r) == len(cls.FIELDS)]
    if not rows:
      return {"error": "no samples", "samples": 0}
    cols = np.asarray(rows).T
    out = {"samples": len(rows)}
    for name, col in zip(("sm_mhz", "power_w", "temp_c"), cols):
      out[f"{name}_median"] = float(np.median(col))
      out[f"{name}_min"] = float(col.min())
      out[f"{name}_max"] = float(col.max())
    return out
