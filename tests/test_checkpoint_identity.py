"""Checkpoints know their run and their data (issue 36, items 2-4).

Two tiny runs on a small corpus of their own: A (seed 0) and B (seed 1). A checkpoint of B
copied into A, or A's corpus changed, is refused before training with the flag that accepts
it; a checkpoint without checksums is checked for what can be checked (fingerprint, Adam's
moments) and falls back where that fails; a config that does not fit is an error naming the
key, and never moves a valid checkpoint to checkpoints_damaged/.
"""

import json
import lzma
import os
import shutil

import jax
import numpy as np
import optax
import pytest

from infir2_jax.config import CheckpointConfig
from infir2_jax.data import sources
from infir2_jax.train import checkpoint as checkpoint_lib
from infir2_jax.train import identity, integrity, resume, rundir
from infir2_jax.train.trainer import train
from test_trainer import tiny_config, train_losses

RUN = {"steps": 4, "checkpoint.every_steps": 2, "eval.every_steps": 0, "eval.batches": 1}


def _corpus(path, chunks=100, size=5000):
  """A jsonl of `chunks` documents of Shakespeare (a corpus this test may change)."""
  (builtin,) = sources._builtin("shakespeare", "")  # pylint: disable=protected-access
  with lzma.open(builtin, "rt") as f:
    text = "".join(json.loads(line)["text"] for _, line in zip(range(6), f))
  with open(path, "w") as f:
    for i in range(chunks):
      f.write(json.dumps({"text": text[i * size:(i + 1) * size]}) + "\n")
  return str(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  root = tmp_path_factory.mktemp("identity")
  corpus = _corpus(root / "corpus.jsonl")
  out = {"corpus": corpus}
  for name, seed in (("a", 0), ("b", 1)):
    out[name] = str(root / name)
    train(tiny_config(**RUN, seed=seed, **{"data.source": corpus}), out[name])
  return out


def _cfg(runs, **overrides):
  return tiny_config(**{**RUN, "data.source": runs["corpus"], **overrides})


def _copy(src, tmp_path, name="run"):
  dst = str(tmp_path / name)
  shutil.copytree(src, dst)
  return dst


def _identity(workdir, step):
  ckpt = checkpoint_lib.Checkpointer(workdir, CheckpointConfig())
  try:
    return ckpt.read_identity(step)
  finally:
    ckpt.close()


def _untouched(workdir):
  """What a refused start must leave as it was: checkpoints, metrics, nothing moved."""
  return (rundir.checkpoint_steps(workdir), train_losses(workdir),
          os.path.exists(rundir.damaged_dir(workdir)))


# Item 2: the run's identity.

def test_checkpoints_carry_the_run_identity_and_data_fingerprint(runs):
  run_id = rundir.read_json(os.path.join(runs["a"], rundir.RUN_FILE))["run_id"]
  for step in (2, 4):
    saved = _identity(runs["a"], step)
    assert saved["run_id"] == run_id and saved["seed"] == 0 and saved["recipe"] == "bf16"
    assert saved["model"]["hidden_size"] == 128 and saved["config"]["seed"] == 0
    assert list(saved["data"]["files"]) == [runs["corpus"]]
    assert saved["data"]["files"][runs["corpus"]].startswith("sha256 ")
    assert len(saved["fingerprint"]) == len(jax.tree.leaves(
        checkpoint_lib.read_state(rundir.checkpoint_item(runs["a"], step)[0])))
  other = rundir.read_json(os.path.join(runs["b"], rundir.RUN_FILE))["run_id"]
  assert other != run_id


def test_a_checkpoint_of_another_run_is_refused_before_training(runs, tmp_path, capsys):
  workdir = _copy(runs["a"], tmp_path)
  shutil.copytree(rundir.step_dir(runs["b"], 4), rundir.step_dir(workdir, 6))
  before = _untouched(workdir)
  with pytest.raises(identity.OtherRunCheckpoint) as error:
    train(_cfg(runs, steps=8), workdir)
  message = str(error.value)
  assert "checkpoint 6 (" in message and "belongs to another run" in message, message
  assert "seed 1" in message and "accept_other_run=True" in message, message
  assert _untouched(workdir) == before
  # On purpose: it resumes from it (the run had 6 steps done there: nothing left to train).
  train(_cfg(runs, steps=6, **{"checkpoint.accept_other_run": True}), workdir)
  assert "resumed from it as asked" in capsys.readouterr().out


def test_data_that_changed_is_refused_then_accepted_and_recorded(runs, tmp_path, capsys):
  workdir = _copy(runs["a"], tmp_path)
  original = open(runs["corpus"]).read()
  try:
    with open(runs["corpus"], "a") as f:   # more documents under the same data.source
      f.write(original)
    with pytest.raises(identity.DataChanged) as error:
      train(_cfg(runs), workdir)
    message = str(error.value)
    assert "the data differs from checkpoint 4 (" in message, message
    assert "train tokens" in message and f"changed: {runs['corpus']}" in message, message
    assert "accept_changed_data=True" in message
    assert not os.path.exists(os.path.join(workdir, rundir.CONFIG_CHANGES_FILE))
    capsys.readouterr()
    train(_cfg(runs, **{"checkpoint.accept_changed_data": True}), workdir)
    assert "going on with this data from step 5" in capsys.readouterr().out
    (change,) = [json.loads(l) for l in open(os.path.join(workdir,
                                                          rundir.CONFIG_CHANGES_FILE))]
    old, new = change["changes"]["data"]
    assert change["step"] == 4 and new["train_tokens"] > old["train_tokens"]
  finally:
    with open(runs["corpus"], "w") as f:
      f.write(original)


def test_other_data_asked_for_in_the_config_is_said_not_refused(runs, tmp_path, capsys):
  workdir = _copy(runs["a"], tmp_path)
  other = _corpus(tmp_path / "other.jsonl", chunks=120)
  train(_cfg(runs, **{"data.source": other}), workdir)
  out = capsys.readouterr().out
  assert "the data differs from checkpoint 4 (" in out and "as the config changes it" in out
  assert f"added: {other}" in out and f"gone: {runs['corpus']}" in out, out


def _as_older_code_wrote_it(workdir):
  """No run.json, no `run` item (checksums rewritten to match: a whole checkpoint)."""
  os.remove(os.path.join(workdir, rundir.RUN_FILE))
  for step in rundir.checkpoint_steps(workdir):
    shutil.rmtree(os.path.join(rundir.step_dir(workdir, step), rundir.RUN_ITEM))
    integrity.write_manifest(rundir.step_dir(workdir, step))


def test_a_checkpoint_of_older_code_without_identity_restores_said_once(runs, tmp_path,
                                                                        capsys):
  workdir = _copy(runs["a"], tmp_path)
  _as_older_code_wrote_it(workdir)
  train(_cfg(runs, steps=6), workdir)
  out = capsys.readouterr().out
  assert out.count("carries no run identity or data fingerprint") == 1, out
  assert sorted(train_losses(workdir)) == [1, 2, 3, 4, 5, 6]
  saved = _identity(workdir, 6)
  assert saved["run_id"] == rundir.read_json(os.path.join(workdir, rundir.RUN_FILE))["run_id"]


# Item 4: a config that does not fit never moves a valid checkpoint aside.

@pytest.mark.parametrize("older_code", [False, True])
def test_another_model_shape_without_config_json_is_an_error_and_nothing_moves(
    runs, tmp_path, older_code):
  """config.json missing: the shape check had nothing to compare with, the restore failed
  and every checkpoint went to checkpoints_damaged/ as "does not restore"."""
  workdir = _copy(runs["a"], tmp_path)
  os.remove(os.path.join(workdir, rundir.CONFIG_FILE))
  if older_code:
    _as_older_code_wrote_it(workdir)
  before = _untouched(workdir)
  with pytest.raises(resume.ResumeConfigError) as error:
    train(_cfg(runs, **{"model.hidden_size": 64}), workdir)
  message = str(error.value)
  if older_code:   # only the arrays to go by: the first that differs, and its shape
    assert "checkpoint 4 (" in message and "of shape (8192, 128)" in message, message
    assert "the config gives (8192, 64)" in message, message
  else:            # the checkpoint's config names the key
    assert "model.hidden_size=64 (the run has 128)" in message, message
  assert _untouched(workdir) == before


# Item 3: a checkpoint without checksums is checked for what can be checked.

def _adam_state(seed, steps=3):
  """A real optax Adam state after a few updates (mu, nu consistent with each other)."""
  rng = np.random.default_rng(seed)
  params = {"w": rng.standard_normal((64, 96)).astype(np.float32),
            "b": rng.standard_normal((96,)).astype(np.float32)}
  tx = optax.adam(1e-3, b1=0.9, b2=0.95)
  opt_state = tx.init(params)
  for _ in range(steps):
    grads = jax.tree.map(lambda p: rng.standard_normal(p.shape).astype(np.float32), params)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
  return jax.tree.map(np.array, {"step": np.int32(seed), "params": params,
                                 "opt_state": opt_state})


def _write(workdir, states, identity_of=lambda step: {"run_id": "r"}):
  for step, state in states.items():
    ckpt = checkpoint_lib.Checkpointer(workdir, CheckpointConfig(async_save=False),
                                       owner=True, identity=identity_of(step))
    ckpt.save(step, jax.device_put(state), None)
    ckpt.close()
  os.remove(os.path.join(rundir.step_dir(workdir, max(states)), integrity.MANIFEST))


def _restore_latest(workdir):
  lines = []
  ckpt = checkpoint_lib.Checkpointer(workdir, CheckpointConfig(), owner=True, adam=(0.9, 0.95))
  abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype),
                          _adam_state(0))
  step, state = ckpt.restore_latest(abstract, None, log=lines.append)
  ckpt.close()
  return step, state, lines


