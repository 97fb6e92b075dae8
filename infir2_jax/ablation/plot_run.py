"""Loss curves of one run (or a few side by side), no sweep needed.

  python -m infir2_jax.ablation.plot_run runs/default                 # -> runs/default/loss.png
  python -m infir2_jax.ablation.plot_run runs/a runs/b --out=ab.png   # two runs on one figure

Train loss (raw, and its moving average when there are many steps) and validation loss per
step, read from each run's metrics.jsonl (a resumed run's re-logged steps count once).
"""

import os

import numpy as np

from infir2_jax.ablation import plots
from infir2_jax.train import rundir


def curves(run_dir: str) -> dict[str, np.ndarray]:
  """{"steps", "loss", "eval_steps", "eval_loss"} of a run's metrics.jsonl."""
  records = rundir.read_metrics(run_dir)
  if not records:
    raise FileNotFoundError(f"no {rundir.METRICS_FILE} with records in {run_dir!r}")
  train = [r for r in records if "loss" in r]
  evals = [r for r in records if "eval_loss" in r]
  return {"steps": np.array([r["step"] for r in train]),
          "loss": np.array([r["loss"] for r in train], np.float64),
          "eval_steps": np.array([r["step"] for r in evals]),
          "eval_loss": np.array([r["eval_loss"] for r in evals], np.float64)}


def plot_runs(run_dirs: list[str], out: str):
  """Draws the runs' loss curves into `out` (PNG); returns the matplotlib figure (closed)."""
  plt = plots._pyplot()  # pylint: disable=protected-access
  fig, ax = plt.subplots(figsize=(8, 4.5))
  for run_dir in run_dirs:
    c = curves(run_dir)
    name = os.path.basename(os.path.normpath(run_dir))
    window = max(1, c["steps"].size // 25)
    (line,) = ax.plot(c["steps"], c["loss"], lw=0.8, alpha=0.35 if window > 1 else 1.0,
                      label=f"{name} train")
    if window > 1:
      ax.plot(c["steps"], plots.smooth(c["loss"], window), lw=1.5, color=line.get_color(),
              label=f"{name} train ({window}-step average)")
    if c["eval_steps"].size:
      ax.plot(c["eval_steps"], c["eval_loss"], "o--", ms=4, lw=1, color=line.get_color(),
              label=f"{name} validation")
  ax.set(xlabel="step", ylabel="loss", title="loss" if len(run_dirs) > 1 else
         f"loss of {os.path.normpath(run_dirs[0])}")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(out, dpi=110)
  plt.close(fig)
  return fig


def main(argv=None) -> None:
  from absl import app, flags  # pylint: disable=g-import-not-at-top
  flags.DEFINE_string("out", None, "PNG to write (default: RUN_DIR/loss.png of the first run).")

  def _main(args):
    if len(args) < 2:
      raise app.UsageError("usage: python -m infir2_jax.ablation.plot_run RUN_DIR [RUN_DIR ...]")
    out = flags.FLAGS.out or os.path.join(args[1], "loss.png")
    plot_runs(args[1:], out)
    print(f"wrote {out}")

  app.run(_main, argv=argv)


if __name__ == "__main__":
  main()
