"""Sweep report along another axis than the recipe (report.compare, e.g. opt.moments)."""

import csv
import json
import os

import numpy as np
import pytest

from infir2_jax.ablation import report
from infir2_jax.ablation import sweep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _write_run(root, moments, seed, offset):
  """A finished run of the moments sweep: recipe fixed (in config.json), moments on the grid."""
  name = f"moments{moments}-seed{seed}"
  d = os.path.join(root, name)
  os.makedirs(d)
  steps = np.arange(1, 31)
  loss = 5.0 + np.exp(-steps / 8) + 0.01 * seed + offset
  lines = [{"step": int(s), "loss": float(v)} for s, v in zip(steps, loss)]
  lines.append({"step": 30, "eval_loss": float(loss[-1] + 0.1)})
  with open(os.path.join(d, "metrics.jsonl"), "w") as f:
    f.write("\n".join(json.dumps(r) for r in lines) + "\n")
  with open(os.path.join(d, "config.json"), "w") as f:
    json.dump({"seed": seed, "precision": {"recipe": "infir2"}, "opt": {"moments": moments}}, f)
  with open(os.path.join(d, sweep.RUN_FILE), "w") as f:
    json.dump({"name": name, "axes": {"seed": seed, "opt.moments": moments}, "overrides": {}},
              f)
  with open(os.path.join(d, sweep.DONE_FILE), "w") as f:
    json.dump({"wall_s": 5.0}, f)


@pytest.fixture
def moments_sweep(tmp_path):
  root = str(tmp_path)
  for seed in (0, 1, 2):
    _write_run(root, "fp32", seed, 0.0)
    _write_run(root, "bf16", seed, 0.0001 * (seed - 1))   # equivalent
    _write_run(root, "fp8", seed, 0.5)                    # clearly worse
  return root


def test_compare_axis_groups_and_references_by_that_axis(moments_sweep):
  runs = report.load_runs(moments_sweep, "opt.moments")
  assert {r.recipe for r in runs} == {"fp32", "bf16", "fp8"} and {r.group for r in runs} == {()}
  (rows,) = report.summarize(runs, "fp32", last_k=5).values()
  by = {r.recipe: r for r in rows}
  assert rows[0].recipe == "fp32"
  assert by["fp8"].d_val.mean == pytest.approx(0.5)
  assert by["bf16"].tost_val.equivalent and not by["fp8"].tost_val.equivalent
  # the recipe axis (the default) sees one recipe here, so fp32 is no recipe of it
  with pytest.raises(ValueError, match="reference recipe 'fp32' has no runs"):
    report.summarize(report.load_runs(moments_sweep), "fp32")


def test_make_report_takes_compare_from_the_sweep_record(moments_sweep):
  with open(os.path.join(moments_sweep, sweep.SWEEP_FILE), "w") as f:
    json.dump({"spec": {"base": "configs/default.py", "grid": {"opt.moments": ["fp32"]},
                        "report": {"compare": "opt.moments", "reference": "fp32"}}}, f)
  path = report.make_report(moments_sweep, plots=False)
  text = open(path).read()
  assert "| opt.moments | seeds |" in text and "| `fp8` |" in text
  with open(os.path.join(moments_sweep, "runs.csv")) as f:
    assert {row["recipe"] for row in csv.DictReader(f)} == {"fp32", "bf16", "fp8"}


def test_moments_sweep_config_is_the_default_sweep_over_opt_moments():
  from infir2_jax.ablation import grid  # pylint: disable=import-outside-toplevel
  spec = grid.load_spec(os.path.join(ROOT, "configs/sweeps/moments.py"))
  default = grid.load_spec(os.path.join(ROOT, "configs/sweeps/default.py"))
  runs = grid.expand(spec)
  assert len(runs) == 9 and dict(spec.axes) == {"seed": (0, 1, 2),
                                                "opt.moments": ("fp32", "bf16", "fp8")}
  overrides = dict(spec.overrides)
  assert overrides.pop("precision.recipe") == "infir2"
  assert overrides.pop("precision.telemetry_every_steps") == 0
  base = dict(default.overrides)
  base.pop("precision.telemetry_every_steps")
  assert overrides == base   # the same steps, batches, warm-up, eval and checkpoints
  assert dict(spec.report)["compare"] == "opt.moments" and dict(spec.report)["reference"] == "fp32"
  grid.check_runs(spec, runs)
