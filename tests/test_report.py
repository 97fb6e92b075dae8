"""Sweep report on synthetic run directories: numbers against scipy, verdicts, plots, csv."""

import csv
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from scipy import stats as sps

from infir2_jax.ablation import plots
from infir2_jax.ablation import report
from infir2_jax.ablation import sweep
from infir2_jax.train import rundir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEEDS = (0, 1, 2)
STEPS = 40
PATHS = [f"layers_{i}/{p}" for i in range(2) for p in ("self_attn/q_proj", "mlp/down_proj")]


def _curve(seed: int) -> np.ndarray:
  rng = np.random.default_rng(100 + seed)
  steps = np.arange(1, STEPS + 1)
  return 9.0 * np.exp(-steps / 10) + 4.0 + 0.05 * rng.normal(size=STEPS)


def _write_run(root, recipe, seed, offset, *, noise=0.0, status="done", telemetry=False,
               steps=STEPS, resumed=False):
  """A run dir like the trainer + sweep write; train loss = bf16 curve + offset (+ noise)."""
  name = f"{recipe}-seed{seed}"
  d = os.path.join(root, name)
  os.makedirs(d)
  rng = np.random.default_rng(seed * 31 + len(recipe))
  loss = _curve(seed)[:steps] + offset + noise * rng.normal(size=steps)
  lines = [{"step": 0, "eval_loss": 9.5 + offset}]
  for s in range(1, steps + 1):
    rec = {"step": s, "loss": float(loss[s - 1]), "lr": 1e-3, "grad_norm": 1.0}
    if telemetry and s % 10 == 0:
      for i, p in enumerate(PATHS):
        for gemm, ops in (("fprop", ("x", "w")), ("dgrad", ("dy", "w")), ("wgrad", ("x", "dy"))):
          for op in ops:
            base = f"fp8/{p}/{gemm}/{op}"
            rec[f"{base}/snr_db"] = 30.0 - i + (5 if recipe == "infir2" else 0)
            rec[f"{base}/flush_frac"] = 0.001 * (i + 1)
            rec[f"{base}/amax"] = 3.0
            rec[f"fp8/worst/{gemm}/{op}/min_snr_db"] = 27.0
            rec[f"fp8/worst/{gemm}/{op}/max_flush_frac"] = 0.004
      rec[f"fp8/{PATHS[0]}/fprop/w/snr_db"] = "inf"  # an exact operand, as the writer logs it
    lines.append(rec)
    if s % 20 == 0:
      lines.append({"step": s, "eval_loss": 4.5 + offset + 0.01 * seed + noise * rng.normal()})
  if resumed:  # killed after step 22, resumed from its step-20 checkpoint: the re-run wins
    i = next(i for i, r in enumerate(lines) if r["step"] == 21)
    lines[i:i] = [{"step": 21, "loss": 99.0}, {"step": 22, "loss": 99.0}]
  with open(os.path.join(d, "metrics.jsonl"), "w") as f:
    f.write("\n".join(json.dumps(r) for r in lines) + "\n")
  with open(os.path.join(d, sweep.RUN_FILE), "w") as f:
    json.dump({"name": name, "axes": {"seed": seed, "precision.recipe": recipe},
               "overrides": {}}, f)
  if status == "done":
    with open(os.path.join(d, sweep.DONE_FILE), "w") as f:
      json.dump({"wall_s": 12.0}, f)
  elif status == "diverged":
    with open(os.path.join(d, sweep.FAILED_FILE), "w") as f:
      json.dump({"diverged": True, "returncode": 1}, f)
  return name


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory):
  root = str(tmp_path_factory.mktemp("sweep"))
  for seed in SEEDS:
    _write_run(root, "bf16", seed, 0.0, telemetry=False, resumed=(seed == 1))
    _write_run(root, "infir2", seed, 0.002, noise=0.002, telemetry=True)   # equivalent
    _write_run(root, "fp8_tensorwise", seed, 0.30, noise=0.002, telemetry=True)  # worse
    _write_run(root, "infir2_e5m2_grad", seed, 0.0, noise=0.2)             # too noisy to tell
  _write_run(root, "infir2_fp32_scale", 0, 0.0, status="diverged", steps=12)
  _write_run(root, "infir2_fp32_scale", 1, 0.0, status="partial", steps=15)
  return root


def test_read_metrics_keeps_the_last_record_of_a_relogged_step(sweep_dir):
  records = rundir.read_metrics(os.path.join(sweep_dir, "bf16-seed1"))
  train = [r for r in records if "loss" in r]
  assert [r["step"] for r in train] == list(range(1, STEPS + 1))
  assert train[20]["loss"] == pytest.approx(_curve(1)[20])  # the 99.0 lines were superseded
  assert [r["step"] for r in records if "eval_loss" in r] == [0, 20, 40]


