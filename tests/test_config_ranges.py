"""Every numeric config key is range-checked, with an error naming it (issue 23, item 2)."""

import dataclasses
import math
import re
import typing

import numpy as np
import pytest

from infir2_jax.config import TrainConfig, flat_keys, load_config

FLOAT32_TINY = float(np.finfo(np.float32).tiny)   # float32's smallest normal number

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


# float32 is what the optimizer computes in: values that a float64 check lets through but
# float32 flushes to 0 or rounds to 1 (issue 36, item 6).
FLOAT32_BAD = [("opt.eps", 1e-40), ("opt.eps", 1e-39), ("opt.lr", 1e-40), ("opt.lr", 1e39),
               ("opt.b1", 0.99999999), ("opt.b2", 1 - 1e-9), ("opt.weight_decay", 1e39),
               ("model.rms_norm_eps", 1e-40)]


@pytest.mark.parametrize("key,value", FLOAT32_BAD)
def test_values_float32_cannot_hold_are_refused_with_the_reason(key, value):
  with pytest.raises(ValueError, match=key.replace(".", r"\.") + r".*float32"):
    load_config(overrides={key: value})


def _adam_update(eps, b2=0.95):
  """One optax.adamw update of a parameter with and one without gradient (float32, jitted)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  opt = optax.adamw(1e-3, b2=b2, eps=eps)
  params = {"w": jnp.ones(2)}
  updates, _ = jax.jit(opt.update)({"w": jnp.array([0.0, 1.0])}, opt.init(params), params)
  return updates["w"]


@pytest.mark.parametrize("eps", [1e-40, FLOAT32_TINY, 1e-8])
def test_eps_bound_is_where_adam_turns_nan(eps):
  """The independent reference: optax's own update in float32 is NaN exactly where the
  config refuses eps."""
  refused = True
  try:
    load_config(overrides={"opt.eps": eps})
    refused = False
  except ValueError:
    pass
  assert refused == bool(np.isnan(_adam_update(eps)).any())


@pytest.mark.parametrize("b2", [1 - 1e-9, 0.9999999])
def test_b2_bound_is_where_adam_turns_nan(b2):
  refused = True
  try:
    load_config(overrides={"opt.b2": b2})
    refused = False
  except ValueError:
    pass
  assert refused == bool(np.isnan(_adam_update(1e-8, b2=b2)).any())


def test_smallest_normal_eps_and_tiny_lr_are_accepted():
  cfg = load_config(overrides={"opt.eps": FLOAT32_TINY, "opt.lr": 1e-30, "opt.b2": 0.9999999})
  assert cfg.opt.eps == FLOAT32_TINY


@pytest.mark.parametrize("flag", ["--config.steps=abc", "--config.opt.lr=fast",
                                  "--config.seed=1.5"])
def test_a_number_flag_that_does_not_parse_is_a_config_error(flag):
  """absl ends such a flag with 'FATAL Flags parsing error'; the check before it names the
  flag, the key and its type (found by scripts/fault_injection.py, issue 36)."""
  from infir2_jax.config import check_override_flags  # pylint: disable=g-import-not-at-top
  from infir2_jax.errors import ConfigError  # pylint: disable=g-import-not-at-top
  with pytest.raises(ConfigError, match=re.escape(flag) + ".* must be (int|float)"):
    check_override_flags(["train", flag])
  check_override_flags(["train", "--config.steps=5", "--config.opt.lr=1e-3",
                        "--config.opt.lr=nan", "--config.data.source=x.jsonl"])
