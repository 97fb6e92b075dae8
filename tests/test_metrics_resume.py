"""metrics.jsonl after a resume: one row per step; the interrupted run's later rows kept aside."""

import json
import os

from infir2_jax.config import LogConfig
from infir2_jax.train import rundir
from infir2_jax.train.metrics import MetricsWriter


def _rows(path):
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def _killed_run(workdir, last_step):
  """What a run killed after step `last_step` leaves: train rows, evals at 0 and 4, a cut line."""
  with open(os.path.join(workdir, rundir.METRICS_FILE), "w") as f:
    f.write(json.dumps({"step": 0, "eval_loss": 9.0}) + "\n")
    for step in range(1, last_step + 1):
      f.write(json.dumps({"step": step, "loss": 10.0 - step}) + "\n")
      if step == 4:
        f.write(json.dumps({"step": 4, "eval_loss": 7.5}) + "\n")
    f.write('{"step": 7, "lo')   # the kill cut this one


def test_resume_keeps_one_row_per_step(tmp_path):
  workdir = str(tmp_path)
  _killed_run(workdir, last_step=6)
  cfg = LogConfig(tensorboard=False, progress_bar=False)
  writer = MetricsWriter(workdir, cfg, total_steps=8, start_step=4)   # resumed from 4
  for step in (5, 6, 7, 8):
    writer.write(step, {"loss": 1.0 * step}, console=False)
  writer.close()
  rows = _rows(os.path.join(workdir, rundir.METRICS_FILE))
  keys = [(r["step"], "eval_loss" in r) for r in rows]
  assert len(keys) == len(set(keys)), keys                  # no step twice
  assert [r["step"] for r in rows if "loss" in r] == list(range(1, 9))
  assert [r["loss"] for r in rows if r["step"] > 4] == [5.0, 6.0, 7.0, 8.0]   # the new rows
  assert [r["step"] for r in rows if "eval_loss" in r] == [0, 4]
  # The killed run's steps 5 and 6 (and its cut line) are kept aside, not lost.
  with open(os.path.join(workdir, rundir.SUPERSEDED_METRICS_FILE)) as f:
    moved = f.read().splitlines()
  assert [json.loads(x)["step"] for x in moved[:2]] == [5, 6] and moved[2].startswith('{"step": 7')


def test_a_fresh_start_moves_every_earlier_row(tmp_path):
  """No checkpoint restored (killed before the first, or all damaged): the run starts over."""
  workdir = str(tmp_path)
  _killed_run(workdir, last_step=3)
  writer = MetricsWriter(workdir, LogConfig(tensorboard=False, progress_bar=False), 8, 0)
  writer.write(0, {"eval_loss": 9.5}, console=False)
  writer.close()
  assert _rows(os.path.join(workdir, rundir.METRICS_FILE)) == [{"step": 0, "eval_loss": 9.5}]
  assert len(open(os.path.join(workdir, rundir.SUPERSEDED_METRICS_FILE)).read().splitlines()) == 5
