"""A run's identity and its data's fingerprint, written into each checkpoint, checked on resume.

WORKDIR/run.json holds the run id, made at the run's first start. Every checkpoint carries
it in its `run` item, with the recipe, seed and model shape, the whole config and the
fingerprint of the data sources (content hashes of the source files, the index of prepared
directories, the token counts of the splits). A resume refuses, before training, a
checkpoint of another run (checkpoint.accept_other_run=True takes it on purpose) and data
that changed since the checkpoint (checkpoint.accept_changed_data=True; recorded in
config_changes.jsonl). A checkpoint of older code without identity restores, said once.
"""

import datetime
import hashlib
import os
import pathlib
import uuid
from collections.abc import Callable
from typing import Any

from infir2_jax.errors import UserError
from infir2_jax.train import rundir

# Larger source files are fingerprinted by size and mtime, not hashed (a start reads them
# all anyway when they are tokenized into memory, but not a 100 GB prepared corpus).
_HASHED_BYTES = 256 << 20


class OtherRunCheckpoint(UserError, RuntimeError):
  """The checkpoint to resume from was written by another run."""


class DataChanged(UserError, RuntimeError):
  """The data behind the config's sources differs from the checkpoint's."""


def _file_digest(path: pathlib.Path) -> str:
  st = path.stat()
  if st.st_size > _HASHED_BYTES:
    return f"size {st.st_size} mtime {st.st_mtime_ns}"
  with open(path, "rb") as f:
    return "sha256 " + hashlib.file_digest(f, "sha256").hexdigest()


def data_fingerprint(cfg, stats: dict) -> dict[str, Any]:
  """{"files": {path: digest}, split counts} of the data sources of a DataConfig."""
  from infir2_jax.data import mixture, pipeline, shards, sources  # pylint: disable=g-import-not-at-top
  source, val_source = pipeline.default_sources(cfg)
  files = {}
  for spec in mixture.parse(source, val_source, cfg.mixture):
    for text in (spec.spec, spec.val_spec):
      for item in (s.strip() for s in text.split(",") if s.strip()):
        if shards.is_prepared(item):   # its index lists every shard with its size
          index = pathlib.Path(os.path.expanduser(item)) / shards.INDEX
          files[str(index)] = _file_digest(index) if index.exists() else "unfinished"
        else:
          for f in sources.resolve_sources(item, cfg.format, cfg.cache_dir):
            files[str(f)] = _file_digest(f)
  train, val = stats["train"], stats["val"]
  return {"files": files, "train_records": train.records, "train_tokens": train.tokens,
          "val_records": val.records, "val_tokens": val.tokens}


def describe(cfg, run_id: str, data: dict[str, Any]) -> dict[str, Any]:
  """What a checkpoint carries of its run (the `run` item)."""
  m = cfg.model
  return {"run_id": run_id, "recipe": cfg.precision.recipe, "seed": cfg.seed,
          "model": {"hidden_size": m.hidden_size, "intermediate_size": m.intermediate_size,
                    "num_layers": m.num_layers, "num_heads": m.num_heads,
                    "num_kv_heads": m.num_kv_heads, "vocab_size": m.vocab_size},
          "config": cfg.to_dict(), "data": data}


def run_id(workdir: str, first_identity: dict[str, Any] | None) -> str:
  """WORKDIR/run.json's run id; where there is none (or it is unreadable), the run's oldest
  checkpoint's (a new run, or one of older code: a new one), written to run.json
  (process 0)."""
  path = os.path.join(workdir, rundir.RUN_FILE)
  try:
    info = rundir.read_json(path)
  except (OSError, ValueError):  # damaged: the checkpoints know the run id as well
    info = None
  if isinstance(info, dict) and isinstance(info.get("run_id"), str):
    return info["run_id"]
  rid = (first_identity or {}).get("run_id") or uuid.uuid4().hex[:16]
  import jax  # pylint: disable=g-import-not-at-top
  if jax.process_index() == 0:
    rundir.write_json(path, {"run_id": rid, "written": datetime.datetime.now().isoformat(
        timespec="seconds")})
  return rid


def _who(identity: dict[str, Any]) -> str:
  return (f"run {identity.get('run_id')}, recipe {identity.get('recipe')}, seed "
          f"{identity.get('seed')}")


def _data_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
  out = []
  for key in ("train_tokens", "val_tokens", "train_records", "val_records"):
    if old.get(key) != new.get(key):
      out.append(f"{key.replace('_', ' ')} {old.get(key):,} -> {new.get(key):,}"
                 if isinstance(old.get(key), int) and isinstance(new.get(key), int) else
                 f"{key.replace('_', ' ')} {old.get(key)} -> {new.get(key)}")
  a, b = old.get("files", {}), new.get("files", {})
  changed = sorted(f for f in a if f in b and a[f] != b[f])
  for what, names in (("changed", changed), ("added", sorted(set(b) - set(a))),
                      ("gone", sorted(set(a) - set(b)))):
    if names:
      out.append(f"{what}: {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}")
  return out


def check_restored(saved: dict[str, Any] | None, current: dict[str, Any], cfg, step: int,
                   workdir: str, deliberate_data: bool, log: Callable[[str], None]) -> None:
  """Refuses a restored checkpoint of another run, or of other data, before training.

  Args:
    saved: the checkpoint's `run` item (None: written by older code, not checked).
    current: describe() of this run.
    deliberate_data: a data.* key changed on purpose (recorded already): other data is
      expected, said, not refused.
  Raises:
    OtherRunCheckpoint, DataChanged: with the way to accept it on purpose.
  """
  where = f"checkpoint {step} ({rundir.step_dir(workdir, step)})"
  if saved is None:
    log(f"{where} carries no run identity or data fingerprint (written by an older "
        "version): resumed without checking that it is this run's and its data unchanged")
    return
  if saved.get("run_id") != current["run_id"]:
    text = (f"{where} belongs to another run ({_who(saved)}); this run directory is "
            f"{_who(current)} ({rundir.RUN_FILE})")
    if not cfg.checkpoint.accept_other_run:
      raise OtherRunCheckpoint(
          f"{text}. Move it out of {rundir.checkpoints_dir(workdir)} (the run resumes from "
          "its own newest), or pass --config.checkpoint.accept_other_run=True to resume from "
          "it on purpose")
    log(f"{text}: resumed from it as asked (checkpoint.accept_other_run)")
  changes = _data_changes(saved.get("data") or {}, current["data"])
  if not changes:
    return
  text = f"the data differs from {where}'s: {'; '.join(changes)}"
  if not (deliberate_data or cfg.checkpoint.accept_changed_data):
    raise DataChanged(
        f"{text}. Restore the data the run trained on, or pass "
        "--config.checkpoint.accept_changed_data=True to go on with this data on purpose "
        f"(recorded in {rundir.CONFIG_CHANGES_FILE})")
  if not deliberate_data and _is_primary():
    rundir.append_config_changes(workdir, step, {"data": [saved.get("data"), current["data"]]})
  log(f"{text}; going on with this data from step {step + 1} (recorded in "
      f"{rundir.CONFIG_CHANGES_FILE})" if not deliberate_data else
      f"{text}, as the config changes it (recorded with the config change)")


def _is_primary() -> bool:
  import jax  # pylint: disable=g-import-not-at-top
  return jax.process_index() == 0
