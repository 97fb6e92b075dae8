"""Orbax items for the data iterator that also restore under another number of processes.

grain's own handler writes `process_{i}-of-{n}.json` and restores only from the file of
the same i and n. The state of `iter(Data.train)` is the same in every process (the next
global batch; each process cuts its own slice), so any process's file resumes any process
of a run with another count. IteratorSave writes the same files as grain's handler (and
reads checkpoints it wrote); IteratorRestore takes its own file when it exists, else any
other, after checking that all of them hold the same state.

  items["data"] = IteratorSave(iterator)      # instead of grain.checkpoint.CheckpointSave
  items["data"] = IteratorRestore(iterator)   # instead of grain.checkpoint.CheckpointRestore
"""

import dataclasses
import json
from typing import Any

from etils import epath
import grain
from grain._src.core import sharding as grain_sharding
import orbax.checkpoint as ocp


class ElasticIteratorHandler(grain.checkpoint.CheckpointHandler):
  """grain's handler, restoring from another process count's files when it must."""

  def restore(self, directory: epath.Path, item: Any = None, args: Any = None):
    item = item or args.item
    # The numbers grain's handler names its files by (JAX's process index and count).
    index, count = grain_sharding.get_process_index_and_count()
    own = directory / f"process_{index}-of-{count}.json"
    if own.exists():
      return super().restore(directory, item=item)
    saved = sorted(directory.glob("process_*-of-*.json"))
    if not saved:
      raise ValueError(f"{directory} holds no data-iterator state (process_*-of-*.json)")
    states = {f.name: json.loads(f.read_text()) for f in saved}
    if len({json.dumps(s, sort_keys=True) for s in states.values()}) > 1:
      raise ValueError(f"the data-iterator states in {directory} differ between processes "
                       f"({', '.join(states)}), so they cannot resume {count} processes; "
                       "resume with the process count that wrote them")
    item.set_state(next(iter(states.values())))
    item.start_prefetch()
    return item


@ocp.args.register_with_handler(ElasticIteratorHandler, for_save=True)
@dataclasses.dataclass
class IteratorSave(ocp.args.CheckpointArgs):
  item: Any


@ocp.args.register_with_handler(ElasticIteratorHandler, for_restore=True)
@dataclasses.dataclass
class IteratorRestore(ocp.args.CheckpointArgs):
  item: Any
