"""A damaged newest checkpoint falls back to the newest one that restores (issue 23, item 4).

Checkpoints 4 and 8 of a small state and a grain iterator are written as the trainer writes
them (async, checksummed); checkpoint 8 is then damaged in each way below. Restoring must
name checkpoint 8 and the reason in one line, move it to checkpoints_damaged/ (never
delete it), and return checkpoint 4 exactly: every array bit for bit, and the data
iterator at its step-4 position.
"""

import json
import os
import shutil

import grain
import jax
import numpy as np
import pytest

from infir2_jax.config import CheckpointConfig
from infir2_jax.train import integrity, rundir
from infir2_jax.train.checkpoint import Checkpointer, NoRestorableCheckpoint, abstract_like


def _state(seed):
  rng = np.random.default_rng(seed)
  params = {"w": rng.standard_normal((256, 384)).astype(np.float32),
            "b": rng.standard_normal((384,)).astype(np.float32)}
  return {"step": np.int32(seed), "params": params,
          "opt_state": {"mu": jax.tree.map(lambda p: p * 0.5, params)}}


def _iterator():
  return iter(grain.MapDataset.range(1000).map(lambda i: i * 10).to_iter_dataset())


def _write_run(workdir, async_save=True):
  ckpt = Checkpointer(workdir, CheckpointConfig(async_save=async_save, keep=5), owner=True)
  it = _iterator()
  for step in (4, 8):
    while next(it) != (step - 1) * 10:  # consume elements 0 .. step-1
      pass
    ckpt.save(step, jax.device_put(_state(step)), it)
  ckpt.close()


@pytest.fixture(scope="module")
def template(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("template"))
  _write_run(workdir)
  return workdir


def _biggest_file(directory):
  files = [os.path.join(r, f) for r, _, fs in os.walk(directory) for f in fs]
  return max(files, key=os.path.getsize)


