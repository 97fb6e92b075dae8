"""Sweep report: per-recipe losses with seed confidence intervals, paired tests against bf16.

  python -m infir2_jax.ablation.report runs/sweep [--reference=bf16] [--margin=0.01] [--last_k=10]
      [--alpha=0.05] [--out_dir=runs/sweep]

Reads every run directory of a sweep (infir2_jax.ablation.sweep) and writes OUT_DIR/report.md, PNG
plots (loss curves with confidence bands, paired differences, FP8 telemetry per layer) and
runs.csv (the per-seed numbers every statistic is computed from). Statistics:
  final train loss of a run  = mean of its last `last_k` logged train losses,
  validation loss of a run   = its last eval_loss (the end of training),
  per recipe                 = mean and 95% Student-t interval across seeds,
  paired difference          = recipe - reference per seed (same init and data), t interval,
  equivalence (TOST)         = both one-sided t tests reject |difference| >= margin at alpha,
                               i.e. the (1 - 2 alpha) interval lies inside +-margin; the
                               margin is `margin` x the reference's mean loss (relative),
  power                      = the chance TOST shows equivalence for a recipe exactly as good
                               as the reference, at the observed spread of the differences.
Only runs whose configs differ in the swept keys alone are compared (the sweep's axes, or
precision.recipe and seed for plain run directories); runs that differ in any other key
form groups of their own. No verdict is given below `min_seeds` paired seeds or for runs
shorter than `min_steps` steps (a smoke sweep measures nothing).
"""

import csv
import dataclasses
import functools
import math
import os
from typing import Any

import numpy as np

from infir2_jax import config as config_lib
from infir2_jax.ablation import plots as plots_lib
from infir2_jax.ablation import results
from infir2_jax.ablation import statistics
from infir2_jax.ablation import sweep
from infir2_jax.train import rundir

RECIPE_KEY, SEED_KEY = "precision.recipe", "seed"
# compare: the grid axis whose values are compared (its reference value vs the others).
DEFAULTS = {"reference": "bf16", "compare": RECIPE_KEY, "margin": 0.01, "last_k": 10,
            "alpha": 0.05, "level": 0.95, "min_seeds": 3, "min_steps": 20}
# Config keys that do not change what a run computes: differing in them still pairs runs.
NEUTRAL_KEYS = ("checkpoint.", "log.progress_bar", "log.tensorboard", "log.peak_tflops",
                "data.num_workers", "data.prefetch", "data.cache_dir")


@dataclasses.dataclass
class RunData:
  """One run's identity, status and curves (steps ascending)."""
  name: str
  status: str                      # sweep.run_status
  recipe: str
  seed: int
  group: tuple[tuple[str, Any], ...]  # the other grid axes
  steps: np.ndarray
  loss: np.ndarray
  eval_steps: np.ndarray
  eval_loss: np.ndarray
  telemetry: list[dict[str, float]]  # the fp8/* keys of each telemetry step, with "step"
  wall_s: float | None = None
  config: dict[str, Any] = dataclasses.field(default_factory=dict)  # flat config.json
  swept: tuple[str, ...] = (RECIPE_KEY, SEED_KEY)   # the keys the run's sweep varies

  def final_train(self, last_k: int) -> float:
    return float(np.mean(self.loss[-last_k:])) if self.loss.size else math.nan

  def final_eval(self) -> float:
    return float(self.eval_loss[-1]) if self.eval_loss.size else math.nan


def _config_value(config: dict, key: str, default="?"):
  for part in key.split("."):
    config = config.get(part, {}) if isinstance(config, dict) else {}
  return default if config == {} else config


