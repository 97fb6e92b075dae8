"""Runs that survive faults, in process (issue 23): non-finite state never saved, a way past
a NaN, resuming with another config, damaged checkpoints end to end, the eval line of a
checkpoint step, TensorBoard flushed at checkpoints and torn event files, a full disk.

The faults that need a real process (signals, SIGKILL, two trainers) are in
test_reliability_process.py.
"""

import errno
import json
import os
import shutil
import struct

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from infir2_jax.config import CheckpointConfig
from infir2_jax.train import checkpoint as checkpoint_lib
from infir2_jax.train import metrics as metrics_lib
from infir2_jax.train import optim, resume, rundir, trainer
from infir2_jax.train.trainer import NonFiniteLossError, train
from test_trainer import tiny_config, train_losses

PLAIN = {"eval.every_steps": 4}


SAVED = {}   # step -> what the run directory held when that checkpoint was saved


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """The uninterrupted tiny run: 8 steps, checkpoints and evals at 4 and 8."""
  workdir = str(tmp_path_factory.mktemp("reference"))
  save = checkpoint_lib.Checkpointer.save

  def look_then_save(self, step, state, data_iterator):
    SAVED[step] = {"evals": _evals(self.workdir), "tb": _scalars(os.path.join(workdir, "tb"))}
    save(self, step, state, data_iterator)
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(checkpoint_lib.Checkpointer, "save", look_then_save)
    train(tiny_config(**PLAIN), workdir)
  return workdir


def _copy(reference, tmp_path, name="run"):
  workdir = str(tmp_path / name)
  shutil.copytree(reference, workdir)
  return workdir


def _evals(workdir):
  return {r["step"]: r["eval_loss"] for r in rundir.read_metrics(workdir) if "eval_loss" in r}


def _flip_array_byte(step_dir):
  from test_checkpoint_damage import _biggest_file, _flip_byte  # pylint: disable=import-outside-toplevel
  _flip_byte(_biggest_file(os.path.join(step_dir, "state")))


# Item 1: never save state that is not finite.

def _nan_update_at(update_index):
  """make_optimizer whose `update_index`-th update (0-based) is NaN; loss and grads stay
  finite, so only a check of the new state sees it."""
  def make(cfg, steps):
    tx = optim.make_optimizer(cfg, steps)

    def init(params):
      return (jnp.zeros((), jnp.int32), tx.init(params))

    def update(updates, state, params=None):
      count, inner = state
      updates, inner = tx.update(updates, inner, params)
      updates = jax.tree.map(lambda u: jnp.where(count == update_index, jnp.nan, u), updates)
      return updates, (count + 1, inner)
    return optax.GradientTransformation(init, update)
  return make


def test_non_finite_state_is_never_saved(tmp_path, monkeypatch):
  """With a checkpoint every step, step 3's update turns the params NaN (loss and grad norm
  of step 3 finite): checkpoint 3 is not written and the error names step 2 as last good."""
  monkeypatch.setattr(trainer, "make_optimizer", _nan_update_at(2))
  workdir = str(tmp_path)
  with pytest.raises(NonFiniteLossError) as error:
    train(tiny_config(**{"steps": 5, "checkpoint.every_steps": 1, "eval.every_steps": 0}),
          workdir)
  message = str(error.value)
  assert "non-finite in the update of step 3" in message, message
  assert "Last good checkpoint: step 2 in" in message and "skip_steps" in message
  assert rundir.checkpoint_steps(workdir) == [1, 2]
  for step in (1, 2):   # and what was saved is finite
    params = checkpoint_lib.read_state(rundir.checkpoint_item(workdir, step)[0])["params"]
    assert all(np.isfinite(np.asarray(p)).all() for p in jax.tree.leaves(params))


# Item 8: a documented way past a NaN.

def _bad_batch_at(monkeypatch, step):
  """The batch the run draws at `step` (found by its content, so also after a resume) gets
  an inf loss weight: that step's loss is inf."""
  from infir2_jax.data import make_data
  cfg = tiny_config()
  data = make_data(cfg.data, seq_len=cfg.seq_len, global_batch_size=cfg.batch_size,
                   seed=cfg.seed)
  it = iter(data.train)
  for _ in range(step):
    bad = next(it)["inputs"].copy()
  real = trainer._global_batch  # pylint: disable=protected-access

  def poisoned(batch, sharding, rows):
    if np.array_equal(batch["inputs"], bad):
      batch = dict(batch, loss_mask=batch["loss_mask"] * np.float32(np.inf))
    return real(batch, sharding, rows)
  monkeypatch.setattr(trainer, "_global_batch", poisoned)


