"""Sweep grid, commands, SLURM script, local runner (skip / resume / diverged) and one real run."""

import json
import os
import subprocess
import sys

import pytest

from infir2_jax.ablation import report
from infir2_jax.ablation import grid
from infir2_jax.ablation import sweep
from infir2_jax.train import rundir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A stand-in for `python -m infir2_jax.train`: counts its calls, writes metrics like the
# trainer, "diverges" for recipe diverge and dies the first time for recipe crash.
STUB = r"""
import json, os, sys
run_dir, ov = sys.argv[1], json.loads(sys.argv[2])
with open(os.path.join(run_dir, "calls"), "a") as f:
  f.write("x\n")
calls = len(open(os.path.join(run_dir, "calls")).read().split())
recipe = ov["precision.recipe"]
if recipe == "diverge":
  print("infir2_jax.train.trainer.NonFiniteLossError: non-finite loss nan at step 2")
  sys.exit(1)
if recipe == "crash" and calls == 1:
  sys.exit(137)
with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
  for s in range(1, ov["steps"] + 1):
    f.write(json.dumps({"step": s, "loss": 5.0 - s + ov["seed"]}) + "\n")
  f.write(json.dumps({"step": ov["steps"], "eval_loss": 4.5}) + "\n")
"""


def stub_command(spec, run, workdir, python):
  return [python, "-c", STUB, os.path.join(workdir, run.name), json.dumps(dict(run.overrides))]


def _calls(workdir, name):
  path = os.path.join(workdir, name, "calls")
  return len(open(path).read().split()) if os.path.exists(path) else 0


def test_expand_orders_seed_major_and_names_runs():
  spec = grid.SweepSpec.from_dict({
      "base": "configs/default.py", "overrides": {"steps": 5},
      "grid": {"precision": {"recipe": ("bf16", "infir2")}, "opt": {"lr": (1e-3, 3e-3)},
               "seed": (0, 1)}})
  runs = grid.expand(spec)
  assert len(runs) == 8
  assert [r.name for r in runs[:4]] == ["bf16-lr0.001-seed0", "bf16-lr0.003-seed0",
                                        "infir2-lr0.001-seed0", "infir2-lr0.003-seed0"]
  assert runs[-1].name == "infir2-lr0.003-seed1"
  assert dict(runs[1].overrides) == {"steps": 5, "seed": 0, "precision.recipe": "bf16",
                                     "opt.lr": 3e-3}
  # two axes ending in the same name keep their full keys; odd characters are made safe
  spec = grid.SweepSpec("", axes=(("a.x", (1,)), ("b.x", ("p/q r",))))
  assert grid.expand(spec)[0].name == "a.x1-b.xp_q_r"


def test_spec_checks_keys_and_values():
  with pytest.raises(ValueError, match="'opt.lrr' is not a train config key"):
    grid.spec_from_config({"base": "", "grid": {"opt": {"lrr": (1.0,)}}})
  with pytest.raises(ValueError, match="both in overrides and in grid"):
    grid.spec_from_config({"base": "", "overrides": {"seed": 1}, "grid": {"seed": (0, 1)}})
  with pytest.raises(ValueError, match="grid.seed must be a non-empty tuple"):
    grid.spec_from_config({"base": "", "grid": {"seed": ()}})
  with pytest.raises(ValueError, match="repeated values"):
    grid.spec_from_config({"base": "", "grid": {"seed": (1, 1)}})
  with pytest.raises(ValueError, match="unknown sweep config section"):
    grid.spec_from_config({"base": "", "grids": {}})
  spec = grid.spec_from_config({"base": "", "grid": {"precision": {"recipe": ("fp9",)}}})
  with pytest.raises(ValueError, match="run fp9: precision.recipe='fp9'; valid"):
    grid.check_runs(spec, grid.expand(spec))


