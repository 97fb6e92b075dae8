"""Plots and telemetry tables of a sweep report: loss bands, paired differences, FP8 numerics.

matplotlib (Agg) is imported only when a figure is drawn, so the statistics work without it.
Telemetry keys are the trainer's "fp8/<projection path>/<gemm>/<operand>/<stat>", e.g.
"fp8/layers_0/self_attn/q_proj/fprop/x/snr_db"; runs without them get no telemetry plots.
"""

import math
import os
import re

import numpy as np

from infir2_jax.ablation import statistics

_TELEMETRY_RE = re.compile(
    r"^fp8/(?!worst/)(?P<path>.+)/(?P<gemm>fprop|dgrad|wgrad|attention)/"
    r"(?P<operand>x|w|dy|q|k|p|v)/(?P<stat>amax|flush_frac|snr_db)$")
_WORST_RE = re.compile(r"^fp8/worst/(?P<gemm>\w+)/(?P<operand>\w+)/(?P<stat>\w+)$")
_PROJ_ORDER = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
_ROLE_ORDER = [("fprop", "x"), ("fprop", "w"), ("dgrad", "dy"), ("dgrad", "w"),
               ("wgrad", "x"), ("wgrad", "dy"),   # FP8 attention's forward operands:
               ("attention", "q"), ("attention", "k"), ("attention", "p"), ("attention", "v")]


def _pyplot():
  try:
    import matplotlib
  except ImportError as e:
    raise ImportError("report plots need matplotlib (pip install matplotlib), or pass "
                      "--noplots") from e
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def smooth(y: np.ndarray, window: int) -> np.ndarray:
  """Trailing moving average; the first window-1 points average what exists so far."""
  y = np.asarray(y, np.float64)
  if window <= 1 or y.size == 0:
    return y
  c = np.cumsum(np.insert(y, 0, 0.0))
  idx = np.arange(1, y.size + 1)
  lo = np.maximum(idx - window, 0)
  return (c[idx] - c[lo]) / (idx - lo)