def load_run(run_dir: str, compare: str = RECIPE_KEY) -> RunData:
  """A run directory (metrics.jsonl, config.json, the sweep's markers) as RunData; its
  `recipe` is its value of the compared axis `compare` (the precision recipe by default)."""
  records = rundir.read_metrics(run_dir)
  config = rundir.config_dict(run_dir) or {}
  axes = (rundir.read_json(os.path.join(run_dir, sweep.RUN_FILE)) or {}).get("axes", {})
  recipe = axes.get(compare, _config_value(config, compare))
  seed = int(axes.get(SEED_KEY, config.get("seed", -1)))
  group = tuple(sorted((k, v) for k, v in axes.items() if k not in (compare, SEED_KEY)))
  train = [r for r in records if "loss" in r]
  evals = [r for r in records if "eval_loss" in r]
  telemetry = [{k: v for k, v in r.items() if k.startswith("fp8/") or k == "step"}
               for r in train if any(k.startswith("fp8/") for k in r)]
  telemetry = telemetry or results.read_telemetry(run_dir)  # a study's compact copy
  marker = (rundir.read_json(os.path.join(run_dir, sweep.DONE_FILE))
            or rundir.read_json(os.path.join(run_dir, sweep.FAILED_FILE)) or {})
  return RunData(
      name=os.path.basename(os.path.normpath(run_dir)), status=sweep.run_status(run_dir),
      recipe=str(recipe), seed=seed, group=group,
      steps=np.array([r["step"] for r in train], np.int64),
      loss=np.array([r["loss"] for r in train], np.float64),
      eval_steps=np.array([r["step"] for r in evals], np.int64),
      eval_loss=np.array([r["eval_loss"] for r in evals], np.float64),
      telemetry=telemetry, wall_s=marker.get("wall_s"), config=_flat(config),
      swept=tuple(sorted({RECIPE_KEY, SEED_KEY, compare} | set(axes))))