def test_statistics_match_scipy(sweep_dir):
  runs = report.load_runs(sweep_dir)
  summary = report.summarize(runs, "bf16", last_k=5, margin=0.01)
  (rows,) = summary.values()
  by = {r.recipe: r for r in rows}
  assert [r.recipe for r in rows][0] == "bf16"
  finals = {rec: np.array([report.load_run(os.path.join(sweep_dir, f"{rec}-seed{s}"))
                           .loss[-5:].mean() for s in SEEDS])
            for rec in ("bf16", "infir2", "fp8_tensorwise")}
  # independent: the raw curves' last 5 points
  np.testing.assert_allclose(finals["bf16"], [_curve(s)[-5:].mean() for s in SEEDS])
  lo, hi = sps.t.interval(0.95, 2, loc=finals["bf16"].mean(), scale=sps.sem(finals["bf16"]))
  assert (by["bf16"].train.low, by["bf16"].train.high) == pytest.approx((lo, hi), rel=1e-10)
  d = finals["infir2"] - finals["bf16"]
  ci = sps.ttest_rel(finals["infir2"], finals["bf16"]).confidence_interval(0.95)
  assert (by["infir2"].d_train.low, by["infir2"].d_train.high) == pytest.approx(
      (ci.low, ci.high), rel=1e-9)
  margin = 0.01 * finals["bf16"].mean()
  p = max(sps.ttest_1samp(d, -margin, alternative="greater").pvalue,
          sps.ttest_1samp(d, margin, alternative="less").pvalue)
  assert by["infir2"].tost_train.p_value == pytest.approx(p, rel=1e-8)
  assert by["infir2"].tost_train.margin == pytest.approx(margin)
  # verdicts
  from infir2_jax.ablation import statistics as stats
  assert stats.verdict(by["infir2"].tost_val) == "equivalent"
  assert stats.verdict(by["fp8_tensorwise"].tost_val) == "not equivalent"
  assert stats.verdict(by["infir2_e5m2_grad"].tost_val) == "inconclusive"
  # unfinished runs are listed, not counted
  assert by["infir2_fp32_scale"].train is None
  assert sorted(by["infir2_fp32_scale"].not_done) == [
      ("infir2_fp32_scale-seed0", "diverged"), ("infir2_fp32_scale-seed1", "partial")]