def band(values_SxT: np.ndarray, level: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Mean over seeds (axis 0) and its Student-t interval at `level`, per column."""
  v = np.asarray(values_SxT, np.float64)
  mean = v.mean(axis=0)
  if v.shape[0] < 2:
    return mean, mean, mean
  half = statistics.t_ppf(0.5 + level / 2, v.shape[0] - 1) * v.std(axis=0, ddof=1) / math.sqrt(
      v.shape[0])
  return mean, mean - half, mean + half


def _aligned(runs, steps_attr: str, values_attr: str, window: int = 1):
  """(steps, [runs x steps]) on the steps every run logged; values smoothed per run."""
  if not runs:
    return np.zeros(0, np.int64), np.zeros((0, 0))
  common = set(getattr(runs[0], steps_attr).tolist())
  for r in runs[1:]:
    common &= set(getattr(r, steps_attr).tolist())
  steps = np.array(sorted(common), np.int64)
  rows = []
  for r in runs:
    s, v = getattr(r, steps_attr), smooth(getattr(r, values_attr), window)
    rows.append(v[np.searchsorted(s, steps)])
  return steps, np.array(rows).reshape(len(runs), steps.size)


def _recipes(runs, reference):
  return sorted({r.recipe for r in runs}, key=lambda n: (n != reference, n))


def _groups(runs):
  return sorted({r.group for r in runs}, key=repr)


def write_all(runs, out_dir: str, *, reference: str, margin: float, level: float
              ) -> dict[str, str]:
  """Draws every figure of the finished runs into out_dir; returns {caption: file name}."""
  done = [r for r in runs if r.status == "done" and r.steps.size]
  figures = {}
  groups = _groups(done)
  for i, group in enumerate(groups):
    members = [r for r in done if r.group == group]
    tag = "" if len(groups) == 1 else f"_g{i}"
    where = "" if not group else " (" + ", ".join(f"{k}={v}" for k, v in group) + ")"
    name = f"loss_curves{tag}.png"
    _loss_curves(members, reference, level, os.path.join(out_dir, name))
    figures[f"Loss curves, mean and {100 * level:.0f}% band over seeds{where}"] = name
    if any(r.recipe == reference for r in members) and len(_recipes(members, reference)) > 1:
      name = f"loss_diff{tag}.png"
      _loss_diff(members, reference, margin, level, os.path.join(out_dir, name))
      figures[f"Paired difference to {reference}, mean and {100 * level:.0f}% band{where}"] = name
  table = telemetry_table(done)
  if table:
    for stat, label in (("snr_db", "SNR (dB)"), ("flush_frac", "flush-to-zero fraction")):
      name = f"telemetry_{stat}.png"
      _telemetry_per_layer(table, stat, label, os.path.join(out_dir, name))
      figures[f"FP8 telemetry per layer: {label}, mean over steps and seeds"] = name
    if any(_WORST_RE.match(k) for r in done for t in r.telemetry for k in t):
      name = "telemetry_worst.png"
      _telemetry_worst(done, reference, os.path.join(out_dir, name))
      figures["FP8 telemetry over training: worst layer"] = name
  return figures


def _window(runs) -> int:
  return max(1, max(r.steps.size for r in runs) // 25)


def _loss_curves(runs, reference, level, path):
  plt = _pyplot()
  fig, (ax_t, ax_v) = plt.subplots(1, 2, figsize=(12, 4.2))
  window = _window(runs)
  top = []
  for recipe in _recipes(runs, reference):
    mine = [r for r in runs if r.recipe == recipe]
    steps, v = _aligned(mine, "steps", "loss", window)
    mean, lo, hi = band(v, level)
    (line,) = ax_t.plot(steps, mean, label=f"{recipe} (n={len(mine)})", lw=1.2)
    ax_t.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.25, lw=0)
    if mean.size:
      top.append(mean[min(mean.size - 1, mean.size // 10)])
    steps, v = _aligned(mine, "eval_steps", "eval_loss")
    if steps.size:
      mean, lo, hi = band(v, level)
      ax_v.errorbar(steps, mean, yerr=[mean - lo, hi - mean], marker="o", ms=3, capsize=2,
                    color=line.get_color(), label=recipe, lw=1)
  ax_t.set(title=f"train loss (moving average of {window} steps)", xlabel="step", ylabel="loss")
  ax_v.set(title="validation loss", xlabel="step", ylabel="loss")
  if top:
    lo_t, _ = ax_t.get_ylim()
    ax_t.set_ylim(lo_t, max(top))  # zoom past the first 10% of training, where curves differ
  for ax in (ax_t, ax_v):
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _loss_diff(runs, reference, margin, level, path):
  plt = _pyplot()
  fig, (ax_t, ax_v) = plt.subplots(1, 2, figsize=(12, 4.2))
  window = _window(runs)
  ref = {r.seed: r for r in runs if r.recipe == reference}
  ref_train = np.mean([r.loss[-1] for r in ref.values()])
  ref_val = np.mean([r.eval_loss[-1] for r in ref.values() if r.eval_loss.size] or [np.nan])
  for recipe in _recipes(runs, reference)[1:]:
    pairs = [(r, ref[r.seed]) for r in runs if r.recipe == recipe and r.seed in ref]
    if not pairs:
      continue
    mine, theirs = [p[0] for p in pairs], [p[1] for p in pairs]
    s1, a = _aligned(mine, "steps", "loss", window)
    s2, b = _aligned(theirs, "steps", "loss", window)
    steps = np.intersect1d(s1, s2)
    d = a[:, np.searchsorted(s1, steps)] - b[:, np.searchsorted(s2, steps)]
    mean, lo, hi = band(d, level)
    (line,) = ax_t.plot(steps, mean, label=f"{recipe} (n={len(pairs)})", lw=1.2)
    ax_t.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.25, lw=0)
    s1, a = _aligned(mine, "eval_steps", "eval_loss")
    s2, b = _aligned(theirs, "eval_steps", "eval_loss")
    steps = np.intersect1d(s1, s2)
    if steps.size:
      d = a[:, np.searchsorted(s1, steps)] - b[:, np.searchsorted(s2, steps)]
      mean, lo, hi = band(d, level)
      ax_v.errorbar(steps, mean, yerr=[mean - lo, hi - mean], marker="o", ms=3, capsize=2,
                    color=line.get_color(), label=recipe, lw=1)
  for ax, ref_loss, what in ((ax_t, ref_train, "train"), (ax_v, ref_val, "validation")):
    ax.axhline(0, color="k", lw=0.8)
    if np.isfinite(ref_loss):
      for sign in (-1, 1):
        ax.axhline(sign * margin * ref_loss, color="gray", ls="--", lw=0.8)
    ax.set(title=f"{what} loss − {reference} (paired by seed; dashed: ±{100 * margin:g}%)",
           xlabel="step", ylabel="Δ loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _path_key(path: str):
  m = re.match(r"layers_(\d+)/(.*)", path)
  layer, rest = (int(m.group(1)), m.group(2)) if m else (10**9, path)
  proj = rest.rsplit("/", 1)[-1]
  return (layer, _PROJ_ORDER.index(proj) if proj in _PROJ_ORDER else 99, rest)


def _short(path: str) -> str:
  m = re.match(r"layers_(\d+)/.*?([a-z]+)_proj$", path) or re.match(
      r"layers_(\d+)/self_(attn)$", path)
  return f"L{m.group(1)} {m.group(2)}" if m else path


def telemetry_table(runs) -> dict[str, dict[tuple[str, str, str, str], float]]:
  """recipe -> (path, gemm, operand, stat) -> mean over telemetry steps, then over seeds.

  Non-finite values (an exact operand's SNR is +inf) are left out of the means.
  """
  per_run: dict[str, list[dict]] = {}
  for r in runs:
    acc: dict[tuple, list[float]] = {}
    for record in r.telemetry:
      for key, value in record.items():
        m = _TELEMETRY_RE.match(key)
        if m and isinstance(value, (int, float)) and math.isfinite(value):
          acc.setdefault((m["path"], m["gemm"], m["operand"], m["stat"]), []).append(value)
    if acc:
      per_run.setdefault(r.recipe, []).append({k: float(np.mean(v)) for k, v in acc.items()})
  table = {}
  for recipe, rows in per_run.items():
    keys = set().union(*rows)
    table[recipe] = {k: float(np.mean([row[k] for row in rows if k in row])) for k in keys}
  return table


def _roles(table) -> list[tuple[str, str]]:
  present = {(k[1], k[2]) for t in table.values() for k in t}
  return [r for r in _ROLE_ORDER if r in present]


def _telemetry_per_layer(table, stat, label, path):
  plt = _pyplot()
  roles = _roles(table)
  paths = sorted({k[0] for t in table.values() for k in t}, key=_path_key)
  ncols = 2
  nrows = max(1, math.ceil(len(roles) / ncols))
  fig, axes = plt.subplots(nrows, ncols, figsize=(14, 3.2 * nrows), squeeze=False)
  x = np.arange(len(paths))
  for ax, (gemm, operand) in zip(axes.flat, roles):
    for recipe in sorted(table):
      y = [table[recipe].get((p, gemm, operand, stat), np.nan) for p in paths]
      if np.all(np.isnan(y)):
        continue
      y = np.array(y, np.float64)
      if stat == "flush_frac":  # percent, on a log axis: recipes differ by decades
        y = np.where(y > 0, 100 * y, np.nan)
      ax.plot(x, y, marker="o", ms=3, lw=1, label=recipe)
    if stat == "flush_frac" and ax.get_lines():
      ax.set_yscale("log")
    ax.set_title(f"{gemm} {operand}", fontsize=10)
    ax.set_xticks(x, [_short(p) for p in paths], rotation=90, fontsize=6)
    ax.set_ylabel(label + (" (%, 0 not shown)" if stat == "flush_frac" else ""))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  for ax in list(axes.flat)[len(roles):]:
    ax.axis("off")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _telemetry_worst(runs, reference, path):
  plt = _pyplot()
  stats_ = (("min_snr_db", "min SNR over layers (dB)"),
            ("max_flush_frac", "max flush fraction over layers"))
  roles = [r for r in _ROLE_ORDER if any(
      f"fp8/worst/{r[0]}/{r[1]}/min_snr_db" in t for x in runs for t in x.telemetry)]
  fig, axes = plt.subplots(2, max(1, len(roles)), figsize=(3.2 * max(1, len(roles)), 6),
                           squeeze=False)
  for col, (gemm, operand) in enumerate(roles):
    for row, (stat, label) in enumerate(stats_):
      ax = axes[row, col]
      key = f"fp8/worst/{gemm}/{operand}/{stat}"
      for recipe in _recipes(runs, reference):
        series = {}
        for r in runs:
          if r.recipe != recipe:
            continue
          for t in r.telemetry:
            if key in t and isinstance(t[key], (int, float)) and math.isfinite(t[key]):
              series.setdefault(t["step"], []).append(t[key])
        if series:
          steps = sorted(series)
          ax.plot(steps, [np.mean(series[s]) for s in steps], marker=".", lw=1, label=recipe)
      ax.set_title(f"{gemm} {operand}", fontsize=9)
      ax.set_ylabel(label, fontsize=8)
      ax.set_xlabel("step", fontsize=8)
      ax.grid(alpha=0.3)
  axes[0, 0].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def telemetry_markdown(runs) -> str:
  """A table per recipe: worst layer's mean SNR and flush fraction for each GEMM operand."""
  table = telemetry_table([r for r in runs if r.status == "done"])
  if not table:
    return ("## FP8 telemetry\n\nNo telemetry in these runs (set "
            "precision.telemetry_every_steps > 0 to record it).\n")
  roles = _roles(table)
  lines = ["## FP8 telemetry", "",
           "Per GEMM operand: the lowest per-layer SNR (dB) and the highest per-layer "
           "flush-to-zero fraction (nonzero inputs that quantize to 0), each per-layer value "
           "averaged over telemetry steps and seeds.", "",
           "| recipe | " + " | ".join(f"{g} {o}" for g, o in roles) + " |",
           "|---|" + "---|" * len(roles)]
  for recipe in sorted(table):
    cells = []
    for gemm, operand in roles:
      snr = [v for k, v in table[recipe].items() if k[1:] == (gemm, operand, "snr_db")]
      flush = [v for k, v in table[recipe].items() if k[1:] == (gemm, operand, "flush_frac")]
      cells.append(f"{min(snr):.1f} dB / {100 * max(flush):.3g}%" if snr and flush else "exact")
    lines.append(f"| `{recipe}` | " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"
