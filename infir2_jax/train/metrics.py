"""Metrics sinks: a console progress bar, TensorBoard event files and WORKDIR/metrics.jsonl
(and W&B / MLflow when asked for, train/loggers.py).

A killed run loses nothing a checkpoint covers: the event file is flushed before each
checkpoint, a resumed writer hides (TensorBoard's purge) what the killed one logged after
the checkpoint it resumes from, and an event file cut mid-record by the kill is truncated
to its last whole record.
"""

import json
import math
import os
import struct
import sys
import time
from typing import Any

import jax
from tqdm.auto import tqdm

from infir2_jax.config import LogConfig
from infir2_jax.train import loggers, rundir

# Dense bf16 peak per device used for MFU when log.peak_tflops is 0.
_PEAK_TFLOPS_BY_KIND = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0,
                        "B200": 2250.0}


def peak_flops_per_device(cfg: LogConfig) -> float | None:
  if cfg.peak_tflops > 0:
    return cfg.peak_tflops * 1e12
  kind = jax.devices()[0].device_kind
  for name, tflops in _PEAK_TFLOPS_BY_KIND.items():
    if name in kind:
      return tflops * 1e12
  return None


class MetricsWriter:
  """Writes one JSON object per line to metrics.jsonl, TensorBoard scalars and the console.

  Only process 0 writes; the others keep quiet.
  """

  def __init__(self, workdir: str, cfg: LogConfig, total_steps: int, start_step: int = 0,
               run_config: dict | None = None):
    self.cfg, self.workdir = cfg, workdir
    self.active = jax.process_index() == 0
    self._jsonl = self._tb = self._bar = self._trackers = None
    if not self.active:
      return
    self._trackers = loggers.Trackers(cfg, workdir, run_config)  # W&B / MLflow, if asked
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, rundir.METRICS_FILE)
    _end_last_line(path)
    keep_rows_through(workdir, start_step)
    self._jsonl = open(path, "a", buffering=1)
    if cfg.tensorboard:
      try:
        import tensorboardX  # pylint: disable=unused-import
      except ImportError:
        print("tensorboardX is not installed: no TensorBoard event files", file=sys.stderr)
      else:
        tb_dir = os.path.join(workdir, rundir.TENSORBOARD_DIR)
        repair_event_files(tb_dir)
        # Steps after the checkpoint this run resumes from were logged by the killed writer:
        # hidden from step start_step + 1 on (all of them on a fresh start).
        self._tb = _EventFile(tb_dir, purge_step=start_step + 1 if start_step else 0)
    self._bar_args = dict(total=total_steps, initial=start_step, desc="train",
                          dynamic_ncols=True, mininterval=1.0, file=sys.stdout)

  def write(self, step: int, metrics: dict[str, Any], *, console: bool = True) -> None:
    if not self.active:
      return
    scalars = {k: _to_python(v) for k, v in metrics.items()}
    self._jsonl.write(json.dumps({"step": step, **scalars}) + "\n")
    if self._tb is not None:
      for key, value in scalars.items():
        if isinstance(value, (int, float)):
          self._tb.add_scalar(key, value, step)
    self._trackers.log(step, scalars)
    if not console:
      return
    if "eval_loss" in scalars:
      ppl = scalars.get("eval_perplexity")
      self.print(f"step {step}: eval_loss {scalars['eval_loss']:.4f}"
                 + (f" (perplexity {ppl:.4g})" if isinstance(ppl, float) else ""))
      return
    if self._bar is None and self.cfg.progress_bar:  # created late: start-up lines come first
      self._bar = _progress_bar(**self._bar_args)
    if self._bar is not None:
      self._bar.n = step
      self._bar.set_postfix_str(_summary(scalars), refresh=False)
      self._bar.update(0)
    else:
      self.print(f"step {step}: {_summary(scalars)}")

  def print(self, message: str) -> None:
    if not self.active:
      return
    if self._bar is not None:
      self._bar.write(message)
    else:
      print(message, flush=True)

  def flush(self) -> None:
    """Puts everything logged so far on disk (before a checkpoint: it covers these steps)."""
    if self._tb is not None:
      self._tb.flush()
    if self._jsonl is not None:
      self._jsonl.flush()

  def close(self) -> None:
    if self._trackers is not None:
      self._trackers.close()
    if self._bar is not None:
      self._bar.close()
    if self._tb is not None:
      self._tb.close()
    if self._jsonl is not None:
      self._jsonl.close()


