"""A training run's directory: the one owner of its layout, and of reading it back.

  WORKDIR/config.json                the TrainConfig the run started with (JSON)
  WORKDIR/metrics.jsonl              one JSON object per logged step, and eval_loss lines
  WORKDIR/tb/                        TensorBoard event files
  WORKDIR/metrics_superseded.jsonl   rows a resume moved out of metrics.jsonl (steps logged
                                     after the checkpoint it resumed from)
  WORKDIR/config_changes.jsonl       config keys changed on a resume: {"step", "changes"}
  WORKDIR/checkpoints/<step>/state   the train state (orbax: step, params, opt_state)
  WORKDIR/checkpoints/<step>/data    the data iterator's state (grain)
  WORKDIR/checkpoints/<step>/run     the run's identity and data fingerprint (identity.py),
                                     the arrays' fingerprint (integrity.py)
  WORKDIR/checkpoints/<step>/checksums.json   sha256 of each file of the step (integrity.py)
  WORKDIR/checkpoints_damaged/<step>  checkpoints that failed to restore, moved aside
  WORKDIR/checkpoints_rewound/<step>  checkpoints after the one a continued run restarted
                                     from (opt.rewind_to_stable), moved aside
  WORKDIR/profile/                   traces of the steps profile.* asked for (jax.profiler)
  WORKDIR/run.json                   the run id, made at the run's first start (identity.py)
  WORKDIR/trackers.json              W&B / MLflow run ids (log.wandb, log.mlflow): a resume
                                     logs to the same tracker run
  WORKDIR/.lock                      who holds the run (pid, host); the trainer flocks it and
                                     WORKDIR itself (train/runlock.py)
"""

import json
import os
import shutil
from typing import Any

from infir2_jax import errors
from infir2_jax.errors import ConfigError, NotFound

CONFIG_FILE = "config.json"
CONFIG_CHANGES_FILE = "config_changes.jsonl"
METRICS_FILE = "metrics.jsonl"
# Rows a resumed run dropped from metrics.jsonl (logged after the checkpoint it resumed from).
SUPERSEDED_METRICS_FILE = "metrics_superseded.jsonl"
TENSORBOARD_DIR = "tb"
CHECKPOINTS_DIR = "checkpoints"
DAMAGED_DIR = "checkpoints_damaged"
REWOUND_DIR = "checkpoints_rewound"
PROFILE_DIR = "profile"
TRACKERS_FILE = "trackers.json"
LOCK_FILE = ".lock"
RUN_FILE = "run.json"
STATE_ITEM = "state"   # orbax item names inside a checkpoint step
DATA_ITEM = "data"
RUN_ITEM = "run"       # JSON: identity.describe() and the arrays' fingerprint
# orbax writes a step into "<step>.orbax-checkpoint-tmp..." and renames it when complete;
# it writes _CHECKPOINT_METADATA into the folder before that rename.
ORBAX_TMP_MARK = ".orbax-checkpoint-tmp"
ORBAX_STEP_METADATA = "_CHECKPOINT_METADATA"


def read_json(path: str,
              fix: str = "restore it from a copy, or delete it") -> dict[str, Any] | None:
  """The JSON in `path`, None when there is none; a damaged file is an error naming it."""
  if not os.path.exists(path):
    return None
  return errors.read_json_file(path, fix)


def write_json(path: str, obj) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=2, default=str)
  os.replace(tmp, path)  # atomic: a killed process never leaves half a file


def check_workdir(workdir: str) -> None:
  """A run directory that is a file (or lies under one) is a ConfigError, not os.makedirs'
  FileExistsError / NotADirectoryError at some later point."""
  path = os.path.abspath(workdir)
  while not os.path.exists(path) and os.path.dirname(path) != path:
    path = os.path.dirname(path)
  if not os.path.isdir(path):
    raise ConfigError(f"--workdir={workdir}: {path} is a file, not a folder; give a run "
                      "directory that is a folder or does not exist yet")


def config_dict(workdir: str) -> dict[str, Any] | None:
  """WORKDIR/config.json as a plain dict, or None when there is none."""
  return read_json(os.path.join(workdir, CONFIG_FILE), fix=(
      "restore it from a copy, or delete it and start the trainer once more with the run's "
      "own --config flags, which writes it again (the checkpoints are kept)"))


def write_config(workdir: str, cfg) -> None:
  """Writes WORKDIR/config.json of a TrainConfig."""
  write_json(os.path.join(workdir, CONFIG_FILE), cfg.to_dict())


def read_config(workdir: str):
  """The TrainConfig a run was started with (WORKDIR/config.json)."""
  import ml_collections  # pylint: disable=g-import-not-at-top
  from infir2_jax.config import TrainConfig  # pylint: disable=g-import-not-at-top
  values = config_dict(workdir)
  if values is None:
    raise NotFound(f"{os.path.join(workdir, CONFIG_FILE)} not found: is {workdir} "
                   "a run directory?")
  return TrainConfig.from_config_dict(ml_collections.ConfigDict(values))


def checkpoints_dir(workdir: str) -> str:
  """WORKDIR/checkpoints as an absolute path (orbax needs one)."""
  return os.path.join(os.path.abspath(workdir), CHECKPOINTS_DIR)


def step_dir(workdir: str, step: int) -> str:
  return os.path.join(checkpoints_dir(workdir), str(step))


def step_dirs(workdir: str) -> list[int]:
  """Steps with a folder under checkpoints/, complete or not, ascending."""
  root = checkpoints_dir(workdir)
  return sorted(int(d) for d in os.listdir(root) if d.isdigit()) if os.path.isdir(root) else []


def is_committed(path: str) -> bool:
  """A step folder orbax finished (it has the step metadata orbax writes before its rename)."""
  return os.path.isfile(os.path.join(path, ORBAX_STEP_METADATA))


