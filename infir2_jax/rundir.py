"""A run directory's files: metrics.jsonl (resumed steps de-duplicated), config.json, markers.

Layout of a sweep (infir2_jax.sweep) directory:
  WORKDIR/sweep.json               the sweep spec, its runs, each session's wall time
  WORKDIR/<run>/sweep_run.json     the run's grid axes and overrides
  WORKDIR/<run>/DONE | FAILED      final metrics / exit status and log tail
  WORKDIR/<run>/train.log          the trainer's output
  WORKDIR/<run>/metrics.jsonl, config.json, checkpoints/   written by the trainer
"""

import json
import os
from typing import Any

SWEEP_FILE = "sweep.json"      # WORKDIR/sweep.json: the spec, the runs, each session's wall time
RUN_FILE = "sweep_run.json"    # WORKDIR/<run>/sweep_run.json: the run's axes and overrides
DONE_FILE = "DONE"             # final metrics of a finished run
FAILED_FILE = "FAILED"         # exit status and log tail of a failed run
LOG_FILE = "train.log"         # the run's stdout and stderr


def read_json(path: str) -> dict[str, Any] | None:
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def write_json(path: str, obj) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=2, default=str)
  os.replace(tmp, path)  # atomic: a killed sweep never leaves half a marker


def read_metrics(run_dir: str) -> list[dict[str, Any]]:
  """metrics.jsonl lines with the LAST record of each (step, kind) kept, in step order.

  A resumed run re-logs the steps after its last checkpoint; the later lines win. "NaN" /
  "inf" strings (how the writer keeps non-finite numbers) become floats.
  """
  path = os.path.join(run_dir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  by_key: dict[tuple[int, bool], dict[str, Any]] = {}
  with open(path) as f:
    for line in f:
      line = line.strip()
      if not line:
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError:
        continue  # a line cut short by a kill
      record = {k: (float(v) if isinstance(v, str) and v.lower() in ("nan", "inf", "-inf")
                    else v) for k, v in record.items()}
      key = (int(record["step"]), "eval_loss" in record)
      by_key[key] = record
  return [by_key[k] for k in sorted(by_key)]


def run_status(run_dir: str) -> str:
  """"done" | "diverged" | "failed" | "partial" (started, not finished) | "new".

  A run without markers (trained from --print_commands) is done when its metrics reach the
  step count of its config.json.
  """
  if os.path.exists(os.path.join(run_dir, DONE_FILE)):
    return "done"
  failed = read_json(os.path.join(run_dir, FAILED_FILE))
  if failed is not None:
    return "diverged" if failed.get("diverged") else "failed"
  if not os.path.exists(run_dir):
    return "new"
  steps = (read_json(os.path.join(run_dir, "config.json")) or {}).get("steps")
  last = final_metrics(run_dir).get("step")
  return "done" if steps is not None and last == steps else "partial"


def final_metrics(run_dir: str) -> dict[str, Any]:
  """The last train-step record and the last eval loss of a run."""
  records = read_metrics(run_dir)
  train = [r for r in records if "loss" in r]
  evals = [r for r in records if "eval_loss" in r]
  out = dict(train[-1]) if train else {}
  if evals:
    out["eval_loss"] = evals[-1]["eval_loss"]
    out["eval_step"] = evals[-1]["step"]
  return out