def test_default_sweep_config_and_commands():
  spec = grid.load_spec(os.path.join(ROOT, "configs/sweeps/default.py"))
  runs = grid.expand(spec)
  assert len(runs) == 15
  assert {dict(r.axes)["precision.recipe"] for r in runs} == {
      "bf16", "fp8_tensorwise", "infir2", "infir2_fp32_scale", "infir2_e5m2_grad"}
  grid.check_runs(spec, runs)  # every run builds a valid TrainConfig
  argv = grid.train_command(spec, runs[7], "out")
  assert argv[:4] == ["python", "-m", "infir2_jax.train", "--config=configs/default.py"]
  assert "--config.precision.recipe=infir2" in argv and "--config.seed=1" in argv
  assert argv[-1] == "--workdir=out/infir2-seed1"
  tuple_spec = grid.SweepSpec("", overrides=(("precision.overrides", ["lm_head=bf16"]),))
  assert "--config.precision.overrides=('lm_head=bf16',)" in grid.train_command(
      tuple_spec, grid.expand(tuple_spec)[0], "w")


def test_cli_prints_commands_and_slurm_array(tmp_path):
  def cli(workdir, *args):
    out = subprocess.run(
        [sys.executable, "-m", "infir2_jax.ablation.sweep", "--config=configs/sweeps/default.py:tiny",
         f"--workdir={workdir}", "--print_commands", *args],
        cwd=ROOT, capture_output=True, text=True, check=True)
    return out.stdout
  lines = cli(tmp_path / "three_seeds", "--config.grid.seed=(0, 1, 2)").splitlines()
  assert len(lines) == 6 and all(" -m infir2_jax.train " in line for line in lines)
  script = cli(tmp_path, "--slurm")
  assert "#SBATCH --array=0-3" in script
  assert "--run_index=$SLURM_ARRAY_TASK_ID" in script
  # printing trains nothing, but leaves the metadata the report needs
  assert sorted(os.listdir(tmp_path)) == ["bf16-seed0", "bf16-seed1", "infir2-seed0",
                                          "infir2-seed1", "sweep.json", "three_seeds"]
  assert os.listdir(tmp_path / "bf16-seed0") == [sweep.RUN_FILE]
  assert sweep.run_status(str(tmp_path / "bf16-seed0")) == "partial"


def test_local_runner_skips_done_resumes_killed_and_keeps_diverged(tmp_path):
  spec = grid.SweepSpec("", overrides=(("steps", 3),),
                         axes=(("seed", (0, 1)), ("precision.recipe", ("bf16", "diverge",
                                                                       "crash"))))
  wd = str(tmp_path)
  logs = []
  status = sweep.run_sweep(spec, wd, parallel=2, command_fn=stub_command, log=logs.append)
  assert status == {"bf16-seed0": "done", "diverge-seed0": "diverged", "crash-seed0": "failed",
                    "bf16-seed1": "done", "diverge-seed1": "diverged", "crash-seed1": "failed"}
  done = json.load(open(os.path.join(wd, "bf16-seed1", sweep.DONE_FILE)))
  assert done["final"]["loss"] == 3.0 and done["final"]["eval_loss"] == 4.5
  failed = json.load(open(os.path.join(wd, "crash-seed0", sweep.FAILED_FILE)))
  assert failed["returncode"] == 137 and not failed["diverged"]
  # Second invocation: only the killed runs go again (and now finish).
  status = sweep.run_sweep(spec, wd, parallel=2, command_fn=stub_command, log=logs.append)
  assert status["crash-seed0"] == status["crash-seed1"] == "done"
  assert not os.path.exists(os.path.join(wd, "crash-seed0", sweep.FAILED_FILE))
  assert [_calls(wd, n) for n in ("bf16-seed0", "diverge-seed0", "crash-seed0")] == [1, 1, 2]
  # Third: nothing to do; --retry_failed re-runs the diverged ones only.
  sweep.run_sweep(spec, wd, command_fn=stub_command, log=logs.append)
  sweep.run_sweep(spec, wd, command_fn=stub_command, log=logs.append, retry_failed=True)
  assert [_calls(wd, n) for n in ("bf16-seed0", "diverge-seed0", "crash-seed0")] == [1, 2, 2]
  record = json.load(open(os.path.join(wd, sweep.SWEEP_FILE)))
  assert len(record["sessions"]) == 3 and len(record["runs"]) == 6
  assert any("sweep: 6 runs, 6 finished, 0 to run, 1 at a time" in line for line in logs)
  # A changed sweep must not silently resume runs trained with other overrides.
  changed = grid.SweepSpec("", overrides=(("steps", 4),), axes=spec.axes)
  with pytest.raises(ValueError, match="trained with other overrides"):
    sweep.run_sweep(changed, wd, command_fn=stub_command, log=logs.append, retry_failed=True)
  # --run_index: one run of the grid
  with pytest.raises(ValueError, match="out of range"):
    sweep.run_sweep(spec, wd, only=[6], command_fn=stub_command, log=logs.append)