def _flip_byte(path):
  with open(path, "r+b") as f:
    f.seek(os.path.getsize(path) // 2)
    b = f.read(1)
    f.seek(-1, 1)
    f.write(bytes([b[0] ^ 0x10]))


def _random_4k(path):
  with open(path, "r+b") as f:
    f.seek(os.path.getsize(path) // 3)
    f.write(np.random.default_rng(0).bytes(4096))


def _garbage(path):
  with open(path, "wb") as f:
    f.write(b"\xff\xfe\x00garbage" * 7)


def _data_position(path):
  """next_index 8 -> 5 in the iterator's JSON, same size: still a valid iterator state."""
  files = [os.path.join(path, f) for f in os.listdir(path) if f.endswith(".json")]
  for file in files:
    with open(file) as f:
      text = f.read()
    assert '"next_index": 8' in text, text
    with open(file, "w") as f:
      f.write(text.replace('"next_index": 8', '"next_index": 5'))


def _other_tree(path):
  with open(path) as f:
    meta = json.load(f)
  meta["tree_metadata"] = {"('params', 'v')": next(iter(meta["tree_metadata"].values()))}
  with open(path, "w") as f:
    json.dump(meta, f)


S8 = lambda w: os.path.join(w, "checkpoints", "8")
DAMAGE = {  # name: (damage(workdir), words the one-line reason must contain)
    "flipped byte in the array data": (
        lambda w: _flip_byte(_biggest_file(os.path.join(S8(w), "state"))), "checksum"),
    "4 KiB of random bytes in the array data": (
        lambda w: _random_4k(_biggest_file(os.path.join(S8(w), "state"))), "checksum"),
    "array data cut to half": (
        lambda w: os.truncate(_biggest_file(os.path.join(S8(w), "state")),
                              os.path.getsize(_biggest_file(os.path.join(S8(w), "state"))) // 2),
        "bytes"),
    "data iterator at another position": (
        lambda w: _data_position(os.path.join(S8(w), "data")), "checksum"),
    "state metadata replaced by garbage (was UnicodeDecodeError)": (
        lambda w: _garbage(os.path.join(S8(w), "state", "_METADATA")), "_METADATA"),
    "state metadata of another tree (was a pytree structure error)": (
        lambda w: _other_tree(os.path.join(S8(w), "state", "_METADATA")), "_METADATA"),
    "step metadata replaced by garbage (was a JSONDecodeError naming no file)": (
        lambda w: _garbage(os.path.join(S8(w), rundir.ORBAX_STEP_METADATA)),
        rundir.ORBAX_STEP_METADATA),
    "state metadata deleted": (
        lambda w: os.remove(os.path.join(S8(w), "state", "_METADATA")), "missing"),
    "data item deleted (was KeyError: Item 'data' was not found)": (
        lambda w: shutil.rmtree(os.path.join(S8(w), "data")), "missing"),
    "step metadata deleted (an unfinished save)": (
        lambda w: os.remove(os.path.join(S8(w), rundir.ORBAX_STEP_METADATA)), "incomplete"),
    "checksums replaced by garbage": (
        lambda w: _garbage(os.path.join(S8(w), integrity.MANIFEST)), integrity.MANIFEST),
    "no checksums, garbage state metadata (orbax's error)": (
        lambda w: (os.remove(os.path.join(S8(w), integrity.MANIFEST)),
                   _garbage(os.path.join(S8(w), "state", "_METADATA"))), "Error"),
    "no checksums, the data item deleted (orbax's error)": (
        lambda w: (os.remove(os.path.join(S8(w), integrity.MANIFEST)),
                   shutil.rmtree(os.path.join(S8(w), "data"))), "Error"),
}


def _restore(workdir):
  lines = []
  ckpt = Checkpointer(workdir, CheckpointConfig(keep=5), owner=True)
  it = _iterator()
  abstract = abstract_like(_state(0), jax.tree.map(lambda _: None, _state(0)))
  abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), abstract)
  try:
    step, state = ckpt.restore_latest(abstract, it, log=lines.append)
  finally:
    ckpt.close()
  return step, state, next(it), lines


def _assert_equal(state, want):
  for got, exp in zip(jax.tree.leaves(state), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(got), exp)


def test_intact_checkpoints_carry_verified_checksums(template):
  for step in (4, 8):
    assert integrity.verify(rundir.step_dir(template, step))
  step, state, element, lines = _restore(_copy(template, "intact"))
  assert step == 8 and element == 80 and lines == []
  _assert_equal(state, _state(8))


def _copy(template, name):
  workdir = os.path.join(os.path.dirname(template), name.replace(" ", "_")[:40])
  shutil.rmtree(workdir, ignore_errors=True)
  shutil.copytree(template, workdir)
  return workdir


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damaged_newest_falls_back_and_is_moved_aside(template, kind):
  damage, words = DAMAGE[kind]
  workdir = _copy(template, kind)
  damage(workdir)
  step, state, element, lines = _restore(workdir)
  assert step == 4, lines
  _assert_equal(state, _state(4))
  assert element == 40  # the iterator continues at the step-4 position
  assert len(lines) == 1 and "\n" not in lines[0], lines
  assert lines[0].startswith(f"checkpoint 8 ({S8(workdir)}) does not restore: ")
  assert words in lines[0] and "moved to" in lines[0], lines
  assert rundir.step_dirs(workdir) == [4]
  assert os.listdir(rundir.damaged_dir(workdir)) == ["8"]   # kept, not deleted


def test_empty_newer_step_directory_is_moved_aside(template):
  workdir = _copy(template, "empty")
  os.makedirs(os.path.join(workdir, "checkpoints", "12"))
  step, state, element, lines = _restore(workdir)
  assert step == 8 and element == 80 and len(lines) == 1 and "empty" in lines[0]
  _assert_equal(state, _state(8))


def test_non_finite_checkpoint_without_checksums_falls_back(tmp_path):
  """A legacy checkpoint (no checksums) whose arrays hold NaN: the finiteness check."""
  workdir = str(tmp_path)
  ckpt = Checkpointer(workdir, CheckpointConfig(async_save=False), owner=True)
  ckpt.save(4, jax.device_put(_state(4)), None)
  bad = _state(8)
  bad["params"]["w"][3, 5] = np.nan
  ckpt.save(8, jax.device_put(bad), None)
  ckpt.close()
  os.remove(os.path.join(S8(workdir), integrity.MANIFEST))
  lines = []
  ckpt = Checkpointer(workdir, CheckpointConfig(), owner=True)
  abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), _state(0))
  step, state = ckpt.restore_latest(abstract, None, log=lines.append)
  ckpt.close()
  assert step == 4 and "NaN or Inf" in lines[0]
  _assert_equal(state, _state(4))


def test_synchronous_saves_are_checksummed_too(tmp_path):
  workdir = str(tmp_path)
  _write_run(workdir, async_save=False)
  assert integrity.verify(rundir.step_dir(workdir, 8))
  _flip_byte(_biggest_file(os.path.join(S8(workdir), "state")))
  with pytest.raises(integrity.DamagedCheckpoint, match="checksum"):
    integrity.verify(rundir.step_dir(workdir, 8))


def test_every_checkpoint_damaged_is_an_error_and_nothing_is_deleted(template):
  workdir = _copy(template, "all")
  for step in (4, 8):
    _flip_byte(_biggest_file(os.path.join(rundir.step_dir(workdir, step), "state")))
  with pytest.raises(NoRestorableCheckpoint, match="no checkpoint of .* restores"):
    _restore(workdir)
  assert sorted(os.listdir(rundir.damaged_dir(workdir))) == ["4", "8"]


def test_leftovers_of_killed_saves_are_removed_by_the_owner_only(template):
  workdir = _copy(template, "leftovers")
  tmp = os.path.join(workdir, "checkpoints", "12" + rundir.ORBAX_TMP_MARK)
  os.makedirs(os.path.join(tmp, "state"))
  Checkpointer(workdir, CheckpointConfig()).close()     # a reader: leaves it
  assert os.path.isdir(tmp)
  Checkpointer(workdir, CheckpointConfig(), owner=True).close()
  assert not os.path.exists(tmp)
  assert rundir.checkpoint_steps(workdir) == [4, 8]
