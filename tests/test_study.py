"""The sliced study: budget planning, skip, export, kills, the README; one real tiny grid (slow)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from infir2_jax.ablation import grid
from infir2_jax.ablation import report
from infir2_jax.ablation import results as results_lib
from infir2_jax.ablation import study
from infir2_jax.ablation import study_report
from infir2_jax.ablation import sweep
from infir2_jax.train import rundir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable

# A stand-in for the trainer: sleeps, writes metrics like it (loss, eval, FP8 telemetry at
# two steps, every line flushed), counts its calls; infir2 is 0.1% worse than bf16.
STUB = r"""
import json, os, sys, time
run_dir, ov, sleep_s = sys.argv[1], json.loads(sys.argv[2]), float(sys.argv[3])
with open(os.path.join(run_dir, "calls"), "a") as f:
  f.write("x\n")
steps, seed, fp8 = ov["steps"], ov["seed"], ov["precision.recipe"] != "bf16"
with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
  for s in range(1, steps + 1):
    time.sleep(sleep_s / steps)
    rec = {"step": s, "loss": (3.0 + 0.01 * seed) * (1.001 if fp8 else 1.0) + 1.0 / s}
    if fp8 and s in (steps // 2, steps):
      rec["fp8/layers_0/mlp/down_proj/wgrad/dy/flush_frac"] = 0.2 + 0.001 * s
      rec["fp8/layers_0/mlp/down_proj/wgrad/dy/snr_db"] = 20.0
      rec["fp8/layers_0/mlp/down_proj/wgrad/dy/amax"] = 1.0
      rec["fp8/worst/wgrad/dy/max_flush_frac"] = 0.2 + 0.001 * s
      rec["fp8/worst/wgrad/dy/min_snr_db"] = 20.0
    f.write(json.dumps(rec) + "\n")
    f.flush()
  f.write(json.dumps({"step": steps, "eval_loss": (3.1 + 0.01 * seed)
                      * (1.001 if fp8 else 1.0)}) + "\n")
"""


def stub(sleep_s, source=STUB):
  def command(spec, run, workdir, python):
    return [python, "-c", source, os.path.join(workdir, run.name),
            json.dumps(dict(run.overrides)), str(sleep_s)]
  return command


def _spec(seeds=(0, 1, 2), recipes=("bf16", "infir2"), steps=30):
  return grid.SweepSpec("", overrides=(("steps", steps),),
                        axes=(("seed", seeds), ("precision.recipe", recipes)))


def _calls(workdir, name):
  path = os.path.join(workdir, name, "calls")
  return len(open(path).read().split()) if os.path.exists(path) else 0


def _finished(results_dir):
  return sorted(n for n in os.listdir(results_dir) if results_lib.is_finished(results_dir, n))


def test_slices_fit_the_budget_skip_finished_runs_and_export(tmp_path):
  res, work = str(tmp_path / "runs"), str(tmp_path / "work")
  spec = _spec()
  names = [r.name for r in grid.expand(spec)]
  # Nothing measured: the first wave (one run per slot) measures, whatever the budget.
  study.run_study(spec, res, work, budget_s=0.01, grace_s=60, parallel=2,
                  command_fn=stub(1.0), log=lambda *_: None)
  assert _finished(res) == sorted(names[:2])
  walls = [rundir.read_json(os.path.join(res, n, sweep.DONE_FILE))["wall_s"] for n in names[:2]]
  assert all(w >= 1.0 for w in walls)
  # Budget for one run per slot: exactly the next two runs of the grid, in grid order.
  study.run_study(spec, res, work, budget_s=1.5 * max(walls), grace_s=60, parallel=2,
                  command_fn=stub(1.0), log=lambda *_: None)
  assert _finished(res) == sorted(names[:4])
  study.run_study(spec, res, work, budget_s=1e4, parallel=2, command_fn=stub(1.0),
                  log=lambda *_: None)
  assert _finished(res) == sorted(names)
  assert all(_calls(work, n) == 1 for n in names)   # finished runs never ran again
  # The export: metrics without telemetry keys, the telemetry compact, no checkpoints.
  run = os.path.join(res, "infir2-seed0")
  assert sorted(os.listdir(run)) == sorted([sweep.DONE_FILE, sweep.RUN_FILE,
                                            rundir.METRICS_FILE, results_lib.TELEMETRY_FILE])
  lines = [json.loads(x) for x in open(os.path.join(run, rundir.METRICS_FILE))]
  assert len(lines) == 31 and not any(k.startswith("fp8/") for x in lines for k in x)
  raw = [json.loads(x) for x in open(os.path.join(work, "infir2-seed0", rundir.METRICS_FILE))]
  want = [{k: v for k, v in r.items() if k.startswith("fp8/") and not k.endswith("amax")}
          for r in raw if any(k.startswith("fp8/") for k in r)]
  got = [{k: v for k, v in r.items() if k != "step"}
         for r in results_lib.read_telemetry(run)]
  assert len(got) == len(want) == 2
  for g, w in zip(got, want):   # kept to 5 significant digits
    assert g.keys() == w.keys() and all(g[k] == pytest.approx(w[k], rel=1e-5) for k in w)
  record = rundir.read_json(os.path.join(res, sweep.SWEEP_FILE))
  assert record["runs"] == names and len(record["sessions"]) == 3
  assert [len(x["runs"]) for x in record["sessions"]] == [2, 2, 2]
  # A dry plan of a finished grid is empty.
  assert study.plan([], res, work, 100.0, 2) == ([], 0.0)


def test_estimates_scale_with_runs_sharing_the_device(tmp_path):
  res = str(tmp_path)
  for name, recipe, wall, k in (("a", "bf16", 100.0, 1), ("b", "infir2", 300.0, 2)):
    os.makedirs(os.path.join(res, name))
    rundir.write_json(os.path.join(res, name, sweep.DONE_FILE), {"wall_s": wall, "parallel": k})
    rundir.write_json(os.path.join(res, name, sweep.RUN_FILE),
                      {"axes": {"precision.recipe": recipe}})
  run = lambda recipe: grid.Run(recipe, (("precision.recipe", recipe),), ())
  assert study.estimate_s(run("bf16"), res, 1) == 100.0
  assert study.estimate_s(run("bf16"), res, 4) == 400.0    # 4 share what 1 had alone
  assert study.estimate_s(run("infir2"), res, 1) == 300.0  # never scaled down
  assert study.estimate_s(run("infir2_e5m2_grad"), res, 2) == 300.0  # another recipe's worst
  pending = [run("bf16"), run("infir2"), run("bf16")]
  # With 2 at once bf16 takes 200 s: bf16 | infir2 on the two slots, then bf16 after bf16.
  chosen, est = study.plan(pending, res, str(tmp_path / "w"), 380.0, 2)
  assert [r.name for r in chosen] == ["bf16", "infir2"] and est == 300.0  # 400 > 380
  chosen, est = study.plan(pending, res, str(tmp_path / "w"), 420.0, 2)
  assert len(chosen) == 3 and est == 400.0


def test_estimates_take_runs_finished_in_one_attempt_first(tmp_path):
  """A run resumed after a stop records the sum of its attempts; that is no run's time, and
  (session 19's 772 s against 270-409) it made 420-s slices plan nothing."""
  res = str(tmp_path)
  for name, recipe, wall, attempts in (("a", "bf16", 270.0, 1), ("b", "infir2", 409.0, 1),
                                       ("c", "infir2_fp32_scale", 772.0, 2)):
    os.makedirs(os.path.join(res, name))
    rundir.write_json(os.path.join(res, name, sweep.DONE_FILE),
                      {"wall_s": wall, "parallel": 4, "attempts": attempts})
    rundir.write_json(os.path.join(res, name, sweep.RUN_FILE),
                      {"axes": {"precision.recipe": recipe}})
  run = lambda recipe: grid.Run(recipe, (("precision.recipe", recipe),), ())
  assert study.estimate_s(run("infir2_wgrad_dy_bf16"), res, 4) == 409.0  # not 772
  assert study.estimate_s(run("infir2_fp32_scale"), res, 4) == 409.0     # its own: resumed
  assert study.estimate_s(run("bf16"), res, 4) == 270.0
  pending = [run(r) for r in ("infir2_wgrad_dy_bf16", "bf16", "infir2", "infir2_fp32_scale")]
  chosen, est = study.plan(pending, res, str(tmp_path / "w"), 420.0, 4)
  assert len(chosen) == 4 and est == 409.0
  os.remove(os.path.join(res, "a", sweep.DONE_FILE))
  os.remove(os.path.join(res, "b", sweep.DONE_FILE))   # only the resumed run is left
  assert study.estimate_s(run("bf16"), res, 4) == 772.0


def test_kill_leaves_no_half_written_result_and_the_next_call_finishes(tmp_path):
  res, work = str(tmp_path / "runs"), str(tmp_path / "work")
  spec = _spec(seeds=(0,))
  tests = os.path.dirname(os.path.abspath(__file__))
  code = (f"import sys; sys.path[:0] = [{ROOT!r}, {tests!r}]\n"
          "import test_study as t\nfrom infir2_jax.ablation import study\n"
          f"study.run_study(t._spec(seeds=(0,)), {res!r}, {work!r}, budget_s=1e4, parallel=1, "
          "command_fn=t.stub(30.0))\n")
  proc = subprocess.Popen([PY, "-c", code], start_new_session=True, cwd=ROOT,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  metrics = os.path.join(work, "bf16-seed0", rundir.METRICS_FILE)
  deadline = time.time() + 60
  while not (os.path.exists(metrics) and os.path.getsize(metrics)) and time.time() < deadline:
    time.sleep(0.2)
  os.killpg(proc.pid, signal.SIGKILL)   # the study and its trainer, mid-run
  proc.wait()
  assert os.path.exists(metrics), "the run never started"
  assert _finished(res) == [] and not os.path.exists(os.path.join(res, "bf16-seed0"))
  # An export killed before its rename leaves only a hidden partial folder: not a result.
  os.makedirs(os.path.join(res, results_lib.PARTIAL_PREFIX + "bf16-seed0-1"))
  with open(os.path.join(res, results_lib.PARTIAL_PREFIX + "bf16-seed0-1", "metrics.jsonl"),
            "w") as f:
    f.write('{"step": 1, "loss": 3.0}\n')
  assert not results_lib.is_finished(res, "bf16-seed0")
  study.run_study(spec, res, work, budget_s=1e4, parallel=2, command_fn=stub(0.5),
                  log=lambda *_: None)
  assert _finished(res) == ["bf16-seed0", "infir2-seed0"]
  assert not [n for n in os.listdir(res) if n.startswith(".")]
  assert _calls(work, "bf16-seed0") == 2          # the killed run ran again


def test_a_run_stopped_at_the_budget_resumes_and_counts_every_attempt(tmp_path):
  res, work = str(tmp_path / "runs"), str(tmp_path / "work")
  spec = _spec(seeds=(0,), recipes=("bf16",))
  t0 = time.perf_counter()
  study.run_study(spec, res, work, budget_s=0.01, grace_s=1.0, command_fn=stub(20.0),
                  log=lambda *_: None)
  assert time.perf_counter() - t0 < 15             # stopped (SIGTERM), not run to its end
  assert _finished(res) == [] and sweep.run_status(os.path.join(work, "bf16-seed0")) == "partial"
  study.run_study(spec, res, work, budget_s=1e4, command_fn=stub(0.5), log=lambda *_: None)
  done = rundir.read_json(os.path.join(res, "bf16-seed0", sweep.DONE_FILE))
  assert done["attempts"] == 2 and done["wall_s"] >= 1.0 + 0.5
  assert _calls(work, "bf16-seed0") == 2


def test_export_is_atomic(tmp_path, monkeypatch):
  run_dir, res = tmp_path / "run", tmp_path / "res"
  os.makedirs(run_dir)
  os.makedirs(res)
  (run_dir / rundir.METRICS_FILE).write_text('{"step": 1, "loss": 2.0}\n')
  rundir.write_json(str(run_dir / sweep.DONE_FILE), {"name": "r"})

  def dies(*a):
    raise KeyboardInterrupt("killed")
  monkeypatch.setattr(results_lib.os, "replace", dies)
  with pytest.raises(KeyboardInterrupt):
    results_lib.export_run(str(run_dir), str(res), "r", {})
  assert not os.path.exists(res / "r") and not results_lib.is_finished(str(res), "r")
  monkeypatch.undo()
  assert results_lib.remove_partial(str(res)) and os.listdir(res) == []
  results_lib.export_run(str(run_dir), str(res), "r", {"wall_s": 1.0})
  assert results_lib.is_finished(str(res), "r")


def test_study_configs_load_and_refuse_telemetry_that_is_never_logged(tmp_path):
  spec, settings = study.load_study(os.path.join(ROOT, "configs", "study_smollm2.py"))
  runs = grid.expand(spec)
  assert len(runs) == 15 and settings["parallel"] == 4
  assert {dict(r.axes)["precision.recipe"] for r in runs} >= {"bf16", "infir2_wgrad_dy_bf16"}
  grid.check_runs(spec, runs)
  path = tmp_path / "s.py"
  path.write_text("import ml_collections\n"
                  "def get_config(v=None):\n"
                  "  return ml_collections.ConfigDict(dict(base='', overrides=dict(\n"
                  "      precision=dict(telemetry_every_steps=15), log=dict(every_steps=10)),\n"
                  "      grid=dict(seed=(0,)), study=dict(parallel=2)))\n")
  with pytest.raises(study.StudyError, match="no multiple of log.every_steps=10"):
    study.load_study(str(path))


def test_results_of_another_grid_are_refused(tmp_path):
  res, work = str(tmp_path / "runs"), str(tmp_path / "work")
  study.run_study(_spec(seeds=(0,), recipes=("bf16",), steps=20), res, work, budget_s=1e4,
                  command_fn=stub(0.0), log=lambda *_: None)
  with pytest.raises(study.StudyError, match="another grid"):
    study.run_study(_spec(seeds=(0,), recipes=("bf16",), steps=40), res, work, budget_s=1e4,
                    command_fn=stub(0.0), log=lambda *_: None)


def test_readme_rebuilds_from_partial_and_full_grids(tmp_path):
  res, work, out = str(tmp_path / "runs"), str(tmp_path / "work"), str(tmp_path / "report")
  spec = _spec(recipes=("bf16", "infir2", "infir2_wgrad_dy_bf16"))
  assert "0 of 0 runs" in open(study_report.build(res, out)).read()   # nothing yet
  study.run_study(spec, res, work, budget_s=0.01, grace_s=60, parallel=2,
                  command_fn=stub(0.0), log=lambda *_: None)
  text = open(study_report.build(res, out)).read()
  assert "**2 of 9 runs of the grid are done**" in text and "provisional" in text
  assert "no verdict yet" in text
  study.run_study(spec, res, work, budget_s=1e4, parallel=2, command_fn=stub(0.0),
                  log=lambda *_: None)
  text = open(study_report.build(res, out, "configs/x.py")).read()
  assert "**9 of 9 runs of the grid are done** — the grid is complete." in text
  assert "provisional" not in text
  # The verdict is report.summarize's: infir2 is 0.1% worse on every seed, inside 1%.
  runs = report.load_runs(res)
  rows = report.summarize(runs, "bf16", last_k=10)[()]
  infir2 = next(r for r in rows if r.recipe == "infir2")
  assert f"validation loss {infir2.d_val.mean:+.4f}" in text
  assert "`infir2`: validation loss" in text and "**equivalent**" in text
  assert "`infir2` − `infir2_wgrad_dy_bf16`" in text        # the underflow pair
  assert "| `infir2` | 21.5% | 23% |" in text                  # worst wgrad dY over training
  assert "Device time spent" in text and "| 2 |" in text
  for name in ("loss_curves.png", "loss_diff.png", "telemetry_flush_frac.png", "report.md",
               "runs.csv"):
    assert os.path.exists(os.path.join(out, name)), name
  assert "In plain words" not in text     # train and validation loss agree here


def test_readme_says_when_train_and_validation_loss_disagree(tmp_path):
  """FP8 3% worse on its training text but 0.1% better held out (the GPU study's pattern,
  smaller): every verdict line carries the train loss's TOST, and a plain-words paragraph
  says the recipe is lossless on held-out loss only, with the train/validation gap."""
  res, work, out = str(tmp_path / "runs"), str(tmp_path / "work"), str(tmp_path / "report")
  source = STUB.replace("* (1.001 if fp8 else 1.0) + 1.0 / s", "* (1.03 if fp8 else 1.0) + 1.0 / s")
  source = source.replace("* (1.001 if fp8 else 1.0)}", "* (0.999 if fp8 else 1.0)}")
  assert source.count("1.03") == 1 and source.count("0.999") == 1
  for _ in range(2):   # the first slice runs one batch of runs to measure their time
    study.run_study(_spec(), res, work, budget_s=1e4, parallel=3,
                    command_fn=stub(0.0, source), log=lambda *_: None)
  assert len(_finished(res)) == 6
  text = open(study_report.build(res, out)).read()
  rows = report.summarize(report.load_runs(res), "bf16", last_k=10)[()]
  infir2, bf16 = (next(r for r in rows if r.recipe == n) for n in ("infir2", "bf16"))
  rel_t = 100 * infir2.d_train.mean / bf16.train.mean
  assert 2.5 < rel_t < 3.0                    # 3% of the loss without its 1/s transient
  assert (f"Train loss {infir2.d_train.mean:+.4f} ({rel_t:+.2f}%)" in text
          and "**not equivalent**" in text)
  assert "validation loss" in text and "TOST at ±1%: **equivalent**" in text
  plain = next(line for line in text.splitlines() if line.startswith("In plain words"))
  assert f"worse by {rel_t:+.2f}% to {rel_t:+.2f}%" in plain
  assert f"({bf16.train.mean:.3f}) sits far below its validation loss ({bf16.val.mean:.3f})" \
      in plain


@pytest.mark.slow
def test_tiny_study_end_to_end_with_a_kill(tmp_path):
  """The real trainer: a slice stopped by its budget, a SIGKILL mid-run, a resume."""
  res, work = str(tmp_path / "gpu_study" / "runs"), str(tmp_path / "work")
  cmd = [PY, "-m", "infir2_jax.ablation.study", "--study=configs/study_smollm2.py:tiny",
         f"--results={res}", f"--workdir={work}"]
  # One CPU device per trainer (conftest's 8 fake devices would shard the tiny batch).
  env = dict(os.environ, INFIR2_COMPILATION_CACHE=str(tmp_path / "cache"), XLA_FLAGS="")
  # Nothing measured: the first wave of 2 runs measures; the budget stops it there.
  subprocess.run(cmd + ["--budget_s=1", "--grace_s=900"], cwd=ROOT, env=env, check=True,
                 timeout=900, capture_output=True)
  assert _finished(res) == ["bf16-seed0", "infir2-seed0"]
  assert os.path.exists(os.path.join(res, "infir2-seed0", results_lib.TELEMETRY_FILE))
  text = open(os.path.join(tmp_path, "gpu_study", "README.md")).read()
  assert "**2 of 4 runs of the grid are done**" in text
  # The next slice, killed once bf16-seed1 has checkpointed a step.
  proc = subprocess.Popen(cmd + ["--budget_s=1000"], cwd=ROOT, env=env, start_new_session=True,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  run_dir = os.path.join(work, "bf16-seed1")
  deadline = time.time() + 600
  while time.time() < deadline and not (os.path.isdir(run_dir)
                                        and rundir.checkpoint_steps(run_dir)):
    time.sleep(0.5)
  os.killpg(proc.pid, signal.SIGKILL)
  proc.wait()
  assert rundir.checkpoint_steps(run_dir), "bf16-seed1 never checkpointed"
  assert not results_lib.is_finished(res, "bf16-seed1")
  assert not os.path.exists(os.path.join(res, "bf16-seed1"))   # nothing half-written
  subprocess.run(cmd + ["--budget_s=1000"], cwd=ROOT, env=env, check=True, timeout=900,
                 capture_output=True)
  assert _finished(res) == ["bf16-seed0", "bf16-seed1", "infir2-seed0", "infir2-seed1"]
  raw = [json.loads(x) for x in open(os.path.join(run_dir, rundir.METRICS_FILE))]
  assert sum(r["step"] == 1 and "loss" in r for r in raw) == 1   # resumed, not restarted
  text = open(os.path.join(tmp_path, "gpu_study", "README.md")).read()
  assert "**4 of 4 runs of the grid are done** — the grid is complete." in text
  assert not any(f.startswith("checkpoint") for _, dirs, files in os.walk(res)
                 for f in dirs + files)