def test_an_unverified_checkpoint_whose_arrays_changed_fails_its_fingerprint(tmp_path):
  """A value changed as a flipped bit would change it (the low bit of one mantissa: no
  bound sees it), with the fingerprint the checkpoint was written with."""
  workdir = str(tmp_path)
  state = _adam_state(8)
  written = integrity.state_fingerprint(state)
  state["params"]["w"].view(np.uint32)[5, 7] ^= 1
  _write(workdir, {4: _adam_state(4), 8: state},
         identity_of=lambda step: {"run_id": "r"} if step == 4 else None)
  shutil.rmtree(os.path.join(rundir.step_dir(workdir, 8), rundir.RUN_ITEM), True)
  os.makedirs(os.path.join(rundir.step_dir(workdir, 8), rundir.RUN_ITEM))
  rundir.write_json(os.path.join(rundir.step_dir(workdir, 8), rundir.RUN_ITEM, "metadata"),
                    {"run_id": "r", "fingerprint": written})
  step, restored, lines = _restore_latest(workdir)
  assert step == 4, lines
  assert "checkpoint 8 (" in lines[0] and "differ from the fingerprint" in lines[0], lines
  assert "params/w" in lines[0], lines
  np.testing.assert_array_equal(np.asarray(restored["params"]["w"]),
                                _adam_state(4)["params"]["w"])


