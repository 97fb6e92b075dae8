"""Optional experiment trackers beside TensorBoard: Weights & Biases and MLflow (log.wandb,
log.mlflow), each only when its package is installed.

Each gets every row MetricsWriter writes (train rows, eval rows, telemetry) with its step,
and the run's config once. A resumed run attaches to the same tracker run: its id is kept in
WORKDIR/trackers.json (rundir). A tracker that fails to log never stops training: the error
is printed once and that tracker is dropped.
"""

import importlib
import os
import sys
from typing import Any

from infir2_jax.config import LogConfig
from infir2_jax.errors import ConfigError
from infir2_jax.train import rundir

_PACKAGES = {"wandb": "wandb", "mlflow": "mlflow"}


def _import(name: str):
  try:
    return importlib.import_module(name)
  except ImportError:
    return None


def check_available(cfg: LogConfig) -> None:
  """Raises ConfigError for a tracker asked for whose package is not installed."""
  for key, package in _PACKAGES.items():
    if getattr(cfg, key) and _import(package) is None:
      raise ConfigError(f"log.{key}=True but the {package!r} package is not installed: "
                        f"`pip install {package}`, or --config.log.{key}=False")


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      out.update(_flat(value, f"{prefix}{key}."))
    else:
      out[prefix + key] = value
  return out


class _Wandb:
  def __init__(self, cfg: LogConfig, workdir: str, config: dict, run_id: str | None):
    self.wandb = _import("wandb")
    self.run = self.wandb.init(project=cfg.project, name=cfg.run_name or _name(workdir),
                               id=run_id, resume="allow", config=config,
                               dir=os.path.abspath(workdir))
    self.id = getattr(self.run, "id", None)

  def log(self, step: int, scalars: dict[str, float]) -> None:
    self.wandb.log(scalars, step=step)

  def close(self) -> None:
    self.wandb.finish()


class _MLflow:
  def __init__(self, cfg: LogConfig, workdir: str, config: dict, run_id: str | None):
    self.mlflow = _import("mlflow")
    self.mlflow.set_experiment(cfg.project)
    run = self.mlflow.start_run(run_id=run_id, run_name=None if run_id else
                                (cfg.run_name or _name(workdir)))
    self.id = run.info.run_id
    if run_id is None:   # params are written once; MLflow refuses to change them
      self.mlflow.log_params({k: str(v) for k, v in _flat(config).items()})

  def log(self, step: int, scalars: dict[str, float]) -> None:
    self.mlflow.log_metrics(scalars, step=step)

  def close(self) -> None:
    self.mlflow.end_run()


_TRACKERS = {"wandb": _Wandb, "mlflow": _MLflow}


def _name(workdir: str) -> str:
  return os.path.basename(os.path.normpath(os.path.abspath(workdir)))


class Trackers:
  """The trackers log.* asks for, fed by MetricsWriter (process 0 only)."""

  def __init__(self, cfg: LogConfig, workdir: str, config: dict | None):
    self._live: dict[str, Any] = {}
    wanted = [key for key in _TRACKERS if getattr(cfg, key)]
    if not wanted:
      return
    check_available(cfg)
    path = os.path.join(workdir, rundir.TRACKERS_FILE)
    ids = rundir.read_json(path) or {}
    for key in wanted:
      self._live[key] = _TRACKERS[key](cfg, workdir, config or {}, ids.get(key))
      ids[key] = self._live[key].id
    rundir.write_json(path, ids)

  def log(self, step: int, scalars: dict[str, Any]) -> None:
    numbers = {k: float(v) for k, v in scalars.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)}
    for key, tracker in list(self._live.items()):
      try:
        tracker.log(step, numbers)
      except Exception as e:  # pylint: disable=broad-except  # a tracker never stops training
        print(f"warning: log.{key}: logging failed ({type(e).__name__}: {e}); no more "
              f"{key} logging in this run", file=sys.stderr)
        del self._live[key]

  def close(self) -> None:
    for tracker in self._live.values():
      tracker.close()
    self._live = {}
