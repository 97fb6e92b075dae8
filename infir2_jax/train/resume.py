"""Resuming with another config than the run's: shape changes are refused, others recorded.

The run's config is WORKDIR/config.json. A change that alters the train state's structure
(a parameter's shape, the optimizer's state) cannot resume a checkpoint: it is an error
naming the keys that do it. Any other change (lr, steps, recipe, batch size, seed, mesh,
...) is deliberate: it is printed, appended to WORKDIR/config_changes.jsonl with the step
it takes effect at, and config.json then holds the config in effect.
"""

import json
from collections.abc import Callable
from typing import Any

import ml_collections

from infir2_jax.config import TrainConfig
from infir2_jax.errors import ConfigError
from infir2_jax.train import rundir

# Read only for a new run: a resumed run's state comes from its checkpoint.
_IGNORED = ("init.", "checkpoint.accept_")   # the accept_* flags hold for one start
# Keys whose change gives another data stream from the resumed step on.
_DATA_STREAM = ("seed", "batch_size", "seq_len", "data.")
_NOT_DATA_STREAM = ("data.num_workers", "data.prefetch", "data.cache_dir")


class ResumeConfigError(ConfigError):
  """The config cannot resume the run's checkpoints (the train state has another shape)."""


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      out.update(_flat(value, f"{prefix}{key}."))
    else:
      out[prefix + key] = value
  return out


def _as_json(tree: dict[str, Any]) -> dict[str, Any]:
  return json.loads(json.dumps(tree, default=str))  # tuples -> lists, as config.json has them


def changed_keys(old: dict[str, Any], new: dict[str, Any]) -> dict[str, list[Any]]:
  """{key: [old, new]} of the leaves both configs have and that differ (init.* left out)."""
  a, b = _flat(_as_json(old)), _flat(_as_json(new))
  return {k: [a[k], b[k]] for k in sorted(set(a) & set(b))
          if a[k] != b[k] and not k.startswith(_IGNORED)}


def _with(values: dict[str, Any], key: str, value) -> dict[str, Any]:
  out = json.loads(json.dumps(values))
  *path, leaf = key.split(".")
  section = out
  for name in path:
    section = section[name]
  section[leaf] = value
  return out


def config_of(values: dict[str, Any]) -> TrainConfig:
  """The TrainConfig of a config.json's values (keys older code had and this one lacks are
  dropped)."""
  known = _flat(TrainConfig().to_dict())
  kept = {k: v for k, v in _flat(values).items() if k in known}  # keys of older code dropped
  tree: dict[str, Any] = {}
  for key, value in kept.items():
    *path, leaf = key.split(".")
    section = tree
    for name in path:
      section = section.setdefault(name, {})
    section[leaf] = value
  return TrainConfig.from_config_dict(ml_collections.ConfigDict(tree))


def check(cfg: TrainConfig, workdir: str, structure: Callable[[TrainConfig], Any],
          saved: dict[str, Any] | None = None) -> dict[str, list[Any]]:
  """The changes of `cfg` against the run's config.json, else against `saved` (the config
  the newest checkpoint carries); {} when there is neither.

  Raises:
    ResumeConfigError: the changes give the train state another structure; names the keys.
  """
  old = rundir.config_dict(workdir) or saved
  if old is None:
    return {}
  changes = changed_keys(old, cfg.to_dict())
  if not changes:
    return {}
  old_cfg = config_of(old)
  if structure(old_cfg) == structure(cfg):
    return changes
  culprits = []
  for key, (_, value) in changes.items():
    try:
      if structure(config_of(_with(old, key, value))) != structure(old_cfg):
        culprits.append(key)
    except ValueError:  # not valid on its own: it changes along with another key
      culprits.append(key)
  culprits = culprits or list(changes)
  listed = ", ".join(f"{k}={changes[k][1]!r} (the run has {changes[k][0]!r})" for k in culprits)
  raise ResumeConfigError(
      f"{workdir} cannot resume with {listed}: its checkpoints hold a train state of another "
      f"shape. Use the run's values (config.json), or start a new --workdir "
      f"(--config.init.from_run={workdir} starts from its weights if the model shape is kept)")


def changes_data(changes: dict[str, list[Any]]) -> bool:
  """Whether the changes give other data on purpose (a data.* key, or the seed, batch or
  sequence length, which the splits and rows may depend on)."""
  return any(k.startswith(_DATA_STREAM) and k not in _NOT_DATA_STREAM for k in changes)


def record(cfg: TrainConfig, workdir: str, step: int, changes: dict[str, list[Any]]) -> str:
  """Appends the changes to config_changes.jsonl, rewrites config.json; returns the line to
  print."""
  rundir.append_config_changes(workdir, step, changes)
  rundir.write_config(workdir, cfg)
  listed = ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in changes.items())
  stream = [k for k in changes if k.startswith(_DATA_STREAM) and k not in _NOT_DATA_STREAM]
  note = (f"; the data stream differs from step {step + 1} on ({', '.join(stream)})"
          if stream else "")
  return (f"config differs from the run's: {listed}; resuming from step {step} with the new "
          f"values (recorded in {rundir.CONFIG_CHANGES_FILE}){note}")