class _EventFile:
  """TensorBoard scalars written synchronously into one event file of this writer.

  tensorboardX's SummaryWriter hands events to a thread through a queue, and its flush()
  does not drain that queue: a kill lost every step logged since its last timed flush.
  """

  def __init__(self, tb_dir: str, purge_step: int):
    from tensorboardX.event_file_writer import EventsWriter  # pylint: disable=g-import-not-at-top
    from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top
    from tensorboardX.summary import scalar  # pylint: disable=g-import-not-at-top
    os.makedirs(tb_dir, exist_ok=True)
    # The file name has only seconds: the suffix keeps two writers apart.
    self._events = EventsWriter(os.path.join(tb_dir, "events"),
                                f".{os.getpid()}.{time.monotonic_ns()}")
    self._event, self._scalar = event_pb2.Event, scalar
    # TensorBoard's purge: a session START at step S hides earlier events with step >= S.
    self._events.write_event(event_pb2.Event(
        step=purge_step, wall_time=time.time(),
        session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START)))

  def add_scalar(self, tag: str, value: float, step: int) -> None:
    self._events.write_event(self._event(step=step, wall_time=time.time(),
                                         summary=self._scalar(tag, value)))

  def flush(self) -> None:
    self._events.flush()   # to the OS and fsync'ed

  def close(self) -> None:
    self._events.close()


# Seconds between progress lines when the console is not a terminal (a log file, a pipe).
LINE_INTERVAL_S = 10.0


def _progress_bar(file, **kwargs):
  """tqdm on a terminal; elsewhere one plain line per interval (a log has no use for the
  carriage returns of a redrawn bar)."""
  isatty = getattr(file, "isatty", None)
  if isatty is not None and isatty():
    return tqdm(file=file, **kwargs)
  return _LineProgress(kwargs["total"], kwargs["initial"], kwargs["desc"], file)


class _LineProgress:
  """The part of tqdm's interface the writer uses, printing "train 40/250 (16%) ..." lines:
  the first step, then at most one line per LINE_INTERVAL_S, and the last step."""

  def __init__(self, total: int, initial: int, desc: str, file):
    self.total, self.n, self.desc, self.file = total, initial, desc, file
    self._start, self._t0 = initial, time.perf_counter()
    self._postfix, self._last_t, self._last_n = "", None, None

  def set_postfix_str(self, text: str, refresh: bool = False) -> None:
    del refresh
    self._postfix = text

  def update(self, n: int = 0) -> None:
    self.n += n
    now = time.perf_counter()
    if self._last_t is None or now - self._last_t >= LINE_INTERVAL_S or self.n >= self.total:
      self._line(now)

  def _line(self, now: float) -> None:
    if self.n == self._last_n:
      return
    elapsed, done = now - self._t0, self.n - self._start
    eta = (f", ~{(self.total - self.n) * elapsed / done:.0f} s left"
           if done > 0 and elapsed >= 1.0 else "")
    self.write(f"{self.desc} {self.n}/{self.total} ({100 * self.n / max(self.total, 1):.0f}%, "
               f"{elapsed:.0f} s{eta}): {self._postfix}")
    self._last_t, self._last_n = now, self.n

  def write(self, message: str) -> None:
    print(message, file=self.file, flush=True)

  def close(self) -> None:
    self._line(time.perf_counter())


