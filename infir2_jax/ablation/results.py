"""A study's committed results folder: each finished run's metrics and telemetry, no checkpoints.

  RESULTS/sweep.json            the spec, the runs and every session's wall time (the format
                                of ablation/sweep.py, plus each session's budget and device)
  RESULTS/<run>/DONE            final metrics, wall time, runs sharing the device, device
                                (FAILED instead for a run that diverged)
  RESULTS/<run>/config.json     the trainer's config of the run
  RESULTS/<run>/sweep_run.json  the run's grid axes and overrides
  RESULTS/<run>/metrics.jsonl   the train and eval lines, FP8 telemetry keys removed
  RESULTS/<run>/telemetry.json  the telemetry compact: {"steps", "keys", "values"[key][step]}

A run's folder is written under RESULTS/.partial-<run>-<pid>/ and renamed into place last,
so a run's folder is either complete or absent, however the writer dies (leftovers of a
killed writer are removed by `remove_partial`). It has the layout of a sweep's run
directory, so ablation/report.py reads RESULTS like a sweep directory.
"""

import json
import math
import os
import shutil

from infir2_jax.ablation import sweep
from infir2_jax.train import rundir

TELEMETRY_FILE = "telemetry.json"
PARTIAL_PREFIX = ".partial-"
# Telemetry kept: the flush-to-zero fraction and SNR of every quantized operand and the worst
# layer's (amax is left out: it is a third of the keys and no statistic reads it).
TELEMETRY_STATS = ("flush_frac", "snr_db")   # key endings; fp8/worst/* has max_/min_ ones
_DIGITS = 5   # significant digits of the committed telemetry (SNR to 1e-4 dB at 10-99 dB)


def is_finished(results_dir: str, name: str) -> bool:
  """The run is in the results: finished, or diverged (a result too; never retried)."""
  return sweep.run_status(os.path.join(results_dir, name)) in ("done", "diverged")


def remove_partial(results_dir: str) -> list[str]:
  """Removes the half-written run folders a killed writer left; returns their names."""
  if not os.path.isdir(results_dir):
    return []
  left = [n for n in os.listdir(results_dir) if n.startswith(PARTIAL_PREFIX)]
  for name in left:
    shutil.rmtree(os.path.join(results_dir, name), ignore_errors=True)
  return left


def _round(v):
  if isinstance(v, float):
    if not math.isfinite(v):
      return str(v)   # "nan" / "inf", as the trainer's metrics.jsonl writes them
    return float(f"{v:.{_DIGITS}g}")
  return v


def _is_telemetry(key: str) -> bool:
  return key.startswith("fp8/")


def split_metrics(records: list[dict]) -> tuple[list[dict], dict]:
  """(metrics lines without telemetry keys, the compact telemetry) of read_metrics' records."""
  lines, steps, columns = [], [], {}
  for r in records:
    lines.append({k: _round(v) for k, v in r.items() if not _is_telemetry(k)})
    kept = {k: v for k, v in r.items() if _is_telemetry(k) and k.endswith(TELEMETRY_STATS)}
    if not kept:
      continue
    for k in kept:
      columns.setdefault(k, [None] * len(steps))
    steps.append(int(r["step"]))
    for k, col in columns.items():
      col.append(_round(kept.get(k)))
  keys = sorted(columns)
  return lines, {"steps": steps, "keys": keys, "values": [columns[k] for k in keys]}


def read_telemetry(run_dir: str) -> list[dict]:
  """telemetry.json as the records ablation/report.py keeps ({"step", "fp8/...": value})."""
  data = rundir.read_json(os.path.join(run_dir, TELEMETRY_FILE))
  if not data:
    return []
  out = []
  for i, step in enumerate(data["steps"]):
    row = {"step": step}
    for key, col in zip(data["keys"], data["values"]):
      v = col[i]
      if v is not None:
        row[key] = float(v) if isinstance(v, str) else v
    out.append(row)
  return out


def export_run(run_dir: str, results_dir: str, name: str, extra: dict) -> str:
  """Copies a finished run's small files into RESULTS/<name>/ atomically; returns that path.

  extra: what DONE records besides the run's own marker (wall time, parallel, device).
  """
  dest = os.path.join(results_dir, name)
  tmp = os.path.join(results_dir, f"{PARTIAL_PREFIX}{name}-{os.getpid()}")
  shutil.rmtree(tmp, ignore_errors=True)
  os.makedirs(tmp)
  for fname in (rundir.CONFIG_FILE, sweep.RUN_FILE):
    if os.path.exists(os.path.join(run_dir, fname)):
      shutil.copyfile(os.path.join(run_dir, fname), os.path.join(tmp, fname))
  lines, telemetry = split_metrics(rundir.read_metrics(run_dir))
  with open(os.path.join(tmp, rundir.METRICS_FILE), "w") as f:
    f.writelines(json.dumps(line, sort_keys=True) + "\n" for line in lines)
  if telemetry["steps"]:
    with open(os.path.join(tmp, TELEMETRY_FILE), "w") as f:
      json.dump(telemetry, f, separators=(",", ":"))
  # The run's marker: DONE, or FAILED for a run that diverged.
  marker = (sweep.FAILED_FILE if sweep.run_status(run_dir) == "diverged" else sweep.DONE_FILE)
  record = dict(rundir.read_json(os.path.join(run_dir, marker)) or {"name": name})
  record.update(extra)
  rundir.write_json(os.path.join(tmp, marker), record)
  if os.path.exists(dest):   # an older export of the same run (re-exported on purpose)
    shutil.rmtree(dest)
  os.replace(tmp, dest)      # the folder appears complete, or not at all
  return dest