def _flat(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
  out = {}
  for key, value in config.items():
    if isinstance(value, dict):
      out.update(_flat(value, f"{prefix}{key}."))
    else:  # lists (JSON tuples) become tuples: group keys must hash
      out[prefix + key] = tuple(value) if isinstance(value, list) else value
  return out


# Keys that change nothing unless another key has a value: (that key, the value).
INERT_UNLESS = {"opt.moments_kernel": ("opt.moments", "fp8")}


@functools.cache
def _default_flat() -> dict[str, Any]:
  return _flat(config_lib.default_config().to_dict())


def effective_config(config: dict[str, Any]) -> dict[str, Any]:
  """A run's flat config as it acts: keys added to TrainConfig after the run was written
  take today's defaults (a new key defaults to the behaviour before it existed), and keys
  that act only beside another's value (INERT_UNLESS) are dropped where they do not act.
  Without it a study resumed across sessions split its seeds into groups by
  `model.loss_fused` (absent, then False) and `opt.moments_kernel` (jnp, then auto, with
  float32 moments that never read it). A run without a config.json stays empty."""
  if not config:
    return config
  out = {**_default_flat(), **config}
  for key, (gate, value) in INERT_UNLESS.items():
    if out.get(gate) != value:
      out.pop(key, None)
  return out


def config_differences(runs: list[RunData]) -> list[str]:
  """Config keys, other than the swept and neutral ones, whose values differ between runs
  (as the runs act: effective_config)."""
  swept = {k for r in runs for k in r.swept}
  configs = [effective_config(r.config) for r in runs]
  keys = sorted({k for c in configs for k in c})
  # A key dropped where it does not act is no difference (opt.moments_kernel where a moments
  # sweep has float32 moments); a run without a config.json differs in every key.
  values = lambda k: {repr(c.get(k)) for c in configs if k in c or not c}
  return [k for k in keys if k not in swept and not k.startswith(NEUTRAL_KEYS)
          and len(values(k)) > 1]


def _split_by_config(runs: list[RunData]) -> list[RunData]:
  """Adds the differing non-swept keys to each run's group: only like configs are paired."""
  differ = config_differences(runs)
  for r in runs:
    config = effective_config(r.config)
    r.group = tuple(sorted(r.group + tuple((k, config.get(k)) for k in differ)))
  return runs


def load_runs(sweep_dir: str, compare: str = RECIPE_KEY) -> list[RunData]:
  """Every run directory under sweep_dir (those with metrics.jsonl or a sweep marker)."""
  if not os.path.isdir(sweep_dir):
    raise FileNotFoundError(f"sweep directory {sweep_dir!r} does not exist")
  runs = []
  for name in sorted(os.listdir(sweep_dir)):
    path = os.path.join(sweep_dir, name)
    if name.startswith("."):  # caches, a study's half-written exports (ablation/results.py)
      continue
    if os.path.isdir(path) and any(os.path.exists(os.path.join(path, f)) for f in (
        rundir.METRICS_FILE, sweep.RUN_FILE)):
      runs.append(load_run(path, compare))
  if not runs:
    raise ValueError(f"no run directories (with metrics.jsonl) in {sweep_dir!r}")
  return _split_by_config(runs)


@dataclasses.dataclass(frozen=True)
class RecipeSummary:
  """One recipe's statistics in one group of the other axes."""
  recipe: str
  seeds: tuple[int, ...]
  train: statistics.MeanCI | None
  val: statistics.MeanCI | None
  d_train: statistics.MeanCI | None      # recipe - reference, paired by seed
  d_val: statistics.MeanCI | None
  tost_train: statistics.Tost | None
  tost_val: statistics.Tost | None
  not_done: tuple[tuple[str, str], ...]  # runs left out: (name, status)
  power_train: float = math.nan          # TOST power at the observed spread (see the docstring)
  power_val: float = math.nan
  no_verdict: str = ""                   # why no verdict is given (too few seeds or steps)


def _by_seed(runs: list[RunData], value) -> dict[int, float]:
  return {r.seed: value(r) for r in runs if math.isfinite(value(r))}


def _refusal(shared_seeds: int, steps: int, min_seeds: int, min_steps: int) -> str:
  why = []
  if shared_seeds < min_seeds:
    why.append(f"{shared_seeds} paired seed(s) < min_seeds {min_seeds}")
  if steps < min_steps:
    why.append(f"runs of {steps} steps < min_steps {min_steps}")
  return "; ".join(why)


def summarize(runs: list[RunData], reference: str = "bf16", *, last_k: int = 10,
              margin: float = 0.01, alpha: float = 0.05, level: float = 0.95,
              min_seeds: int = 3, min_steps: int = 20) -> dict[tuple, list[RecipeSummary]]:
  """Per group (the other axes' and config keys' values), per recipe: the statistics of the
  module docstring.

  Only finished runs ("done") enter the statistics; the others are listed in not_done.
  A recipe's paired difference uses the seeds it shares with the reference of its group; a
  group without a reference run gets no differences (nothing it may be paired with).
  """
  if last_k < 1:
    raise ValueError(f"last_k must be >= 1, got {last_k}")
  if not any(r.recipe == reference for r in runs):
    groups = sorted({r.group for r in runs}, key=repr)
    raise ValueError(f"reference recipe {reference!r} has no runs in group "
                     f"{' or '.join(str(dict(g)) for g in groups)}; recipes: "
                     f"{sorted({r.recipe for r in runs})}")
  out: dict[tuple, list[RecipeSummary]] = {}
  for group in sorted({r.group for r in runs}, key=repr):
    members = [r for r in runs if r.group == group]
    done = [r for r in members if r.status == "done"]
    recipes = sorted({r.recipe for r in members}, key=lambda n: (n != reference, n))
    metrics = {"train": lambda r: r.final_train(last_k), "val": RunData.final_eval}
    ref = {m: _by_seed([r for r in done if r.recipe == reference], f)
           for m, f in metrics.items()}
    rows = []
    for recipe in recipes:
      mine = [r for r in done if r.recipe == recipe]
      per = {m: _by_seed(mine, f) for m, f in metrics.items()}
      result, power, refusal = {}, {}, ""
      for m in metrics:
        vals = per[m]
        result[m] = statistics.mean_ci(list(vals.values()), level) if vals else None
        shared = sorted(set(vals) & set(ref[m]))
        power[m] = math.nan
        if recipe == reference or not shared or not ref[m]:
          result["d_" + m] = result["tost_" + m] = None
          continue
        a = [vals[s] for s in shared]
        b = [ref[m][s] for s in shared]
        result["d_" + m] = statistics.paired_diff(a, b, level)
        ref_mean = float(np.mean(list(ref[m].values())))
        result["tost_" + m] = statistics.tost(np.subtract(a, b), margin * ref_mean, alpha)
        power[m] = statistics.tost_power(result["d_" + m].sd, len(shared), margin * ref_mean,
                                         alpha)
        steps = min(int(r.steps[-1]) if r.steps.size else 0
                    for r in done if r.seed in shared and r.recipe in (recipe, reference))
        refusal = refusal or _refusal(len(shared), steps, min_seeds, min_steps)
      seeds = tuple(sorted({r.seed for r in mine}))
      not_done = tuple((r.name, r.status) for r in members
                       if r.recipe == recipe and r.status != "done")
      rows.append(RecipeSummary(recipe, seeds, result["train"], result["val"],
                                result["d_train"], result["d_val"], result["tost_train"],
                                result["tost_val"], not_done, power["train"], power["val"],
                                refusal))
    out[group] = rows
  return out


def _fmt_ci(ci: statistics.MeanCI | None, digits: int = 4) -> str:
  if ci is None:
    return "—"
  if ci.n < 2:
    return f"{ci.mean:.{digits}f} (n=1)"
  return f"{ci.mean:.{digits}f} ± {ci.half_width:.{digits}f}"


def _fmt_diff(ci: statistics.MeanCI | None, ref_mean: float | None) -> str:
  if ci is None:
    return "—"
  rel = f" ({100 * ci.mean / ref_mean:+.2f}%)" if ref_mean else ""
  if ci.n < 2:
    return f"{ci.mean:+.4f}{rel} (n=1)"
  return f"{ci.mean:+.4f} [{ci.low:+.4f}, {ci.high:+.4f}]{rel}"


def _fmt_tost(t: statistics.Tost | None, power: float = math.nan, no_verdict: str = "") -> str:
  if t is None:
    return "—"
  p = "n/a" if math.isnan(t.p_value) else (f"{t.p_value:.2g}" if t.p_value >= 1e-4
                                            else "<1e-4")
  pw = "" if math.isnan(power) else f", power {power:.2f}"
  if no_verdict:
    return f"**no verdict** ({no_verdict}; p={p}, margin ±{t.margin:.4f}{pw})"
  return f"**{statistics.verdict(t)}** (p={p}, margin ±{t.margin:.4f}{pw})"


def _compared(runs: list[RunData], summary) -> list[str]:
  """What the report compared with what, in words."""
  swept = sorted({k for r in runs for k in r.swept})
  differ = config_differences(runs)
  with_config = sum(bool(r.config) for r in runs)
  lines = [f"Compared: runs whose configs differ only in the swept keys ("
           + ", ".join(f"`{k}`" for k in swept) + "), paired by seed within each group; "
           f"{with_config} of {len(runs)} run(s) have a config.json to check this."]
  if differ:
    shown = ", ".join(f"`{k}`" for k in differ[:8]) + (" ..." if len(differ) > 8 else "")
    lines.append(f"The runs also differ in {len(differ)} other key(s) ({shown}): they form "
                 f"{len(summary)} separate groups below and are never paired across groups.")
  return lines


def markdown(summary: dict[tuple, list[RecipeSummary]], runs: list[RunData],
             settings: dict[str, Any], sweep_record: dict | None, plots: dict[str, str],
             telemetry: str = "") -> str:
  """The report text; plots maps a caption to a PNG file name next to report.md."""
  s = settings
  label = "recipe" if s.get("compare", RECIPE_KEY) == RECIPE_KEY else s["compare"]
  lines = ["# Precision sweep report", ""]
  if sweep_record:
    spec = sweep_record.get("spec", {})
    sessions = sweep_record.get("sessions", [])
    wall = sum(x.get("wall_s", 0) for x in sessions)
    lines += [f"- base config: `{spec.get('base') or 'default'}`",
              f"- overrides: `{spec.get('overrides', {})}`",
              f"- grid: `{spec.get('grid', {})}`"]
    if sessions:
      last = sessions[-1]
      if last.get("command"):
        lines.append(f"- command: `{last['command']}`")
      lines.append(f"- wall time: {wall / 60:.1f} min over {len(sessions)} session(s) "
                   f"(last: {last.get('parallel')} run(s) at a time, {last.get('cpus')} CPUs, "
                   f"{last.get('platform')})")
  n_done = sum(r.status == "done" for r in runs)
  lines += [f"- runs: {len(runs)} ({n_done} finished)", "",
            "## Method", "",
            f"Final train loss of a run = mean of its last {s['last_k']} logged train losses; "
            "validation loss = its eval loss at the last step. Per recipe: mean ± half-width "
            f"of the {100 * s['level']:.0f}% Student-t interval across seeds. Δ = recipe − "
            f"`{s['reference']}`, paired by seed (same initialization and data order), with "
            f"its {100 * s['level']:.0f}% t interval. Equivalence: TOST (two one-sided paired "
            f"t tests, α = {s['alpha']}) at a margin of ±{100 * s['margin']:g}% of the "
            f"reference's mean loss: **equivalent** when the {100 * (1 - 2 * s['alpha']):.0f}% "
            "interval of Δ lies inside the margin, **not equivalent** when it lies outside, "
            "otherwise **inconclusive** (more seeds needed). Power: the chance of "
            "**equivalent** for a recipe exactly as good as the reference, at the observed "
            f"spread. No verdict below {s['min_seeds']} paired seeds or {s['min_steps']} "
            "steps per run. Lower loss is better; Δ > 0 means the recipe is worse.", "",
            *_compared(runs, summary), ""]
  for group, rows in summary.items():
    if group:
      lines += [f"## {', '.join(f'{k}={v}' for k, v in group)}", ""]
    else:
      lines += ["## Results", ""]
    ref_row = rows[0] if rows[0].recipe == s["reference"] else None
    ref_train = ref_row.train.mean if ref_row and ref_row.train else None
    ref_val = ref_row.val.mean if ref_row and ref_row.val else None
    lines += [f"| {label} | seeds | train loss | val loss | Δ train [CI] | Δ val [CI] |",
              "|---|---|---|---|---|---|"]
    for r in rows:
      lines.append(f"| `{r.recipe}` | {len(r.seeds)} | {_fmt_ci(r.train)} | {_fmt_ci(r.val)} "
                   f"| {_fmt_diff(r.d_train, ref_train)} | {_fmt_diff(r.d_val, ref_val)} |")
    if ref_row is None:
      lines += ["", f"No `{s['reference']}` run has this group's config: its runs are not "
                "compared with anything."]
    elif len(rows) > 1:
      lines += ["", f"Equivalence to `{s['reference']}` (TOST):", "",
                f"| {label} | validation loss | train loss |", "|---|---|---|"]
    for r in rows[1:] if ref_row is not None else ():
      diverged = [name for name, status in r.not_done if status == "diverged"]
      if diverged:  # a recipe that diverged on any seed is not equivalent, whatever the rest say
        cell = f"**diverged** ({len(diverged)} run(s): {', '.join(diverged)})"
        lines.append(f"| `{r.recipe}` | {cell} | {cell} |")
      else:
        lines.append(f"| `{r.recipe}` | {_fmt_tost(r.tost_val, r.power_val, r.no_verdict)} | "
                     f"{_fmt_tost(r.tost_train, r.power_train, r.no_verdict)} |")
    missing = [f"{name} ({status})" for r in rows for name, status in r.not_done]
    if missing:
      lines += ["", "Left out of the statistics (not finished): " + ", ".join(missing)]
    lines.append("")
  def figures(telemetry_plots: bool):
    for caption, name in plots.items():
      if caption.startswith("FP8 telemetry") == telemetry_plots:
        lines.extend([f"### {caption}", "", f"![{caption}]({name})", ""])
  figures(False)
  if telemetry:
    lines += [telemetry, ""]
  figures(True)
  lines += ["## Runs", "", f"| run | {label} | seed | status | final train loss | val loss | "
            "wall (s) |", "|---|---|---|---|---|---|---|"]
  for r in runs:
    wall = f"{r.wall_s:.0f}" if r.wall_s is not None else "—"
    lines.append(f"| {r.name} | `{r.recipe}` | {r.seed} | {r.status} | "
                 f"{r.final_train(s['last_k']):.4f} | {r.final_eval():.4f} | {wall} |")
  lines += ["", "Per-seed values: [runs.csv](runs.csv). Regenerate: "
            "`python -m infir2_jax.ablation.report SWEEP_DIR`.", ""]
  return "\n".join(lines)


def write_csv(path: str, runs: list[RunData], last_k: int) -> None:
  with open(path, "w", newline="") as f:
    w = csv.writer(f)
    keys = sorted({k for r in runs for k, _ in r.group})
    w.writerow(["run", "recipe", "seed", *keys, "status", "final_train_loss", "val_loss",
                "steps", "wall_s"])
    for r in runs:
      g = dict(r.group)
      w.writerow([r.name, r.recipe, r.seed, *[g.get(k, "") for k in keys], r.status,
                  f"{r.final_train(last_k):.6f}", f"{r.final_eval():.6f}",
                  int(r.steps[-1]) if r.steps.size else 0,
                  "" if r.wall_s is None else f"{r.wall_s:.1f}"])


def make_report(sweep_dir: str, out_dir: str | None = None, *, plots: bool = True,
                **settings) -> str:
  """Writes report.md (+ PNGs, runs.csv) for a sweep directory; returns the report's path.

  settings: reference, margin, last_k, alpha, level, min_seeds, min_steps; unset ones come from
  the sweep config's `report` section (WORKDIR/sweep.json), then DEFAULTS.
  """
  record = rundir.read_json(os.path.join(sweep_dir, sweep.SWEEP_FILE))
  from_sweep = (record or {}).get("spec", {}).get("report", {})
  unknown = sorted(set(settings) - set(DEFAULTS))
  if unknown:
    raise ValueError(f"unknown report setting(s) {unknown}; valid: {sorted(DEFAULTS)}")
  s = {k: settings.get(k) if settings.get(k) is not None else from_sweep.get(k, v)
       for k, v in DEFAULTS.items()}
  runs = load_runs(sweep_dir, s["compare"])
  summary = summarize(runs, s["reference"], last_k=int(s["last_k"]), margin=float(s["margin"]),
                      alpha=float(s["alpha"]), level=float(s["level"]),
                      min_seeds=int(s["min_seeds"]), min_steps=int(s["min_steps"]))
  out_dir = out_dir or sweep_dir
  os.makedirs(out_dir, exist_ok=True)
  figures = {}
  if plots:
    figures = plots_lib.write_all(runs, out_dir, reference=s["reference"],
                                     margin=float(s["margin"]), level=float(s["level"]))
  write_csv(os.path.join(out_dir, "runs.csv"), runs, int(s["last_k"]))
  text = markdown(summary, runs, s, record, figures, plots_lib.telemetry_markdown(runs))
  path = os.path.join(out_dir, "report.md")
  with open(path, "w") as f:
    f.write(text)
  return path


def main(argv=None) -> None:
  from absl import app, flags
  flags.DEFINE_string("reference", None, "Recipe the others are compared to (default bf16).")
  flags.DEFINE_string("compare", None, "The grid axis compared (default precision.recipe).")
  flags.DEFINE_float("margin", None, "Equivalence margin, relative to the reference's mean "
                     "loss (default 0.01 = 1%).")
  flags.DEFINE_integer("last_k", None, "Final train loss = mean of the last k steps (10).")
  flags.DEFINE_float("alpha", None, "TOST significance level (0.05).")
  flags.DEFINE_integer("min_seeds", None, "No verdict with fewer paired seeds (3).")
  flags.DEFINE_integer("min_steps", None, "No verdict for runs of fewer steps (20).")
  flags.DEFINE_string("out_dir", None, "Where report.md and the plots go (default: SWEEP_DIR).")
  flags.DEFINE_bool("plots", True, "Write PNG plots (needs matplotlib).")

  def _main(args):
    if len(args) != 2:
      raise app.UsageError("usage: python -m infir2_jax.ablation.report SWEEP_DIR [--flags]")
    F = flags.FLAGS
    path = make_report(args[1], F.out_dir, plots=F.plots, reference=F.reference,
                       compare=F.compare, margin=F.margin, last_k=F.last_k, alpha=F.alpha,
                       min_seeds=F.min_seeds, min_steps=F.min_steps)
    print(f"wrote {path}")

  app.run(_main, argv=argv)


if __name__ == "__main__":
  main()
