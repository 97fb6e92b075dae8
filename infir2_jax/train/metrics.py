"""Metrics sinks: a console progress bar, TensorBoard event files and WORKDIR/metrics.jsonl."""

import json
import math
import os
import sys
import time
from typing import Any

import jax
from tqdm.auto import tqdm

from infir2_jax.config import LogConfig
from infir2_jax.train import rundir

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

  def __init__(self, workdir: str, cfg: LogConfig, total_steps: int, start_step: int = 0):
    self.cfg = cfg
    self.active = jax.process_index() == 0
    self._jsonl = self._tb = self._bar = None
    if not self.active:
      return
    os.makedirs(workdir, exist_ok=True)
    self._jsonl = open(os.path.join(workdir, rundir.METRICS_FILE), "a", buffering=1)
    if cfg.tensorboard:
      try:
        from tensorboardX import SummaryWriter
        self._tb = SummaryWriter(os.path.join(workdir, rundir.TENSORBOARD_DIR))
      except ImportError:
        print("tensorboardX is not installed: no TensorBoard event files", file=sys.stderr)
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
    if not console:
      return
    if "eval_loss" in scalars:
      self.print(f"step {step}: eval_loss {scalars['eval_loss']:.4f}")
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

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()
    if self._tb is not None:
      self._tb.close()
    if self._jsonl is not None:
      self._jsonl.close()


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