def test_a_bad_batch_stops_the_run_and_skip_steps_goes_past_it(tmp_path, monkeypatch):
  _bad_batch_at(monkeypatch, 6)
  workdir = str(tmp_path)
  cfg = {"eval.every_steps": 0, "checkpoint.every_steps": 2}
  with pytest.raises(NonFiniteLossError, match=r'at step 6;.*step 4 in.*skip_steps="\(6,\)"'):
    train(tiny_config(**cfg), workdir)
  train(tiny_config(**cfg, skip_steps=(6,)), workdir)   # what the message says to do
  lines = {r["step"]: r for r in rundir.read_metrics(workdir) if r["step"] > 4}
  assert lines[6] == {"step": 6, "skipped_batch": 1}
  assert all(np.isfinite(lines[s]["loss"]) for s in (5, 7, 8))
  restored = checkpoint_lib.read_state(rundir.checkpoint_item(workdir)[0])
  assert int(restored["step"]) == 8   # the skipped step still counts
  changes = [json.loads(l) for l in open(os.path.join(workdir, rundir.CONFIG_CHANGES_FILE))]
  assert changes == [{"step": 4, "changes": {"skip_steps": [[], [6]]}}]


# Item 6: resuming with another config.

def test_deliberate_changes_are_recorded_and_config_json_follows(reference, tmp_path, capsys):
  workdir = _copy(reference, tmp_path)
  train(tiny_config(**PLAIN, **{"steps": 10, "opt.lr": 1e-3, "batch_size": 16}), workdir)
  out = capsys.readouterr().out
  # The run had decayed: its schedule stays laid out over its 8 steps (train/continuation.py).
  assert "config differs from the run's: batch_size 8 -> 16, opt.lr 0.003 -> 0.001, " \
         "opt.schedule_steps 0 -> 8, steps 8 -> 10; resuming from step 8" in out
  assert "the data stream differs from step 9 on (batch_size)" in out
  changes = [json.loads(l) for l in open(os.path.join(workdir, rundir.CONFIG_CHANGES_FILE))]
  assert changes == [{"step": 8, "changes": {"batch_size": [8, 16], "opt.lr": [0.003, 0.001],
                                             "opt.schedule_steps": [0, 8], "steps": [8, 10]}}]
  config = rundir.config_dict(workdir)
  assert (config["opt"]["lr"], config["steps"], config["batch_size"]) == (1e-3, 10, 16)
  assert max(train_losses(workdir)) == 10


@pytest.mark.parametrize("overrides,keys", [
    ({"model.num_kv_heads": 2, "opt.lr": 1e-3}, ["model.num_kv_heads"]),
    ({"opt.clip_norm": 0.0}, ["opt.clip_norm"]),   # the optimizer's state has another tree
])
def test_shape_changes_are_refused_naming_the_key(reference, tmp_path, overrides, keys):
  workdir = _copy(reference, tmp_path)
  before = sorted(os.listdir(os.path.join(workdir, "checkpoints")))
  with pytest.raises(resume.ResumeConfigError) as error:
    train(tiny_config(**PLAIN, **overrides), workdir)
  message = str(error.value)
  for key in keys:
    assert f"{key}=" in message and "the run has" in message, message
  assert "opt.lr" not in message   # a change that alone would be fine is not blamed
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == before   # none moved
  assert not os.path.exists(rundir.damaged_dir(workdir))


# Item 4, end to end: later losses equal the uninterrupted run's.

def test_damaged_newest_checkpoint_resumes_from_the_previous_bit_identically(
    reference, tmp_path, capsys):
  workdir = _copy(reference, tmp_path)
  shutil.rmtree(os.path.join(workdir, "tb"))
  os.remove(os.path.join(workdir, rundir.METRICS_FILE))
  _flip_array_byte(rundir.step_dir(workdir, 8))
  train(tiny_config(**PLAIN), workdir)
  out = capsys.readouterr().out
  assert "checkpoint 8 (" in out and "differs from the checksum" in out
  expected, got = train_losses(reference), train_losses(workdir)
  assert sorted(got) == [5, 6, 7, 8]
  assert all(got[s] == expected[s] for s in got), (got, expected)
  assert _evals(workdir)[8] == _evals(reference)[8]
  assert os.listdir(rundir.damaged_dir(workdir)) == ["8"]


