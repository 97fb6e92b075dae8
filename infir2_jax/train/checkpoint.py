"""orbax checkpoints of the train state, the data iterator and the run's identity, saved
together, and reading a run's params back (for a new run, an export or an evaluation).

Each checkpoint is checksummed as it is written (train/integrity.py) and verified before it
is restored (one without checksums: its fingerprint and Adam's moment bounds). Resuming
takes the newest checkpoint that restores; one that does not (damaged, incomplete,
non-finite) is named with the reason in one line and moved to WORKDIR/checkpoints_damaged/,
never deleted. A config that does not fit the checkpoint is an error and moves nothing.
A save that fails, in the background or not, is a SaveFailed that stops the run.
"""

import contextlib
import errno
import logging
import os
import re
import resource
import shutil
from collections.abc import Callable, Iterator

import flax.traverse_util
import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint.checkpoint_managers import preservation_policy as preservation

from infir2_jax import errors
from infir2_jax.config import CheckpointConfig
from infir2_jax.data import checkpoint as data_checkpoint
from infir2_jax.errors import UserError
from infir2_jax.train import integrity, rundir
from infir2_jax.train.resume import ResumeConfigError


class _NoItemMetadataWarning(logging.Filter):
  """Hides orbax's "Metadata file does not exist" for a step's `state` item read on its own:
  its _CHECKPOINT_METADATA sits one level up (the CheckpointManager layout), and the files
  are verified by our checksums instead (integrity.py)."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not (record.levelno == logging.WARNING
                and str(record.msg).startswith("Metadata file does not exist"))


logging.getLogger("absl").addFilter(_NoItemMetadataWarning())

_ORBAX_DIR = os.path.dirname(os.path.dirname(os.path.abspath(ocp.__file__))) + os.sep


class _QuietOrbaxSaveErrors(logging.Filter):
  """Drops orbax's ERROR records (multi-line tracebacks from its save threads: future.py,
  async_checkpointer.py, checkpoint_manager.py) while a save of ours is in flight or its
  failure is being reported: that failure is our one SaveFailed line instead. Kept in
  `captured` (each one's first line and the errno it names), for the SaveFailed to find the
  cause in. --debug / INFIR2_DEBUG=1 lets them through. Only records from orbax's own files (it
  logs through absl's logger and the root one); other code's errors always log."""

  KEEP = 20

  def __init__(self):
    super().__init__()
    self.active = 0   # Checkpointers with a save in flight, reporting a failure or closing
    self.captured: list[tuple[str, int | None]] = []  # (first line, errno it names)

  def filter(self, record: logging.LogRecord) -> bool:
    if (not self.active or record.levelno < logging.ERROR
        or not str(record.pathname).startswith(_ORBAX_DIR) or errors.debug_requested()):
      return True
    if len(self.captured) < self.KEEP:  # the text and errno, not the exception (its frames)
      text = record.getMessage().strip()
      exc = record.exc_info[1] if record.exc_info else None
      code = _os_error_code(exc) if exc is not None else None
      self.captured.append((text.split("\n")[0][:300],
                            code if code is not None else _os_error_code(RuntimeError(text))))
    return False


_QUIET_SAVES = _QuietOrbaxSaveErrors()
for _name in ("absl", "", "orbax"):   # absl's, the root logger, orbax's own (stdlib) loggers
  logging.getLogger(_name).addFilter(_QUIET_SAVES)


class SaveFailed(UserError, OSError):
  """A checkpoint save that failed (in the background or not): the run stops at once; the
  message names the checkpoint, the cause and the fix in one line."""


class DiskFullError(SaveFailed):
  """A checkpoint that does not fit on its disk; the message names the directory and sizes."""


class NoRestorableCheckpoint(UserError, RuntimeError):
  """Every checkpoint of a run failed to restore (each was moved aside)."""


class Checkpointer:
  """Saves {state, data-iterator} at a step; restores the latest one into given shardings.

  With `owner` (the trainer, holding the run directory's lock) it first removes what killed
  saves left behind (orbax's `*.orbax-checkpoint-tmp` folders). Checkpoints of `keep_steps`
  are kept beyond checkpoint.keep (the last before a wsd decay: a continued run may restart
  from it, train/continuation.py).
  """

  def __init__(self, workdir: str, cfg: CheckpointConfig, owner: bool = False,
               keep_steps: tuple[int, ...] = (), identity: dict | None = None,
               adam: tuple[float, float] | None = None):
    """identity: what each checkpoint carries of its run (train/identity.py), None = no
    `run` item. adam: (b1, b2), to check the moments of a checkpoint without checksums."""
    self.workdir = workdir
    self.identity, self.adam = identity, adam
    self.restored_identity = None  # the `run` item of the checkpoint restore_latest took
    self.directory = rundir.checkpoints_dir(workdir)
    self.cfg = cfg
    self.keep_steps = tuple(keep_steps)
    self._primary = jax.process_index() == 0
    if owner and self._primary:
      rundir.remove_tmp_leftovers(workdir)
    async_options = (ocp.AsyncOptions(post_finalization_callback=self._seal_pending)
                     if cfg.async_save else None)
    keep = dict(max_to_keep=cfg.keep)
    if self.keep_steps:
      keep = dict(preservation_policy=preservation.AnyPreservationPolicy(
          [preservation.LatestN(cfg.keep), preservation.CustomSteps(self.keep_steps)]))
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            enable_async_checkpointing=cfg.async_save, async_options=async_options,
            create=True, **keep))
    self._state_bytes = None
    self._pending = None  # the step of a save not known to have finished
    self._quieting = False  # orbax's error records are dropped (_QUIET_SAVES)

  def _quiet_orbax(self, on: bool) -> None:
    """From a save until it is known to be whole or its failure is raised, and while closing
    (orbax's close waits for the save again): orbax's error records from the save's threads
    are dropped; the failure is our one SaveFailed line."""
    if on != self._quieting:
      self._quieting = on
      _QUIET_SAVES.active += 1 if on else -1

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def should_save(self, step: int) -> bool:
    return self.cfg.every_steps > 0 and step % self.cfg.every_steps == 0

  def save(self, step: int, state, data_iterator: grain.DatasetIterator | None) -> None:
    """Saves in the background (async_save) or now; any failure is a SaveFailed (a full
    disk a DiskFullError), the previous background save's included."""
    self.wait()  # a failed background save: orbax's next save would wait for it forever
    self._check_writable(step)
    self._check_space(step, state)
    items = {rundir.STATE_ITEM: ocp.args.StandardSave(state)}
    if data_iterator is not None:
      items[rundir.DATA_ITEM] = data_checkpoint.IteratorSave(data_iterator)
    if self.identity is not None:
      items[rundir.RUN_ITEM] = ocp.args.JsonSave(
          {**self.identity, "fingerprint": integrity.state_fingerprint(state)})
    self._pending = step
    if not _QUIET_SAVES.active:
      _QUIET_SAVES.captured.clear()  # an earlier save's records: not about this one
    self._quiet_orbax(True)
    with _TranslateSaveErrors(self, step):
      self._manager.save(step, args=ocp.args.Composite(**items), force=True)
      if not self.cfg.async_save and self._primary:  # committed already: checksum it now
        integrity.write_manifest(rundir.step_dir(self.workdir, step))

  def _seal_pending(self) -> None:
    """orbax's post-finalization callback: checksums the step folder orbax is about to
    rename into place (so a committed checkpoint always carries its checksums)."""
    if self._primary:
      for path in rundir.pending_step_dirs(self.workdir):
        if not integrity.has_manifest(path):
          integrity.write_manifest(path)

  def _check_writable(self, step: int) -> None:
    """SaveFailed unless a folder can be made in checkpoints/: where orbax cannot make the
    step's folder, its save waits 300 s for a signal that never comes, then fails unclearly.
    (The probe's name marks it a leftover that the next owner removes, were it killed.)"""
    probe = os.path.join(self.directory, f"write-probe{rundir.ORBAX_TMP_MARK}-{os.getpid()}")
    try:
      os.mkdir(probe)
      os.rmdir(probe)
    except OSError as e:
      if e.errno in (errno.ENOSPC, errno.EDQUOT):
        raise DiskFullError(_disk_full_message(self.directory, step, self._state_bytes or 0,
                                               shutil.disk_usage(self.directory).free)) from None
      raise SaveFailed(_save_failed_message(self, step, e.errno, e)) from None

  def _check_space(self, step: int, state) -> None:
    if self._state_bytes is None:
      self._state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    free = shutil.disk_usage(self.directory).free
    if free < self._state_bytes:
      raise DiskFullError(_disk_full_message(self.directory, step, self._state_bytes, free))

  def restore(self, step: int, abstract_state, data_iterator: grain.DatasetIterator | None):
    """Restores into `abstract_state` (ShapeDtypeStructs with shardings); the iterator in place.

    Raises integrity.DamagedCheckpoint (with the reason) for a checkpoint that is incomplete,
    fails its checksums or holds non-finite values, or orbax's error.
    """
    path = rundir.step_dir(self.workdir, step)
    if not os.path.isdir(path) or not os.listdir(path):
      raise integrity.DamagedCheckpoint("the step folder is empty")
    if not rundir.is_committed(path):
      raise integrity.DamagedCheckpoint("it is incomplete (orbax never finished writing it)")
    verified = integrity.verify(path)
    identity = self.read_identity(step)
    self._check_shapes(step, abstract_state)
    items = {rundir.STATE_ITEM: ocp.args.StandardRestore(abstract_state)}
    if data_iterator is not None:
      items[rundir.DATA_ITEM] = data_checkpoint.IteratorRestore(data_iterator)
    restored = self._manager.restore(step, args=ocp.args.Composite(**items))
    state = restored[rundir.STATE_ITEM]
    if not bool(all_finite(state)):
      raise integrity.DamagedCheckpoint("its state holds NaN or Inf values")
    if not verified:  # no checksums: what can be checked without them
      if identity and identity.get("fingerprint"):
        integrity.check_fingerprint(state, identity["fingerprint"])
      if self.adam is not None and isinstance(state, dict) and "opt_state" in state:
        integrity.check_adam_moments(state["opt_state"], *self.adam)
    self.restored_identity = identity
    return state

  def read_identity(self, step: int) -> dict | None:
    """The `run` item of checkpoint `step` (None: older code wrote it without one).

    Raises integrity.DamagedCheckpoint where it is there but unreadable."""
    path = os.path.join(rundir.step_dir(self.workdir, step), rundir.RUN_ITEM)
    if not os.path.isdir(path):
      return None
    try:
      identity = rundir.read_json(os.path.join(path, "metadata"))
      if not isinstance(identity, dict):
        raise ValueError("not an object")
      return identity
    except (OSError, ValueError) as e:
      raise integrity.DamagedCheckpoint(f"its {rundir.RUN_ITEM} item is unreadable "
                                        f"({type(e).__name__})") from None

  def first_identity(self) -> dict | None:
    """The `run` item of the oldest checkpoint that has a readable one (the run's own)."""
    for step in rundir.checkpoint_steps(self.workdir):
      try:
        identity = self.read_identity(step)
      except integrity.DamagedCheckpoint:
        continue
      if identity:
        return identity
    return None

  def newest_config(self) -> dict | None:
    """The config the newest committed checkpoint carries (None: none does, or unreadable)."""
    for step in reversed(rundir.checkpoint_steps(self.workdir)):
      try:
        identity = self.read_identity(step)
      except integrity.DamagedCheckpoint:
        continue
      return (identity or {}).get("config")
    return None

  def _check_shapes(self, step: int, abstract_state) -> None:
    """ResumeConfigError (nothing moved) when the checkpoint's arrays have other shapes or
    names than `abstract_state`: a config that does not fit, not damage. An unreadable
    metadata file is damage (orbax's error, moved aside by restore_latest)."""
    path = os.path.join(rundir.step_dir(self.workdir, step), rundir.STATE_ITEM)
    with ocp.PyTreeCheckpointer() as ckptr:
      meta = ckptr.metadata(path)
    tree = meta.item_metadata.tree if hasattr(meta, "item_metadata") else meta.tree
    shape = lambda x: tuple(getattr(x, "shape", ()) or ())
    saved = {integrity.leaf_name(p): shape(x)
             for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}
    wanted = {integrity.leaf_name(p): shape(x)
              for p, x in jax.tree_util.tree_flatten_with_path(abstract_state)[0]}
    if saved == wanted:
      return
    where = f"checkpoint {step} ({rundir.step_dir(self.workdir, step)})"
    other = sorted(k for k in wanted if k in saved and saved[k] != wanted[k])
    if other:
      key = other[0]
      what = (f"holds {key} of shape {saved[key]}, the config gives {wanted[key]}"
              + (f" ({len(other) - 1} more arrays differ)" if len(other) > 1 else ""))
    else:
      gone, new = sorted(set(saved) - set(wanted)), sorted(set(wanted) - set(saved))
      what = (f"holds {len(saved)} arrays ({', '.join(gone[:2]) or 'none'} not in the "
              f"config's state), the config's state {len(wanted)} "
              f"({', '.join(new[:2]) or 'none'} not in the checkpoint)")
    raise ResumeConfigError(
        f"{where} {what}: the config does not fit this run (a model shape or optimizer "
        "changed; config.json, which would name the key, is missing). Use the run's "
        "config, or start a new --workdir (--config.init.from_run starts from its weights "
        "if the model shape is kept); the checkpoint was left in place")

  def restore_latest(self, abstract_state, data_iterator, log: Callable[[str], None] = print):
    """(step, state) of the newest checkpoint that restores, or (0, None) when there is none.

    Each newer one that fails is named with its reason and moved aside. Raises
    NoRestorableCheckpoint when there were checkpoints and none restored.
    """
    failed = []
    for step in reversed(rundir.step_dirs(self.workdir)):
      verified = integrity.has_manifest(rundir.step_dir(self.workdir, step))
      try:
        state = self.restore(step, abstract_state, data_iterator)
      except ResumeConfigError:
        raise  # the config does not fit: the checkpoint is fine, it stays
      except Exception as e:  # pylint: disable=broad-except  # any failure: try an older one
        reason = str(e) if isinstance(e, integrity.DamagedCheckpoint) else one_line(e)
        moved = self.move_aside(step)
        log(f"checkpoint {step} ({rundir.step_dir(self.workdir, step)}) does not restore: "
            f"{reason}; moved to {moved}")
        failed.append(f"{step}: {reason}")
        continue
      if not verified:
        fingerprint = (self.restored_identity or {}).get("fingerprint")
        log(f"checkpoint {step} has no checksums (written by an older version, or killed "
            "right after its commit); checked instead: finite values, shapes"
            + (", Adam's moments within their bounds" if self.adam else "")
            + (", the arrays' fingerprint" if fingerprint else
               "; it has no fingerprint: damage that keeps these is not detected"))
      return step, state
    if failed:
      raise NoRestorableCheckpoint(
          f"no checkpoint of {self.workdir} restores ({'; '.join(failed)}); all were moved "
          f"to {rundir.damaged_dir(self.workdir)}. Move one back to retry it, or re-run to "
          "start from scratch")
    return 0, None

  def move_aside(self, step: int) -> str:
    """Moves checkpoints/<step> to checkpoints_damaged/<step>[-N]; returns the new path."""
    target = rundir.damaged_path(self.workdir, step)
    if self._primary:
      os.makedirs(os.path.dirname(target), exist_ok=True)
      os.replace(rundir.step_dir(self.workdir, step), target)
    _sync("infir2_move_aside")
    self._manager.reload()
    return target

  def poll(self) -> None:
    """Raises SaveFailed as soon as a background save has failed, without waiting for one
    still running: the loop calls it every step, so training never goes on for long past a
    checkpoint that was not written. Single-process only (orbax's wait is collective); a
    multi-process run learns it at its next save."""
    if (self._pending is not None and jax.process_count() == 1
        and not self._manager.is_saving_in_progress()):
      self.wait()

  def wait(self) -> None:
    """Waits for the background save; SaveFailed if it failed (raised once)."""
    if self._pending is None:
      return
    with _TranslateSaveErrors(self, self._pending):
      self._manager.wait_until_finished()
    self._pending = None
    self._quiet_orbax(False)  # whole: orbax's errors from here on are not about our saves

  def close(self) -> None:
    self._quiet_orbax(True)
    try:
      try:
        self.wait()
      except SaveFailed:
        with contextlib.suppress(Exception):  # orbax raises the same failure again: said once
          self._manager.close()
        raise
      self._manager.close()
    finally:
      self._quiet_orbax(False)


class _TranslateSaveErrors:
  """Turns a failed save (orbax / tensorstore errors, however wrapped) into one SaveFailed
  line: a full disk (ENOSPC, EDQUOT), a file-size limit (EFBIG), a folder that cannot be
  written (EACCES, EPERM, EROFS), or anything else. The half-written step is removed."""

  def __init__(self, checkpointer: Checkpointer, step: int | None):
    self.checkpointer, self.step = checkpointer, step

  def __enter__(self):
    return self

  def __exit__(self, exc_type, exc, tb):
    if exc is None or not isinstance(exc, Exception) or isinstance(exc, SaveFailed):
      return False
    ckpt = self.checkpointer
    ckpt._pending = None  # pylint: disable=protected-access  # reported here, once
    if ckpt._primary:  # pylint: disable=protected-access
      rundir.remove_tmp_leftovers(ckpt.workdir)  # the half-written step: give the space back
    code = _os_error_code(exc)
    if code is None:  # the cause may be only in orbax's records (dropped: _QUIET_SAVES)
      code = _captured_error_code()
    # reported here (orbax's threads are done): its later errors log again, close's aside
    ckpt._quiet_orbax(False)  # pylint: disable=protected-access
    if code in (errno.ENOSPC, errno.EDQUOT):
      needed = ckpt._state_bytes or 0  # pylint: disable=protected-access
      raise DiskFullError(_disk_full_message(
          ckpt.directory, self.step, needed, shutil.disk_usage(ckpt.directory).free)) from None
    raise SaveFailed(_save_failed_message(ckpt, self.step, code, exc)) from exc


# How errors of a save show their cause: OSError.errno, tensorstore's text, or strerror.
_ERRNO_TEXT = {errno.ENOSPC: "No space left on device", errno.EFBIG: "File too large",
               errno.EROFS: "Read-only file system", errno.EACCES: "Permission denied",
               errno.EPERM: "Operation not permitted", errno.EDQUOT: "Disk quota exceeded"}


def _os_error_code(exc: BaseException) -> int | None:
  """The errno of the first OSError cause in `exc`'s chain (found in the text of wrapped
  tensorstore errors too), or None."""
  seen = set()
  while exc is not None and id(exc) not in seen:
    seen.add(id(exc))
    if isinstance(getattr(exc, "errno", None), int):
      return exc.errno
    match = re.search(r"os_error_code='(\d+)'", str(exc))
    if match:
      return int(match.group(1))
    for code, text in _ERRNO_TEXT.items():
      if text in str(exc):
        return code
    exc = exc.__cause__ or exc.__context__
  return None


def _captured_error_code() -> int | None:
  """The errno in the first of orbax's dropped error records that names one, or None."""
  return next((code for _, code in _QUIET_SAVES.captured if code is not None), None)


def _save_failed_message(ckpt: Checkpointer, step: int | None, code: int | None,
                         exc: BaseException) -> str:
  which = f"checkpoint {step}" if step is not None else "a checkpoint"
  done = rundir.checkpoint_steps(ckpt.workdir)
  resume = (f"re-run the same command to resume from checkpoint {done[-1]}" if done else
            "re-run the same command (no checkpoint was written: it starts over)")
  if code == errno.EFBIG:
    cause = (f"a file of it is larger than this process may write (the file-size limit, "
             f"`ulimit -f`, is {_fsize_limit()}). Raise the limit (`ulimit -f unlimited`)")
  elif code in (errno.EACCES, errno.EPERM, errno.EROFS):
    cause = (f"{ckpt.directory} cannot be written ({os.strerror(code)}). Make it writable "
             "(permissions, a read-only or immutable folder or mount)")
  else:
    cause = f"{one_line(exc)}. Fix the cause"
  return f"{which} could not be saved in {ckpt.directory}: {cause}, then {resume}; the run " \
         "stopped so that no step goes on unsaved"


def _fsize_limit() -> str:
  soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
  return "unlimited" if soft == resource.RLIM_INFINITY else f"{soft} bytes"


def _disk_full_message(directory: str, step: int | None, needed: int, free: int) -> str:
  which = f"checkpoint {step}" if step is not None else "a checkpoint"
  return (f"no space for {which} in {directory}: it needs about {needed / 2**20:.1f} MiB, "
          f"{free / 2**20:.1f} MiB are free. Free some space (or lower checkpoint.keep) and "
          "re-run the same command: training resumes from the last checkpoint")


def one_line(e: BaseException, limit: int = 300) -> str:
  """`Type: first line of the message`, cut to `limit` characters."""
  text = str(e).strip().splitlines()
  line = f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")
  return line if len(line) <= limit else line[:limit - 3] + "..."


@jax.jit
def all_finite(tree) -> jax.Array:
  """True when every float leaf of `tree` is finite: one fused device-side reduction."""
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
            if jnp.issubdtype(x.dtype, jnp.inexact)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


def _sync(name: str) -> None:
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    multihost_utils.sync_global_devices(name)


def abstract_like(state, shardings):
  """ShapeDtypeStructs (with shardings) of a state pytree, for restoring into it."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      state, shardings)


def _restore(path: str, item, restore_args):
  with ocp.PyTreeCheckpointer() as ckptr:
    return ckptr.restore(path, args=ocp.args.PyTreeRestore(
        item=item, restore_args=restore_args, partial_restore=True))


def _saved_params_tree(path: str):
  with ocp.PyTreeCheckpointer() as ckptr:
    meta = ckptr.metadata(path)
  tree = meta.item_metadata.tree if hasattr(meta, "item_metadata") else meta.tree
  return tree["params"]


def read_state(path: str):
  """The whole state item at `path` (checkpoints/<step>/state) as numpy arrays."""
  with ocp.PyTreeCheckpointer() as ckptr:
    meta = ckptr.metadata(path)
  tree = meta.item_metadata.tree if hasattr(meta, "item_metadata") else meta.tree
  as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
  return _restore(path, tree, as_numpy)


def iter_checkpoint_params(path: str) -> Iterator[dict[str, np.ndarray]]:
  """Flat {"layers_0/mlp/up_proj/kernel": f32 array} groups: non-layer params, then each layer."""
  saved = _saved_params_tree(path)
  as_numpy = lambda tree: jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
  top = sorted(k for k in saved if not k.startswith("layers_"))
  layers = sorted((k for k in saved if k.startswith("layers_")), key=lambda k: int(k[7:]))
  for group in [top] + [[k] for k in layers]:
    item = {"params": {k: saved[k] for k in group}}
    restored = _restore(path, item, as_numpy(item))["params"]
    yield flax.traverse_util.flatten_dict(restored, sep="/")


def restore_params(workdir: str, abstract_params, step: int | None = None):
  """A run's params (no optimizer or data state) into given ShapeDtypeStructs with shardings.

  For starting a new run from another run's float32 masters (e.g. SFT stage 2 from stage 1).
  The checkpoint's checksums are verified first.
  """
  path, _ = rundir.checkpoint_item(workdir, step)
  integrity.verify(os.path.dirname(path))
  args = jax.tree.map(lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding, dtype=a.dtype),
                      abstract_params)
  return _restore(path, {"params": abstract_params}, {"params": args})["params"]