def test_report_writes_markdown_plots_and_csv(sweep_dir, tmp_path):
  out = str(tmp_path / "out")
  path = report.make_report(sweep_dir, out, last_k=5, margin=0.01)
  text = open(path).read()
  assert "| `infir2` | **equivalent**" in text
  assert "| `fp8_tensorwise` | **not equivalent**" in text
  assert "| `infir2_e5m2_grad` | **inconclusive**" in text
  assert "infir2_fp32_scale-seed0 (diverged)" in text
  assert "| `infir2_fp32_scale` | **diverged** (1 run(s): infir2_fp32_scale-seed0) |" in text
  assert "## FP8 telemetry" in text and "| `infir2` |" in text
  for name in ("loss_curves.png", "loss_diff.png", "telemetry_snr_db.png",
               "telemetry_flush_frac.png", "telemetry_worst.png"):
    assert f"]({name})" in text
    with open(os.path.join(out, name), "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  with open(os.path.join(out, "runs.csv")) as f:
    rows = list(csv.DictReader(f))
  assert len(rows) == 14
  row = next(r for r in rows if r["run"] == "bf16-seed2")
  assert float(row["final_train_loss"]) == pytest.approx(_curve(2)[-5:].mean(), abs=1e-6)


def test_telemetry_table_averages_and_skips_inf(sweep_dir):
  runs = [r for r in report.load_runs(sweep_dir) if r.status == "done"]
  table = plots.telemetry_table(runs)
  assert set(table) == {"infir2", "fp8_tensorwise"}
  assert table["infir2"][("layers_1/mlp/down_proj", "wgrad", "dy", "snr_db")] == 35.0 - 3
  assert table["fp8_tensorwise"][("layers_0/self_attn/q_proj", "fprop", "x", "flush_frac")] == \
      pytest.approx(0.001)
  assert ("layers_0/self_attn/q_proj", "fprop", "w", "snr_db") not in table["infir2"]


def test_telemetry_of_fp8_attention_gets_its_own_columns():
  """FP8 attention's keys (fp8/<layer>/self_attn/attention/<q|k|p|v>/<stat>) enter the
  table and the markdown as "attention <operand>" columns after the GEMMs'."""
  import types
  record = {"step": 50, "fp8/layers_0/self_attn/attention/p/flush_frac": 0.6,
            "fp8/layers_0/self_attn/attention/p/snr_db": 33.0,
            "fp8/layers_1/self_attn/attention/p/flush_frac": 0.8,
            "fp8/layers_1/self_attn/attention/p/snr_db": 34.0,
            "fp8/layers_0/self_attn/q_proj/fprop/x/flush_frac": 0.01,
            "fp8/layers_0/self_attn/q_proj/fprop/x/snr_db": 31.0}
  run = types.SimpleNamespace(recipe="infir2_fp8attn", status="done", telemetry=[record])
  table = plots.telemetry_table([run])
  assert table["infir2_fp8attn"][("layers_1/self_attn", "attention", "p", "flush_frac")] == 0.8
  markdown = plots.telemetry_markdown([run])
  header = next(line for line in markdown.splitlines() if line.startswith("| recipe"))
  assert header == "| recipe | fprop x | attention p |"
  assert "| `infir2_fp8attn` | 31.0 dB / 1% | 33.0 dB / 80% |" in markdown


def test_report_errors_name_the_problem(sweep_dir, tmp_path):
  runs = report.load_runs(sweep_dir)
  with pytest.raises(ValueError, match="reference recipe 'nope'"):
    report.summarize(runs, "nope")
  with pytest.raises(ValueError, match="unknown report setting"):
    report.make_report(sweep_dir, str(tmp_path), plots=False, margn=0.1)
  with pytest.raises(ValueError, match="no run directories"):
    report.load_runs(str(tmp_path))


def _config(recipe, seed, **changes):
  c = {"seed": seed, "steps": STEPS, "precision": {"recipe": recipe, "overrides": []},
       "data": {"format": "pretrain", "num_workers": 0}, "init": {"from_run": ""},
       "log": {"progress_bar": True}}
  for key, value in changes.items():
    section, leaf = key.split(".")
    c[section][leaf] = value
  return c


def test_runs_with_other_configs_are_not_paired(tmp_path):
  """A pretrain bf16 run and an SFT infir2 run in one directory are not seeds of one grid."""
  root = str(tmp_path)
  for recipe, changes in (("bf16", {}), ("infir2", {"data.format": "chat",
                                                    "init.from_run": "runs/default"})):
    name = _write_run(root, recipe, 0, 0.001)
    os.remove(os.path.join(root, name, sweep.RUN_FILE))    # plain runs, not from a sweep
    with open(os.path.join(root, name, rundir.CONFIG_FILE), "w") as f:
      json.dump(_config(recipe, 0, **changes), f)
  runs = report.load_runs(root)
  assert report.config_differences(runs) == ["data.format", "init.from_run"]
  summary = report.summarize(runs, "bf16", min_seeds=1)
  assert len(summary) == 2
  (sft,) = [rows for group, rows in summary.items() if ("data.format", "chat") in group]
  assert [r.recipe for r in sft] == ["infir2"] and sft[0].d_val is None and sft[0].tost_val is None
  text = open(report.make_report(root, str(tmp_path / "out"), plots=False)).read()
  assert "`data.format`, `init.from_run`" in text and "never paired across groups" in text
  assert "No `bf16` run has this group's config" in text
  assert "Equivalence to" not in text   # no verdict table: nothing was paired


def test_runs_differing_only_in_neutral_keys_are_paired(tmp_path):
  root = str(tmp_path)
  for seed in SEEDS:
    for recipe, changes in (("bf16", {"log.progress_bar": False}), ("infir2", {})):
      name = _write_run(root, recipe, seed, 0.002, noise=0.002)
      with open(os.path.join(root, name, rundir.CONFIG_FILE), "w") as f:
        json.dump(_config(recipe, seed, **changes), f)
  runs = report.load_runs(root)
  assert report.config_differences(runs) == []
  (rows,) = report.summarize(runs, "bf16", last_k=5).values()
  assert rows[1].recipe == "infir2" and rows[1].d_val.n == 3


def test_smoke_sweep_gets_no_verdict_and_the_power_is_stated(tmp_path):
  """2 seeds x 10 steps of near-identical curves: TOST alone would say "equivalent"."""
  root = str(tmp_path)
  for seed in (0, 1):
    _write_run(root, "bf16", seed, 0.0, steps=10)
    _write_run(root, "infir2", seed, 0.0005, noise=0.0001, steps=10)
  runs = report.load_runs(root)
  (rows,) = report.summarize(runs, "bf16", last_k=3).values()
  from infir2_jax.ablation import statistics as stats
  assert stats.verdict(rows[1].tost_val) == "equivalent"   # what the old report printed
  assert rows[1].no_verdict == ("2 paired seed(s) < min_seeds 3; runs of 10 steps < "
                                "min_steps 20")
  text = open(report.make_report(root, str(tmp_path / "out"), plots=False, last_k=3)).read()
  assert "| `infir2` | **no verdict** (2 paired seed(s) < min_seeds 3" in text
  assert "| `infir2` | **equivalent**" not in text and ", power " in text
  # and with the minimums lowered, the verdict comes back with its power
  text = open(report.make_report(root, str(tmp_path / "out"), plots=False, last_k=3,
                                 min_seeds=2, min_steps=10)).read()
  assert "| `infir2` | **equivalent** (p=" in text and ", power " in text


@pytest.mark.parametrize("n,sd,margin", [(2, 0.004, 0.02), (3, 0.01, 0.02), (10, 0.02, 0.02)])
def test_tost_power_matches_simulation(n, sd, margin):
  from infir2_jax.ablation import statistics as stats
  rng = np.random.default_rng(n)
  d = rng.normal(0.0, sd, (40_000, n))
  t = sps.t.ppf(0.95, n - 1)
  hits = np.abs(d.mean(1)) + t * d.std(1, ddof=1) / np.sqrt(n) < margin   # TOST at alpha 0.05
  se = np.sqrt(hits.mean() * (1 - hits.mean()) / hits.size)
  assert stats.tost_power(sd, n, margin) == pytest.approx(hits.mean(), abs=4 * se + 1e-3)


def test_plot_run_draws_one_runs_curves_without_a_sweep(tmp_path):
  from infir2_jax.ablation import plot_run
  name = _write_run(str(tmp_path), "bf16", 1, 0.0, resumed=True)   # steps 21-22 logged twice
  run_dir = os.path.join(str(tmp_path), name)
  out = str(tmp_path / "loss.png")
  fig = plot_run.plot_runs([run_dir], out)
  with open(out, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  (ax,) = fig.axes
  lines = {line.get_label(): line for line in ax.get_lines()}
  train, evals = lines[f"{name} train"], lines[f"{name} validation"]
  np.testing.assert_array_equal(train.get_xdata(), np.arange(1, STEPS + 1))
  np.testing.assert_allclose(train.get_ydata(), _curve(1))        # the re-run's values win
  np.testing.assert_array_equal(evals.get_xdata(), [0, 20, 40])
  np.testing.assert_allclose(evals.get_ydata(), [9.5, 4.51, 4.51])
  cli = subprocess.run([sys.executable, "-m", "infir2_jax.ablation.plot_run", run_dir],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
  assert cli.returncode == 0, cli.stderr
  assert cli.stdout.strip() == f"wrote {os.path.join(run_dir, 'loss.png')}"
  assert os.path.getsize(os.path.join(run_dir, "loss.png")) > 1000


def test_keys_added_later_or_inert_do_not_split_seeds(tmp_path):
  """A study resumed across sessions: seed 0 written before model.loss_fused existed and
  with opt.moments_kernel=jnp, seed 1 with loss_fused False and the kernel auto. With float32
  moments the kernel is never read, so the seeds pair; with fp8 moments they do not."""
  def write(root, moments):
    for seed, changes in ((0, {"opt.moments_kernel": "jnp"}),
                          (1, {"opt.moments_kernel": "auto", "model.loss_fused": False})):
      for recipe in ("bf16", "infir2"):
        name = _write_run(root, recipe, seed, 0.002, noise=0.002)
        config = _config(recipe, seed)
        config["opt"] = {"moments": moments, "moments_kernel": changes["opt.moments_kernel"]}
        if "model.loss_fused" in changes:
          config["model"] = {"loss_fused": changes["model.loss_fused"]}
        with open(os.path.join(root, name, rundir.CONFIG_FILE), "w") as f:
          json.dump(config, f)
    return report.load_runs(root)

  paired = write(str(tmp_path / "fp32"), "fp32")
  assert report.config_differences(paired) == []
  (rows,) = report.summarize(paired, "bf16", min_seeds=1).values()
  assert rows[1].recipe == "infir2" and rows[1].d_val.n == 2
  apart = write(str(tmp_path / "fp8"), "fp8")
  assert report.config_differences(apart) == ["opt.moments_kernel"]
  assert len(report.summarize(apart, "bf16", min_seeds=1)) == 2
