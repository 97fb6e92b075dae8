"""orbax checkpoints of the train state and the data iterator, saved together, and reading
a run's params back (for a new run, an export or an evaluation)."""

from collections.abc import Iterator

import flax.traverse_util
import grain
import jax
import numpy as np
import orbax.checkpoint as ocp

from infir2_jax.config import CheckpointConfig
from infir2_jax.train import rundir


class Checkpointer:
  """Saves {state, data-iterator} at a step; restores the latest one into given shardings."""

  def __init__(self, workdir: str, cfg: CheckpointConfig):
    self.directory = rundir.checkpoints_dir(workdir)
    self.cfg = cfg
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep, enable_async_checkpointing=cfg.async_save,
            create=True))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def should_save(self, step: int) -> bool:
    return self.cfg.every_steps > 0 and step % self.cfg.every_steps == 0

  def save(self, step: int, state, data_iterator: grain.DatasetIterator | None) -> None:
    items = {rundir.STATE_ITEM: ocp.args.StandardSave(state)}
    if data_iterator is not None:
      items[rundir.DATA_ITEM] = grain.checkpoint.CheckpointSave(data_iterator)
    self._manager.save(step, args=ocp.args.Composite(**items), force=True)

  def restore(self, step: int, abstract_state, data_iterator: grain.DatasetIterator | None):
    """Restores into `abstract_state` (ShapeDtypeStructs with shardings); the iterator in place."""
    items = {rundir.STATE_ITEM: ocp.args.StandardRestore(abstract_state)}
    if data_iterator is not None:
      items[rundir.DATA_ITEM] = grain.checkpoint.CheckpointRestore(data_iterator)
    restored = self._manager.restore(step, args=ocp.args.Composite(**items))
    return restored[rundir.STATE_ITEM]

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()


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
  """
  path, _ = rundir.checkpoint_item(workdir, step)
  args = jax.tree.map(lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding, dtype=a.dtype),
                      abstract_params)
  return _restore(path, {"params": abstract_params}, {"params": args})["params"]
