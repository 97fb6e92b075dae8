"""Every numeric config key is range-checked, with an error naming it (issue 23, item 2)."""

import dataclasses
import math
import typing

import pytest

from infir2_jax.config import TrainConfig, flat_keys, load_config

BAD = [
    ("opt.lr", 1e999), ("opt.lr", float("nan")), ("opt.lr", 0.0), ("opt.lr", -1e-3),
    ("opt.b1", 2.0), ("opt.b1", 1.0), ("opt.b1", -0.1), ("opt.b2", 1.5), ("opt.b2", 1.0),
    ("opt.eps", 0.0), ("opt.eps", -1e-8), ("opt.eps", 1e999),
    ("opt.clip_norm", -1.0), ("opt.clip_norm", 1e999), ("opt.weight_decay", -5.0),
    ("opt.min_lr_ratio", -3.0), ("opt.min_lr_ratio", 1.5), ("opt.decay_fraction", 1.5),
    ("opt.warmup_steps", -1), ("checkpoint.every_steps", -1), ("checkpoint.keep", 0),
    ("log.every_steps", 0), ("log.peak_tflops", -1.0), ("eval.every_steps", -1),
    ("eval.batches", -1), ("init.from_run_step", -2), ("steps", 0), ("batch_size", -8),
    ("seq_len", 0), ("grad_accum_steps", 0), ("seed", 2**63), ("skip_steps", (0,)),
    ("model.rope_theta", 0.0), ("model.rms_norm_eps", -1e-6), ("model.init_std", 1e999),
    ("model.head_dim", -1),
]


@pytest.mark.parametrize("key,value", BAD)
def test_out_of_range_value_is_an_error_naming_the_key(key, value):
  with pytest.raises(ValueError, match=key.replace(".", r"\.")):
    load_config(overrides={key: value})


def test_command_line_spelling_of_inf_is_rejected():
  """`--config.opt.lr=1e999` parses as inf; it used to train (and save NaN checkpoints)."""
  with pytest.raises(ValueError, match=r"opt\.lr=inf is out of range.*\(0, inf\)"):
    load_config(overrides=["opt.lr=1e999"])


def _float_keys(cls=TrainConfig, prefix=""):
  hints = typing.get_type_hints(cls)
  for field in dataclasses.fields(cls):
    hint = hints[field.name]
    if dataclasses.is_dataclass(hint):
      yield from _float_keys(hint, f"{prefix}{field.name}.")
    elif hint is float:
      yield prefix + field.name


FLOAT_KEYS = list(_float_keys())


def test_float_keys_are_found():
  assert {"opt.lr", "opt.eps", "data.val_fraction", "model.rope_theta"} <= set(FLOAT_KEYS)
  assert set(FLOAT_KEYS) <= set(flat_keys())


@pytest.mark.parametrize("key", FLOAT_KEYS)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_every_float_key_rejects_nan_and_inf(key, value):
  with pytest.raises(ValueError, match=key.replace(".", r"\.")):
    load_config(overrides={key: value})


def test_defaults_and_edges_are_accepted():
  cfg = load_config(overrides={"opt.b1": 0.0, "opt.weight_decay": 0.0, "opt.clip_norm": 0.0,
                               "opt.min_lr_ratio": 0.0, "checkpoint.every_steps": 0,
                               "eval.batches": 0, "seed": -1, "skip_steps": (3, 7)})
  assert cfg.skip_steps == (3, 7) and cfg.opt.clip_norm == 0.0