# Item 8: the eval line of a checkpoint step; TensorBoard flushed before each checkpoint.

def test_eval_and_tensorboard_of_a_checkpoint_step_are_on_disk_before_its_checkpoint(
    reference):
  """A kill right after checkpoint N resumes after step N and never evaluates step N again:
  its eval line must be written before the checkpoint (it used to come after). And the event
  file on disk holds every step the checkpoint covers (tensorboardX's queue lost them)."""
  for step in (4, 8):
    assert sorted(SAVED[step]["evals"]) == [0, 4, 8][:step // 4 + 1]
    assert sorted(SAVED[step]["tb"]["loss"]) == list(range(1, step + 1))
    assert sorted(SAVED[step]["tb"]["eval_loss"]) == [0, 4, 8][:step // 4 + 1]


def _records(path):
  """The TFRecords of an event file, reading the format directly; raises on a torn one."""
  from tensorboardX.record_writer import masked_crc32c
  with open(path, "rb") as f:
    data = f.read()
  out, pos = [], 0
  while pos < len(data):
    assert len(data) - pos >= 12, f"{path}: torn record at {pos}"
    header = data[pos:pos + 8]
    length = struct.unpack("<Q", header)[0]
    assert struct.unpack("<I", data[pos + 8:pos + 12])[0] == masked_crc32c(header), path
    payload = data[pos + 12:pos + 12 + length]
    assert len(payload) == length and len(data) >= pos + 16 + length, f"{path}: torn"
    assert struct.unpack("<I", data[pos + 12 + length:pos + 16 + length])[0] == \
        masked_crc32c(payload), path
    out.append(payload)
    pos += 16 + length
  return out


def _scalars(tb_dir):
  """{tag: {step: value}} as TensorBoard shows them: files in name order, and a session
  START at step S hides the earlier events with step >= S (tensorboardX purge_step)."""
  from tensorboardX.proto import event_pb2
  tags = {}
  if not os.path.isdir(tb_dir):
    return tags
  for name in sorted(os.listdir(tb_dir)):
    for payload in _records(os.path.join(tb_dir, name)):
      event = event_pb2.Event.FromString(payload)
      if event.HasField("session_log") and event.session_log.status == 1:  # START
        for values in tags.values():
          for step in [s for s in values if s >= event.step]:
            del values[step]
      for value in event.summary.value:
        tags.setdefault(value.tag, {})[event.step] = value.simple_value
  return tags


def test_torn_event_file_is_cut_to_its_last_whole_record(tmp_path):
  tb = str(tmp_path / "tb")
  writer = metrics_lib.MetricsWriter(str(tmp_path), tiny_config().log, 10)
  for step in (1, 2, 3):
    writer.write(step, {"loss": float(step)})
  writer.close()
  (name,) = os.listdir(tb)
  whole = open(os.path.join(tb, name), "rb").read()
  with open(os.path.join(tb, name), "ab") as f:   # a kill in the middle of a record
    f.write(whole[:20])   # a whole header, part of its payload
  with pytest.raises(AssertionError, match="torn"):
    _records(os.path.join(tb, name))
  writer = metrics_lib.MetricsWriter(str(tmp_path), tiny_config().log, 10, start_step=2)
  writer.write(3, {"loss": 30.0})
  writer.close()
  assert open(os.path.join(tb, name), "rb").read() == whole
  assert _scalars(tb)["loss"] == {1: 1.0, 2: 2.0, 3: 30.0}   # step 3 rewritten after resume


# Item 8: a full disk is one line naming the directory and the bytes needed.

def _state(mib):
  """MiB of random float32 (orbax compresses: a constant array would take no space)."""
  w = np.random.default_rng(0).standard_normal((mib, 1 << 18)).astype(np.float32)
  return {"step": np.int32(1), "params": {"w": w}}


def test_disk_full_before_a_save_is_one_clear_line(tmp_path, monkeypatch):
  ckpt = checkpoint_lib.Checkpointer(str(tmp_path), CheckpointConfig(), owner=True)
  usage = shutil.disk_usage(str(tmp_path))
  monkeypatch.setattr(checkpoint_lib.shutil, "disk_usage",
                      lambda p: usage._replace(free=512 << 10))
  with pytest.raises(checkpoint_lib.DiskFullError) as error:
    ckpt.save(1, jax.device_put(_state(2)), None)
  message = str(error.value)
  assert "\n" not in message and ckpt.directory in message
  assert "needs about 2.0 MiB, 0.5 MiB are free" in message
  ckpt.close()


def test_no_space_while_writing_is_one_clear_line_and_cleans_up(tmp_path, monkeypatch):
  """The writer fails with ENOSPC (as tensorstore does, deep in orbax's save)."""
  ckpt = checkpoint_lib.Checkpointer(str(tmp_path), CheckpointConfig(async_save=False),
                                     owner=True)
  half_written = os.path.join(ckpt.directory, "1" + rundir.ORBAX_TMP_MARK)

  def fail(*args, **kwargs):
    os.makedirs(half_written)
    try:
      raise OSError(errno.ENOSPC, "No space left on device")
    except OSError as e:
      raise ValueError("tensorstore: write failed: [INTERNAL] ...") from e
  monkeypatch.setattr(ckpt._manager, "save", fail)   # pylint: disable=protected-access
  with pytest.raises(checkpoint_lib.DiskFullError, match=r"no space for checkpoint 1 in .*"
                     r"checkpoints: it needs about 2.0 MiB"):
    ckpt.save(1, jax.device_put(_state(2)), None)
  assert not os.path.exists(half_written)


def _tmpfs(path, size):
  os.makedirs(path, exist_ok=True)
  if os.geteuid() != 0 or os.system(f"mount -t tmpfs -o size={size} tmpfs {path}") != 0:
    pytest.skip("needs root to mount a small tmpfs")


def test_a_real_full_disk_is_one_clear_line(tmp_path, monkeypatch):
  """A 3 MiB tmpfs and an 8 MiB state; the free-space check is bypassed so that
  tensorstore's own ENOSPC from the background write is what surfaces."""
  mount = str(tmp_path / "small")
  _tmpfs(mount, "3m")
  try:
    monkeypatch.setattr(checkpoint_lib.Checkpointer, "_check_space", lambda *a: None)
    ckpt = checkpoint_lib.Checkpointer(mount, CheckpointConfig(), owner=True)
    ckpt._state_bytes = 8 << 20   # pylint: disable=protected-access
    with pytest.raises(checkpoint_lib.DiskFullError) as error:
      ckpt.save(1, jax.device_put(_state(8)), None)
      ckpt.close()
    assert "\n" not in str(error.value) and mount in str(error.value)
    assert not [d for d in os.listdir(ckpt.directory) if rundir.ORBAX_TMP_MARK in d]
  finally:
    os.system(f"umount {mount}")


def test_unfinished_metrics_line_does_not_swallow_the_next_record(tmp_path):
  (tmp_path / rundir.METRICS_FILE).write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "lo')
  writer = metrics_lib.MetricsWriter(str(tmp_path), tiny_config().log, 10, start_step=1)
  writer.write(2, {"loss": 2.0})
  writer.close()
  assert [(r["step"], r["loss"]) for r in rundir.read_metrics(str(tmp_path))] == [(1, 1.0),
                                                                                 (2, 2.0)]


@pytest.mark.slow   # two tiny runs, ~30 s on 2 cores
def test_nan_right_after_resuming_says_the_checkpoint_itself_diverges(tmp_path, monkeypatch):
  """Issue 36, item 6: a bad batch at step 5, checkpoints every 2: the first start stops at 5
  (last good 4, the generic advice); the second, resumed from 4 with the same settings,
  stops at 5 again: that advice ("lower the lr, resume") would loop, so the error says that
  checkpoint 4 diverges on its next step and names the ways out."""
  _bad_batch_at(monkeypatch, 5)
  workdir = str(tmp_path)
  cfg = tiny_config(**{"eval.every_steps": 0, "checkpoint.every_steps": 2, "steps": 6})
  with pytest.raises(NonFiniteLossError) as first:
    train(cfg, workdir)
  assert "Last good checkpoint: step 4 in" in str(first.value)
  assert "diverges on step" not in str(first.value)
  with pytest.raises(NonFiniteLossError) as second:
    train(cfg, workdir)
  message = str(second.value)
  assert "at step 5;" in message and "checkpoint 4 itself diverges on step 5" in message, message
  assert 'skip_steps="(5,)"' in message and "--config.opt.lr" in message
  assert "earlier checkpoint (2)" in message and "Last good checkpoint" not in message
