"""Every damaged file the program reads is named in its error (issue 36, item 7): one
UserError line (so the CLI prints `error: ...`, no traceback) with the file's path, what is
wrong with it and what to do; a --workdir that is a file is refused the same way."""

import os
import shutil

import pytest

from infir2_jax import errors, export, hf
from infir2_jax.data import shards
from infir2_jax.data.tokenizer import load_tokenizer
from infir2_jax.train import rundir
from infir2_jax.train.trainer import train
from test_trainer import tiny_config

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "hf_tiny", "qwen2_tied")


def _cut(path, keep=0.5):
  data = open(path, "rb").read()
  with open(path, "wb") as f:
    f.write(data[:int(len(data) * keep)])


def _names(error, path):
  """The error is a UserError whose one line names the file."""
  message = str(error.value)
  assert isinstance(error.value, errors.UserError), repr(error.value)
  assert path in message and "\n" not in message, message
  return message


@pytest.fixture
def hf_copy(tmp_path):
  out = str(tmp_path / "hf")
  shutil.copytree(FIXTURE, out)
  return out


@pytest.mark.parametrize("keep", [0.5, 0.0])
def test_truncated_run_config_json_is_named_by_train_and_export(tmp_path, keep):
  workdir = str(tmp_path / "run")
  os.makedirs(workdir)
  path = os.path.join(workdir, rundir.CONFIG_FILE)
  with open(path, "w") as f:
    f.write('{"seed": 0, "steps": 8, "model": {"hidden_size": 128')
  _cut(path, keep)
  with pytest.raises(ValueError) as error:
    train(tiny_config(), workdir)
  assert "delete it" in _names(error, path)
  with pytest.raises(ValueError) as error:
    export.export_run(workdir, str(tmp_path / "out"))
  _names(error, path)


def test_truncated_prepared_json_is_named(tmp_path):
  index = tmp_path / shards.INDEX
  index.write_text('{"format": "infir2-shards", "version": 1, "shards": [')
  with pytest.raises(ValueError) as error:
    shards.open_prepared(str(tmp_path))
  assert "prepare the data again" in _names(error, str(index))


def test_truncated_hf_config_json_is_named(hf_copy):
  path = os.path.join(hf_copy, "config.json")
  _cut(path)
  with pytest.raises(ValueError) as error:
    hf.convert.read_config(hf_copy)
  assert "download or export the checkpoint again" in _names(error, path)


@pytest.mark.parametrize("damage", ["truncate", "header"])
def test_damaged_model_safetensors_is_named(hf_copy, damage):
  path = os.path.join(hf_copy, "model.safetensors")
  cfg = hf.convert.model_config_from_hf(hf_copy)
  if damage == "truncate":
    _cut(path)
  else:   # the 8-byte header length, made far larger than the file
    with open(path, "r+b") as f:
      f.write((1 << 40).to_bytes(8, "little"))
  with pytest.raises(ValueError) as error:
    hf.load_params(hf_copy, cfg)
  _names(error, path)


def test_damaged_tokenizer_json_is_named(tmp_path):
  path = tmp_path / "tokenizer.json"
  path.write_text('{"version": "1.0", "model": {')
  with pytest.raises(ValueError) as error:
    load_tokenizer(str(tmp_path))
  assert "copy it again" in _names(error, str(path))


@pytest.mark.parametrize("under", [False, True])
def test_workdir_that_is_a_file_is_refused(tmp_path, under):
  afile = tmp_path / "afile"
  afile.write_text("not a run")
  workdir = str(afile / "run") if under else str(afile)
  with pytest.raises(errors.ConfigError, match=r"is a file, not a folder"):
    train(tiny_config(), workdir)
  assert afile.read_text() == "not a run"