def test_run_without_markers_is_done_when_its_metrics_reach_the_last_step(tmp_path):
  with open(tmp_path / "config.json", "w") as f:
    json.dump({"steps": 3}, f)
  with open(tmp_path / "metrics.jsonl", "w") as f:
    f.write('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 2, "eval_loss": 1.7}\n')
  assert sweep.run_status(str(tmp_path)) == "partial"
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 3, "loss": 1.0}\n{"step": 3, "eval_loss": "NaN"}\n{"step": 4, "lo')
  assert sweep.run_status(str(tmp_path)) == "done"  # a line cut short by a kill is ignored
  final = rundir.final_metrics(str(tmp_path))
  assert final["loss"] == 1.0 and final["eval_step"] == 3
  assert final["eval_loss"] != final["eval_loss"]  # "NaN" read back as a float NaN


@pytest.mark.slow
def test_real_sweep_trains_and_reports(tmp_path, monkeypatch):
  """Two 2-step runs of a shrunken default model through `python -m infir2_jax.train`."""
  monkeypatch.setenv("XLA_FLAGS", "")  # one CPU device in the runs, not conftest's 8
  monkeypatch.chdir(tmp_path)  # the base config is found from any directory
  spec = grid.spec_from_config({
      "base": "configs/default.py:smoke",
      "overrides": {"steps": 2, "batch_size": 2, "seq_len": 32, "eval": {"every_steps": 2,
                                                                        "batches": 1},
                    "checkpoint": {"every_steps": 0}, "log": {"tensorboard": False},
                    "model": {"hidden_size": 128, "intermediate_size": 128, "num_layers": 1,
                              "num_heads": 2, "num_kv_heads": 1}},
      "grid": {"precision": {"recipe": ("bf16", "infir2")}, "seed": (0,)}})
  runs = grid.expand(spec)
  grid.check_runs(spec, runs)
  status = sweep.run_sweep(spec, str(tmp_path), parallel=2, log=lambda _: None)
  logs = {r.name: open(tmp_path / r.name / sweep.LOG_FILE).read()[-2000:] for r in runs}
  assert status == {"bf16-seed0": "done", "infir2-seed0": "done"}, logs
  for run in runs:
    config = json.load(open(tmp_path / run.name / "config.json"))
    assert config["precision"]["recipe"] == dict(run.axes)["precision.recipe"]
    assert config["model"]["hidden_size"] == 128 and config["steps"] == 2
  loaded = report.load_runs(str(tmp_path))
  assert [r.steps.tolist() for r in loaded] == [[1, 2], [1, 2]]
  path = report.make_report(str(tmp_path), plots=False, last_k=1)
  assert "| `infir2` | **no verdict** (1 paired seed(s) < min_seeds 3; runs of 2 steps" in \
      open(path).read()
