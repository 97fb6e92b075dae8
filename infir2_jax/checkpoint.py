"""orbax checkpoints of the train state and the data iterator, saved together."""

import dataclasses
import os

import grain
import jax
import orbax.checkpoint as ocp


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  every_steps: int = 50    # save every N optimizer steps (and at the end); 0 = only at the end
  keep: int = 3            # keep the last K checkpoints
  async_save: bool = True  # write in the background while training continues

  def __post_init__(self):
    if self.every_steps < 0 or self.keep < 1:
      raise ValueError(f"checkpoint.every_steps must be >= 0 and checkpoint.keep >= 1, "
                       f"got {self.every_steps}, {self.keep}")


class Checkpointer:
  """Saves {state, data-iterator} at a step; restores the latest one into given shardings."""

  def __init__(self, directory: str, cfg: CheckpointConfig):
    self.directory = os.path.abspath(directory)
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
    items = {"state": ocp.args.StandardSave(state)}
    if data_iterator is not None:
      items["data"] = grain.checkpoint.CheckpointSave(data_iterator)
    self._manager.save(step, args=ocp.args.Composite(**items), force=True)

  def restore(self, step: int, abstract_state, data_iterator: grain.DatasetIterator | None):
    """Restores into `abstract_state` (ShapeDtypeStructs with shardings); the iterator in place."""
    items = {"state": ocp.args.StandardRestore(abstract_state)}
    if data_iterator is not None:
      items["data"] = grain.checkpoint.CheckpointRestore(data_iterator)
    restored = self._manager.restore(step, args=ocp.args.Composite(**items))
    return restored["state"]

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()


def abstract_like(state, shardings):
  """ShapeDtypeStructs (with shardings) of a state pytree, for restoring into it."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      state, shardings)