def test_an_unverified_checkpoint_with_an_impossible_adam_moment_falls_back(tmp_path):
  """Older code (no checksums, no fingerprint): one first moment of -1.6e36 (issue 36: a
  flipped byte; finite, so it was restored and trained with)."""
  workdir = str(tmp_path)
  bad = _adam_state(8)
  bad["opt_state"][0].mu["w"][3, 5] = -1.6e36
  _write(workdir, {4: _adam_state(4), 8: bad}, identity_of=lambda step: None)
  step, _, lines = _restore_latest(workdir)
  assert step == 4, lines
  assert "Adam moments of opt_state/0/mu/w are impossible" in lines[0], lines
  assert "|mu| up to 1.6e+36" in lines[0], lines
  assert os.listdir(rundir.damaged_dir(workdir)) == ["8"]


def test_an_intact_unverified_checkpoint_restores_and_says_what_was_checked(tmp_path):
  workdir = str(tmp_path)
  _write(workdir, {4: _adam_state(4), 8: _adam_state(8)})
  step, state, lines = _restore_latest(workdir)
  assert step == 8 and len(lines) == 1, lines
  assert "has no checksums" in lines[0] and "Adam's moments within their bounds" in lines[0]
  assert "the arrays' fingerprint" in lines[0], lines
  for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(_adam_state(8))):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