def checkpoint_steps(workdir: str) -> list[int]:
  """Steps of the committed checkpoints, ascending (readers never see a half-written one)."""
  return [s for s in step_dirs(workdir) if is_committed(step_dir(workdir, s))]


def pending_step_dirs(workdir: str) -> list[str]:
  """orbax's temporary step folders that hold their step metadata (about to be renamed)."""
  root = checkpoints_dir(workdir)
  if not os.path.isdir(root):
    return []
  names = [d for d in os.listdir(root)
           if ORBAX_TMP_MARK in d and d.split(".", 1)[0].isdigit()]
  return [os.path.join(root, d) for d in names if is_committed(os.path.join(root, d))]


def remove_tmp_leftovers(workdir: str) -> list[str]:
  """Removes what killed writers left: orbax's temporary step folders and our `*.tmp` files.

  Only for the run's owner (the lock holder): another writer's files would be in flight.
  """
  removed = []
  root = checkpoints_dir(workdir)
  for d in (os.listdir(root) if os.path.isdir(root) else []):
    if ORBAX_TMP_MARK in d:
      shutil.rmtree(os.path.join(root, d), ignore_errors=True)
      removed.append(os.path.join(root, d))
  for f in (os.listdir(workdir) if os.path.isdir(workdir) else []):
    if f.endswith(".tmp") and os.path.isfile(os.path.join(workdir, f)):
      os.remove(os.path.join(workdir, f))
      removed.append(os.path.join(workdir, f))
  return removed


def missing_root(workdir: str) -> str | None:
  """The outermost folder of `workdir`'s path that does not exist yet (None: it exists)."""
  path, root = os.path.abspath(workdir), None
  while not os.path.exists(path):
    root, path = path, os.path.dirname(path)
  return root


def remove_unused(workdir: str, created: str | None) -> bool:
  """After a failed start in a new (or empty) workdir: removes what the start created, unless
  a run wrote something there (a committed checkpoint, a metrics row). `created` is the
  folder missing_root() named before the start (None: workdir existed, empty; only its
  contents go). Returns whether anything was removed."""
  if not os.path.isdir(workdir) or checkpoint_steps(workdir):
    return False
  metrics = os.path.join(workdir, METRICS_FILE)
  if os.path.exists(metrics) and os.path.getsize(metrics):
    return False
  if created is not None:
    shutil.rmtree(created, ignore_errors=True)
  else:
    for name in os.listdir(workdir):
      path = os.path.join(workdir, name)
      shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)
  return True


def damaged_dir(workdir: str) -> str:
  return os.path.join(os.path.abspath(workdir), DAMAGED_DIR)


def damaged_path(workdir: str, step: int) -> str:
  """A free name for checkpoint `step` under checkpoints_damaged/: <step>, <step>-1, ..."""
  base = os.path.join(damaged_dir(workdir), str(step))
  path, n = base, 0
  while os.path.exists(path):
    n += 1
    path = f"{base}-{n}"
  return path


def rewound_path(workdir: str, step: int) -> str:
  """A free name for checkpoint `step` under checkpoints_rewound/: <step>, <step>-1, ..."""
  base = os.path.join(os.path.abspath(workdir), REWOUND_DIR, str(step))
  path, n = base, 0
  while os.path.exists(path):
    n += 1
    path = f"{base}-{n}"
  return path


def append_config_changes(workdir: str, step: int, changes: dict[str, Any]) -> None:
  """Appends {"step", "changes": {key: [old, new]}} to WORKDIR/config_changes.jsonl."""
  with open(os.path.join(workdir, CONFIG_CHANGES_FILE), "a") as f:
    f.write(json.dumps({"step": step, "changes": changes}, default=str) + "\n")


def checkpoint_item(workdir: str, step: int | None = None,
                    item: str = STATE_ITEM) -> tuple[str, int]:
  """(WORKDIR/checkpoints/<step>/<item>, step); step None = the latest."""
  steps = checkpoint_steps(workdir)
  if not steps:
    raise NotFound(f"no checkpoints in {checkpoints_dir(workdir)}")
  if step is None:
    step = steps[-1]
  elif step not in steps:
    raise ConfigError(f"step {step} is not a checkpoint in {checkpoints_dir(workdir)}; "
                      f"available: {steps}")
  return os.path.join(checkpoints_dir(workdir), str(step), item), step


def read_metrics(run_dir: str) -> list[dict[str, Any]]:
  """metrics.jsonl lines with the LAST record of each (step, kind) kept, in step order.

  A resumed run re-logs the steps after its last checkpoint; the later lines win. "NaN" /
  "inf" strings (how the writer keeps non-finite numbers) become floats.
  """
  path = os.path.join(run_dir, METRICS_FILE)
  if not os.path.exists(path):
    return []
  by_key: dict[tuple[int, bool], dict[str, Any]] = {}
  with open(path) as f:
    for line in f:
      line = line.strip()
      if not line:
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError:
        continue  # a line cut short by a kill
      record = {k: (float(v) if isinstance(v, str) and v.lower() in ("nan", "inf", "-inf")
                    else v) for k, v in record.items()}
      key = (int(record["step"]), "eval_loss" in record)
      by_key[key] = record
  return [by_key[k] for k in sorted(by_key)]


def final_metrics(run_dir: str) -> dict[str, Any]:
  """The last train-step record and the last eval loss of a run."""
  records = read_metrics(run_dir)
  train = [r for r in records if "loss" in r]
  evals = [r for r in records if "eval_loss" in r]
  out = dict(train[-1]) if train else {}
  if evals:
    out["eval_loss"] = evals[-1]["eval_loss"]
    out["eval_step"] = evals[-1]["step"]
  return out