def perplexity(loss: float) -> float:
  """exp(mean token loss): the inverse geometric mean of the target tokens' probabilities."""
  return math.exp(loss) if math.isfinite(loss) and loss < 700 else math.inf


def _to_python(value):
  if hasattr(value, "item"):
    value = value.item()
  if isinstance(value, float) and not math.isfinite(value):
    return str(value)  # JSON has no NaN/Inf; keep them visible as strings
  return value


def _summary(scalars: dict[str, Any]) -> str:
  keys = ("loss", "lr", "grad_norm", "tokens_per_s", "mfu")
  parts = []
  for key in keys:
    if key in scalars and isinstance(scalars[key], (int, float)):
      value = scalars[key]
      parts.append(f"{key} {value:.3g}" if key != "loss" else f"loss {value:.4f}")
  return ", ".join(parts)


def keep_rows_through(workdir: str, step: int) -> int:
  """Moves the metrics.jsonl rows of steps after `step` to metrics_superseded.jsonl.

  A run resumed from checkpoint `step` logs the steps after it again: without this, the
  killed run's rows of those steps would stay beside the new ones (two rows per step). The
  moved rows are kept, not deleted. A fresh start (step 0) moves every row. Returns how many
  rows moved.
  """
  path = os.path.join(workdir, rundir.METRICS_FILE)
  if not os.path.exists(path):
    return 0
  keep, drop = [], []
  with open(path) as f:
    for line in f:
      if not line.strip():
        continue
      try:
        row_step = int(json.loads(line)["step"])
      except (ValueError, KeyError, TypeError):
        drop.append(line if line.endswith("\n") else line + "\n")  # a line cut by a kill
        continue
      (keep if 0 < step and row_step <= step else drop).append(line)
  if not drop:
    return 0
  with open(os.path.join(workdir, rundir.SUPERSEDED_METRICS_FILE), "a") as f:
    f.writelines(drop)
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    f.writelines(keep)
  os.replace(tmp, path)
  return len(drop)


def _end_last_line(path: str) -> None:
  """Ends a line a killed writer left unfinished, so the next record starts a line."""
  if os.path.exists(path) and os.path.getsize(path):
    with open(path, "rb+") as f:
      f.seek(-1, os.SEEK_END)
      if f.read(1) != b"\n":
        f.write(b"\n")


def _whole_records(data: bytes) -> tuple[int, bool]:
  """(offset after the last whole TFRecord of an event file, whether the rest is a record cut
  short: fewer bytes than a header, or a sound header whose record runs past the end)."""
  from tensorboardX.record_writer import masked_crc32c  # pylint: disable=g-import-not-at-top
  pos = 0
  while pos < len(data):
    if len(data) - pos < 12:
      return pos, True
    header = data[pos:pos + 8]
    (length,), (crc,) = struct.unpack("<Q", header), struct.unpack("<I", data[pos + 8:pos + 12])
    if crc != masked_crc32c(header):
      return pos, False
    end = pos + 12 + length + 4
    if end > len(data):
      return pos, True
    (payload_crc,) = struct.unpack("<I", data[end - 4:end])
    if payload_crc != masked_crc32c(data[pos + 12:end - 4]):
      return pos, False
    pos = end
  return pos, False


def repair_event_files(tb_dir: str) -> list[str]:
  """Truncates event files that end in a record cut short (a writer killed mid-write) to
  their last whole record; returns the files repaired. Damage before the end is left."""
  repaired = []
  if not os.path.isdir(tb_dir):
    return repaired
  for name in sorted(os.listdir(tb_dir)):
    path = os.path.join(tb_dir, name)
    if "tfevents" not in name or not os.path.isfile(path):
      continue
    with open(path, "rb") as f:
      data = f.read()
    end, torn = _whole_records(data)
    if torn:
      with open(path, "r+b") as f:
        f.truncate(end)
      repaired.append(path)
  return repaired
