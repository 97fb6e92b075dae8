"""A sweep's grid: the spec a sweep config file declares, its runs, and each run's command.

A sweep config file's get_config() returns a ConfigDict with
  base       the train config spec the runs start from ("configs/default.py[:variant]"),
  overrides  fixed changes to it, nested like the train config (overrides.opt.lr = 1e-3),
  grid       the axes, nested the same way, each a tuple of values (grid.seed = (0, 1, 2)),
  report     defaults of infir2_jax.ablation.report (reference, margin, last_k, alpha).
"""

import dataclasses
import itertools
import os
import re
from typing import Any

from infir2_jax.config import flat_keys, get_config_dict, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SECTIONS = ("base", "overrides", "grid", "report")
# Short names of axes in run names; other keys use their last component.
_SHORT = {"precision.recipe": "", "seed": "seed"}


@dataclasses.dataclass(frozen=True)
class SweepSpec:
  """A sweep: the base config, fixed overrides, the grid axes and the report settings."""
  base: str
  overrides: tuple[tuple[str, Any], ...] = ()
  axes: tuple[tuple[str, tuple[Any, ...]], ...] = ()
  report: tuple[tuple[str, Any], ...] = ()

  def __post_init__(self):
    for key, values in self.axes:
      if not isinstance(values, (tuple, list)) or not values:
        raise ValueError(f"grid.{key} must be a non-empty tuple of values, got {values!r}")
      if len(set(map(repr, values))) != len(values):
        raise ValueError(f"grid.{key} has repeated values: {values!r}")
    clash = set(dict(self.overrides)) & set(dict(self.axes))
    if clash:
      raise ValueError(f"keys {sorted(clash)} are both in overrides and in grid; keep one")

  def to_dict(self) -> dict[str, Any]:
    return {"base": self.base, "overrides": dict(self.overrides),
            "grid": {k: list(v) for k, v in self.axes}, "report": dict(self.report)}

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "SweepSpec":
    unknown = sorted(set(d) - set(SECTIONS))
    if unknown:
      raise ValueError(f"unknown sweep config section(s) {unknown}; valid: {list(SECTIONS)}")
    if not d.get("base") and d.get("base") != "":
      raise ValueError("a sweep config needs `base`, the train config spec (\"\" = default)")
    axes = [(k, tuple(v) if isinstance(v, (list, tuple)) else v)
            for k, v in _flatten(d.get("grid") or {}).items()]
    # The seed varies slowest, so a sweep stopped early has every recipe of the first seeds.
    axes.sort(key=lambda kv: kv[0] != "seed")
    return cls(d["base"], tuple(_flatten(d.get("overrides") or {}).items()), tuple(axes),
               tuple((d.get("report") or {}).items()))


@dataclasses.dataclass(frozen=True)
class Run:
  """One point of the grid: its directory name, axis values and every override it trains with."""
  name: str
  axes: tuple[tuple[str, Any], ...]
  overrides: tuple[tuple[str, Any], ...]


def _flatten(tree, prefix: str = "") -> dict[str, Any]:
  """{"opt": {"lr": 1}} (dict or ConfigDict) -> {"opt.lr": 1}; dotted keys pass through."""
  out = {}
  for key, value in (tree.items() if hasattr(tree, "items") else []):
    if hasattr(value, "items"):
      out.update(_flatten(value, f"{prefix}{key}."))
    else:
      out[prefix + key] = value
  return out


def load_spec(spec: str) -> SweepSpec:
  """Reads a sweep config file ("configs/sweeps/x.py[:variant]") into a SweepSpec."""
  return spec_from_config(get_config_dict(spec))


def spec_from_config(config) -> SweepSpec:
  """A SweepSpec from the ConfigDict (or dict) a sweep config file returns; checks the keys."""
  d = config.to_dict() if hasattr(config, "to_dict") else dict(config)
  spec = SweepSpec.from_dict(d)
  valid = set(flat_keys())
  for key in [k for k, _ in spec.overrides] + [k for k, _ in spec.axes]:
    if key not in valid:
      raise ValueError(f"sweep key {key!r} is not a train config key; valid: {sorted(valid)}")
  return spec


def _value_text(value) -> str:
  text = "-".join(map(str, value)) if isinstance(value, (tuple, list)) else str(value)
  return re.sub(r"[^A-Za-z0-9._+-]+", "_", text) or "_"


def expand(spec: SweepSpec) -> list[Run]:
  """Every run of the grid, seed-major, with unique filesystem-safe names."""
  keys = [k for k, _ in spec.axes]
  lasts = [k.rsplit(".", 1)[-1] for k in keys]
  runs, names = [], set()
  for values in itertools.product(*(v for _, v in spec.axes)):
    parts = []
    for key, last, value in zip(keys, lasts, values):
      short = _SHORT.get(key, key if lasts.count(last) > 1 else last)
      parts.append(f"{short}{_value_text(value)}" if short else _value_text(value))
    # Recipe first, seed last, the other axes between (in declared order).
    order = sorted(range(len(keys)), key=lambda i: (keys[i] != "precision.recipe",
                                                    keys[i] == "seed"))
    name = "-".join(parts[i] for i in order) or "run"
    if name in names:
      raise ValueError(f"two runs would share the directory name {name!r}; rename a value")
    names.add(name)
    axes = tuple(zip(keys, values))
    runs.append(Run(name, axes, spec.overrides + axes))
  return runs


def check_runs(spec: SweepSpec, runs: list[Run]) -> None:
  """Builds each run's TrainConfig, so a bad key or value fails before anything trains."""
  for run in runs:
    try:
      load_config(resolve_base(spec.base), dict(run.overrides))
    except (ValueError, FileNotFoundError) as e:
      raise ValueError(f"run {run.name}: {e}") from e


def resolve_base(base: str) -> str:
  """The base config spec, found relative to the current directory or else the repo root."""
  if not base:
    return base
  path, sep, variant = base.partition(":")
  if not os.path.exists(path) and os.path.exists(os.path.join(ROOT, path)):
    path = os.path.join(ROOT, path)
  return path + sep + variant


def _flag_value(value) -> str:
  if isinstance(value, (tuple, list)):
    return repr(tuple(value))
  return str(value)


def train_command(spec: SweepSpec, run: Run, workdir: str, python: str = "python") -> list[str]:
  """argv of `python -m infir2_jax.train` for one run."""
  argv = [python, "-m", "infir2_jax.train"]
  if spec.base:
    argv.append(f"--config={spec.base}")
  argv += [f"--config.{k}={_flag_value(v)}" for k, v in run.overrides]
  return argv + [f"--workdir={os.path.join(workdir, run.name)}"]
