"""The run's configuration: ml_collections ConfigDicts in, frozen dataclasses out.

The model, data, precision and mesh sections are owned by their packages (ModelConfig,
DataConfig, PrecisionConfig, MeshConfig); the training loop's own sections (opt, checkpoint,
eval, log, profile, init) live here with TrainConfig. `default_config()` builds the ConfigDict from
the dataclasses' defaults (the embedded default run), config files in configs/ edit it, and
`TrainConfig.from_config_dict` turns the result back into typed, validated dataclasses once.
Modules never see a ConfigDict.
"""

import ast
import dataclasses
import difflib
import importlib.util
import math
import os
import types
import typing
from collections.abc import Sequence
from typing import Any

import ml_collections
import numpy as np

from infir2_jax.data.config import DataConfig
from infir2_jax.errors import ConfigError, NotFound
from infir2_jax.model.config import ModelConfig
from infir2_jax.parallel.mesh import MeshConfig
from infir2_jax.precision.config import PrecisionConfig


def check_range(key: str, value, lo: float = -math.inf, hi: float = math.inf, *,
                lo_open: bool = False, hi_open: bool = False) -> None:
  """Raises a ValueError naming `key` unless `value` is a finite number in the interval.

  NaN and +-inf are always out of range: `--config.opt.lr=1e999` parses as inf.
  """
  inside = (math.isfinite(value) and (lo < value if lo_open else lo <= value)
            and (value < hi if hi_open else value <= hi))
  if not inside:
    left = "(" if lo_open or lo == -math.inf else "["
    right = ")" if hi_open or hi == math.inf else "]"
    bounds = f"{left}{_bound(lo)}, {_bound(hi)}{right}"
    raise ConfigError(f"{key}={value!r} is out of range: it must be a finite number in {bounds}")


# The state and the update are float32: a value below its smallest normal number is flushed
# to 0 by XLA (CPU and GPU), one above its largest is inf.
FLOAT32_TINY = float(np.finfo(np.float32).tiny)
FLOAT32_MAX = float(np.finfo(np.float32).max)


def check_float32_normal(key: str, value, why: str) -> None:
  """check_range(key, value, > 0), and a ConfigError unless the value is a normal float32;
  `why` says what a flushed (or overflowing) value would do to the run."""
  check_range(key, value, 0.0, lo_open=True)
  if not FLOAT32_TINY <= value <= FLOAT32_MAX:
    raise ConfigError(f"{key}={value!r} is outside float32's normal range [{FLOAT32_TINY:g}, "
                      f"{FLOAT32_MAX:g}]: {why}")


def check_decay_rate(key: str, value) -> None:
  """An Adam decay rate in [0, 1) that stays below 1 in float32 (0.99999999 rounds to 1.0,
  and Adam's bias correction 1 - b**t is then 0: the first update is 0/0 = NaN)."""
  check_range(key, value, 0.0, 1.0, hi_open=True)
  if np.float32(value) == 1.0:
    raise ConfigError(f"{key}={value!r} rounds to 1.0 in float32, so Adam's bias correction "
                      f"1 - {key.rpartition('.')[2]}**t is 0 and the first update is NaN; use "
                      "at most 0.9999999 (1 - 1e-7)")


def _bound(x: float) -> str:
  return {math.inf: "inf", -math.inf: "-inf"}.get(x, f"{x:g}")


@dataclasses.dataclass(frozen=True)
class OptConfig:
  lr: float = 3e-3                 # peak learning rate
  schedule: str = "wsd"            # "wsd" (warm-up, stable, decay) | "cosine" | "constant"
  warmup_steps: int = 30           # linear warm-up from 0 to lr
  decay_fraction: float = 0.2      # wsd: last fraction of the steps decays linearly
  min_lr_ratio: float = 0.1        # final lr = lr * min_lr_ratio (wsd and cosine)
  b1: float = 0.9                  # Adam first-moment decay, in [0, 1)
  b2: float = 0.95                 # Adam second-moment decay, in [0, 1)
  eps: float = 1e-8                # Adam denominator epsilon, float32-normal (>= 1.2e-38)
  weight_decay: float = 0.1        # decoupled; never applied to norms or biases
  clip_norm: float = 1.0           # global-norm clipping (0 = off)
  # The run length the schedule's warm-up and decay are laid out for (0 = steps); steps past
  # it train at the final lr. A resume that raises `steps` after the decay has begun keeps
  # the run's own here, so its lr goes on where it was (train/continuation.py).
  schedule_steps: int = 0
  # wsd, on a resume that raises `steps` after the decay has begun: restart from the
  # checkpoint saved where the decay began (the trainer keeps it) and decay at the new end,
  # instead of going on at the final lr.
  rewind_to_stable: bool = False
  # Adam's stored moments: "fp32" (optax.adamw) | "bf16" (4 bytes/param, not 8) | "fp8" (E4M3
  # with per-128-group scales and range expansion, ~2.1 bytes/param); train/moments.py.
  # The update is computed in float32 either way; master weights stay in model.param_dtype.
  moments: str = "fp32"
  # How opt.moments=fp8 runs its step (train/fp8_adam.py), bit-identical on the CPU:
  # "auto" (pallas on the GPU, jnp elsewhere) | "jnp" (one pass per tensor, for XLA to
  # fuse) | "pallas" (a Pallas kernel; Triton with the GPU's approximate log2/exp2 on the
  # GPU) | "reference" (decode, optax's Adam, encode: train/moments.py as written).
  moments_kernel: str = "auto"

  def __post_init__(self):
    if self.schedule not in ("wsd", "cosine", "constant"):
      raise ConfigError(f"opt.schedule={self.schedule!r}; valid: 'wsd', 'cosine', 'constant'")
    check_float32_normal("opt.lr", self.lr, "a smaller lr is 0 in float32 (nothing trains), "
                         "a larger one inf")
    check_range("opt.warmup_steps", self.warmup_steps, 0)
    check_range("opt.decay_fraction", self.decay_fraction, 0.0, 1.0)
    check_range("opt.min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
    check_decay_rate("opt.b1", self.b1)
    check_decay_rate("opt.b2", self.b2)
    check_float32_normal("opt.eps", self.eps, "a smaller eps flushes to 0, and Adam's update "
                         "m / (sqrt(v) + eps) of a parameter without gradient is 0/0 = NaN at "
                         "step 1; the usual values are 1e-8 to 1e-15")
    check_range("opt.weight_decay", self.weight_decay, 0.0)
    if self.weight_decay > FLOAT32_MAX:
      raise ConfigError(f"opt.weight_decay={self.weight_decay!r} is inf in float32 "
                        f"(largest {FLOAT32_MAX:g})")
    check_range("opt.clip_norm", self.clip_norm, 0.0)
    check_range("opt.schedule_steps", self.schedule_steps, 0)
    if self.moments not in ("fp32", "bf16", "fp8"):
      raise ConfigError(f"opt.moments={self.moments!r}; valid: 'fp32', 'bf16', 'fp8'")
    if self.moments_kernel not in ("auto", "jnp", "pallas", "reference"):
      raise ConfigError(f"opt.moments_kernel={self.moments_kernel!r}; valid: 'auto', 'jnp', "
                        "'pallas', 'reference'")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  every_steps: int = 50    # save every N optimizer steps (and at the end); 0 = only at the end
  keep: int = 3            # keep the last K checkpoints
  async_save: bool = True  # write in the background while training continues
  # Resume from a checkpoint written by another run (its run id is not WORKDIR/run.json's),
  # e.g. one copied in on purpose; refused otherwise (train/identity.py).
  accept_other_run: bool = False
  # Resume although the data behind data.source changed since the checkpoint (files, sizes,
  # contents, token counts); refused otherwise. Recorded in config_changes.jsonl.
  accept_changed_data: bool = False

  def __post_init__(self):
    check_range("checkpoint.every_steps", self.every_steps, 0)
    check_range("checkpoint.keep", self.keep, 1)


@dataclasses.dataclass(frozen=True)
class LogConfig:
  every_steps: int = 1          # console/TensorBoard/jsonl every N steps
  tensorboard: bool = True      # write TensorBoard event files under WORKDIR/tb
  progress_bar: bool = True     # tqdm bar on the console (plain lines when False)
  peak_tflops: float = 0.0      # per-device peak for MFU; 0 = from the device kind (no MFU on CPU)
  # Also log every row to Weights & Biases (TensorBoard stays on): needs `pip install wandb`
  # (asked for without it, the run stops at start-up); W&B reads WANDB_API_KEY / WANDB_MODE.
  wandb: bool = False
  mlflow: bool = False          # the same for MLflow (`pip install mlflow`; MLFLOW_TRACKING_URI)
  project: str = "infir2_jax"   # W&B project / MLflow experiment the runs go to
  run_name: str = ""            # W&B / MLflow run name ("" = the workdir's folder name)

  def __post_init__(self):
    check_range("log.every_steps", self.every_steps, 1)
    check_range("log.peak_tflops", self.peak_tflops, 0.0)
    if (self.wandb or self.mlflow) and not self.project:
      raise ConfigError("log.project is empty; W&B and MLflow need a project / experiment name")


@dataclasses.dataclass(frozen=True)
class ProfileConfig:
  """A jax.profiler trace of chosen steps under WORKDIR/profile (as MaxText's `profiler`):
  open it with TensorBoard's profile plugin, XProf or Perfetto (the .trace.json.gz)."""
  start_step: int = 0   # first step traced; 0 = no profile (step 1 compiles: start at 3 or later)
  steps: int = 3        # consecutive steps traced from start_step

  def __post_init__(self):
    check_range("profile.start_step", self.start_step, 0)
    check_range("profile.steps", self.steps, 1)


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  every_steps: int = 50      # evaluate on the validation split every N steps (0 = never)
  batches: int = 8           # validation batches per evaluation (fixed, same every time; 0 = all)

  def __post_init__(self):
    check_range("eval.every_steps", self.every_steps, 0)
    check_range("eval.batches", self.batches, 0)


@dataclasses.dataclass(frozen=True)
class InitConfig:
  """Where a new run's parameters come from (ignored when the workdir has a checkpoint)."""
  hf_checkpoint: str = ""    # HF Qwen2/Llama directory (config.json + safetensors) to start from
  from_run: str = ""         # another run's workdir: start from its latest float32 params
  from_run_step: int = -1    # which step of from_run (-1 = latest)

  def __post_init__(self):
    if self.hf_checkpoint and self.from_run:
      raise ConfigError("set at most one of init.hf_checkpoint and init.from_run")
    check_range("init.from_run_step", self.from_run_step, -1)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Everything a training run needs. Field comments are the documentation of the keys."""
  seed: int = 0              # parameter init and data order
  steps: int = 250           # optimizer steps
  batch_size: int = 16       # global batch in rows of seq_len tokens, per optimizer step
  seq_len: int = 256         # tokens per row
  grad_accum_steps: int = 1  # micro-batches per optimizer step (batch_size must divide)
  # Steps whose batch is read and not trained on (the state only counts the step): a way
  # past a batch that makes the loss NaN, e.g. --config.skip_steps="(1234,)".
  skip_steps: tuple[int, ...] = ()
  model: ModelConfig = ModelConfig()
  data: DataConfig = DataConfig()
  precision: PrecisionConfig = PrecisionConfig()
  opt: OptConfig = OptConfig()
  mesh: MeshConfig = MeshConfig()
  checkpoint: CheckpointConfig = CheckpointConfig()
  eval: EvalConfig = EvalConfig()
  log: LogConfig = LogConfig()
  profile: ProfileConfig = ProfileConfig()
  init: InitConfig = InitConfig()

  def __post_init__(self):
    for name in ("steps", "batch_size", "seq_len", "grad_accum_steps"):
      check_range(name, getattr(self, name), 1)
    check_range("seed", self.seed, -2**63, 2**63, hi_open=True)  # jax.random.key's int64
    object.__setattr__(self, "skip_steps", tuple(self.skip_steps))
    for step in self.skip_steps:
      if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ConfigError(f"skip_steps={self.skip_steps!r}: every entry must be a step >= 1")
    if self.batch_size % self.grad_accum_steps:
      raise ConfigError(f"batch_size={self.batch_size} is not divisible by "
                        f"grad_accum_steps={self.grad_accum_steps}")
    if self.model.loss_chunk and self.seq_len % self.model.loss_chunk:
      raise ConfigError(
          f"model.loss_chunk={self.model.loss_chunk} must divide seq_len={self.seq_len} (the "
          "LM head and loss run over seq_len / loss_chunk chunks of every row): set "
          "model.loss_chunk to a divisor of seq_len, or 0 for the whole-row loss")
    if self.model.loss_fused and self.precision.quantize_lm_head:
      raise ConfigError("model.loss_fused computes a BF16 LM head; it cannot be combined with "
                        "precision.quantize_lm_head=True (set model.loss_fused=False)")

  @classmethod
  def from_config_dict(cls, config: ml_collections.ConfigDict) -> "TrainConfig":
    return _from_dict(cls, config.to_dict(), prefix="")

  def to_config_dict(self) -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(_to_dict(self))

  def to_dict(self) -> dict[str, Any]:
    return _to_dict(self)


def default_config() -> ml_collections.ConfigDict:
  """The embedded default run: a small Qwen2 on the embedded corpus, on a laptop CPU."""
  return TrainConfig().to_config_dict()


def _to_dict(obj) -> dict[str, Any]:
  out = {}
  for field in dataclasses.fields(obj):
    value = getattr(obj, field.name)
    out[field.name] = _to_dict(value) if dataclasses.is_dataclass(value) else value
  return out


def _from_dict(cls, values: dict[str, Any], prefix: str):
  fields = {f.name: f for f in dataclasses.fields(cls)}
  hints = typing.get_type_hints(cls)
  unknown = sorted(set(values) - set(fields))
  if unknown:
    raise unknown_key_error(prefix + unknown[0], [prefix + name for name in fields])
  kwargs = {}
  for name, value in values.items():
    hint = hints[name]
    if dataclasses.is_dataclass(hint):
      if not isinstance(value, dict):
        raise ConfigError(f"Config key {prefix + name} must be a section, got {value!r}")
      kwargs[name] = _from_dict(hint, value, prefix=f"{prefix}{name}.")
    else:
      kwargs[name] = _coerce(value, hint, prefix + name)
  return cls(**kwargs)


def _coerce(value, hint, key: str):
  """Checks a leaf's type; accepts ints for floats and lists for tuples."""
  origin = typing.get_origin(hint)
  if origin is tuple or hint is tuple:
    if isinstance(value, (list, tuple)):
      return tuple(value)
    if isinstance(value, str):  # a single entry given on the command line
      return (value,) if value else ()
    raise ConfigError(f"Config key {key} must be a tuple, got {value!r}")
  if origin in (typing.Union, types.UnionType):
    return value
  if hint is float and isinstance(value, int) and not isinstance(value, bool):
    return float(value)
  if hint in (int, float, str, bool) and not isinstance(value, hint):
    raise ConfigError(f"Config key {key} must be {hint.__name__}, got {value!r}")
  if hint is int and isinstance(value, bool):
    raise ConfigError(f"Config key {key} must be int, got {value!r}")
  return value


# Names other frameworks (HF Trainer, MaxText, Megatron, optax) give our keys (a last part,
# or a whole key): a spelling match misses them ("opt.learning_rate" is closest to
# "opt.min_lr_ratio").
SYNONYMS = {
    "learning_rate": "lr", "peak_lr": "lr", "max_lr": "lr", "lr_schedule": "schedule",
    "scheduler": "schedule", "warmup": "warmup_steps", "num_warmup_steps": "warmup_steps",
    "beta1": "b1", "beta2": "b2", "adam_beta1": "b1", "adam_beta2": "b2", "epsilon": "eps",
    "adam_eps": "eps", "adam_epsilon": "eps", "wd": "weight_decay", "grad_clip": "clip_norm",
    "max_grad_norm": "clip_norm", "gradient_clipping": "clip_norm", "clip_grad_norm": "clip_norm",
    "max_steps": "steps", "num_steps": "steps", "total_steps": "steps", "train_steps": "steps",
    "num_train_steps": "steps", "steps_total": "steps",
    "global_batch_size": "batch_size", "per_device_batch_size": "batch_size",
    "seq_length": "seq_len", "max_seq_len": "seq_len", "sequence_length": "seq_len",
    "max_target_length": "seq_len", "context_length": "seq_len", "block_size": "seq_len",
    "gradient_accumulation_steps": "grad_accum_steps", "grad_accum": "grad_accum_steps",
    "num_hidden_layers": "num_layers", "n_layers": "num_layers", "n_layer": "num_layers",
    "num_attention_heads": "num_heads", "n_heads": "num_heads", "n_head": "num_heads",
    "num_key_value_heads": "num_kv_heads", "n_kv_heads": "num_kv_heads",
    "d_model": "hidden_size", "emb_dim": "hidden_size", "hidden_dim": "hidden_size",
    "ffn_dim": "intermediate_size", "d_ff": "intermediate_size", "mlp_dim": "intermediate_size",
    "dataset": "source", "dataset_path": "source", "data_path": "source", "train_data": "source",
    "eval_steps": "eval.every_steps", "eval_interval": "eval.every_steps",
    "save_steps": "checkpoint.every_steps", "checkpoint_period": "checkpoint.every_steps",
    "log_period": "log.every_steps", "logging_steps": "log.every_steps",
    "random_seed": "seed", "fp8_recipe": "recipe", "quantization": "recipe", "momentum": "b1",
}


def suggest_key(key: str, valid: Sequence[str]) -> str | None:
  """The valid key a mistyped `key` most likely means: a known synonym of its last part (in
  its own section first), the same last part in another section, else the closest spelling."""
  section, _, leaf = key.rpartition(".")
  synonym = SYNONYMS.get(leaf.lower(), "")
  if synonym in valid:
    return synonym
  by_leaf: dict[str, list[str]] = {}
  for name in valid:
    by_leaf.setdefault(name.rpartition(".")[2], []).append(name)
  for wanted in (synonym, leaf):
    candidates = by_leaf.get(wanted, [])
    same_section = [c for c in candidates if c.rpartition(".")[0] == section]
    if same_section or candidates:
      return (same_section or candidates)[0]
  close = difflib.get_close_matches(key, list(valid), n=1)
  return close[0] if close else None


def unknown_key_error(key: str, valid: Sequence[str], where: str = "") -> ConfigError:
  """The error for a key that is not a config key: the closest valid one, and all of them."""
  close = suggest_key(key, valid)
  hint = f" Did you mean {close!r}?" if close else ""
  return ConfigError(f"Unknown config key {key!r}{where}.{hint}\nValid keys:\n  "
                    + "\n  ".join(sorted(valid)))


def flat_keys(cfg_cls=TrainConfig, prefix: str = "") -> list[str]:
  """Every valid dotted key, e.g. 'opt.lr', 'model.hidden_size'."""
  keys = []
  hints = typing.get_type_hints(cfg_cls)
  for field in dataclasses.fields(cfg_cls):
    if dataclasses.is_dataclass(hints[field.name]):
      keys += flat_keys(hints[field.name], f"{prefix}{field.name}.")
    else:
      keys.append(prefix + field.name)
  return keys


def check_override_flags(argv: list[str], flag: str = "config") -> None:
  """Raises ConfigError for `--config.KEY=...` flags whose KEY is not a config key.

  Done before absl parses the flags so the error names the key and lists the valid ones.
  """
  valid = flat_keys()
  defaults = None
  for arg in argv[1:]:
    if not arg.startswith(f"--{flag}."):
      continue
    key, has_value, text = arg[len(flag) + 3:].partition("=")
    if key not in valid:
      raise unknown_key_error(key, valid, f" in {arg!r}")
    defaults = defaults or default_config()
    default = defaults
    for name in key.split("."):
      default = default[name]
    # absl would end with "FATAL Flags parsing error" for a number it cannot parse.
    parse = {int: int, float: float}.get(type(default))
    if has_value and parse:
      try:
        parse(text)
      except ValueError:
        raise ConfigError(f"{arg}: {key} must be {type(default).__name__}, got "
                          f"{text!r}") from None


def load_config(spec: str = "", overrides: "dict[str, Any] | Sequence[str]" = ()) -> TrainConfig:
  """A TrainConfig from a config file spec "path/to/config.py[:variant]" ("" = the default)
  and overrides given as {"opt.lr": 1e-3} or ["opt.lr=1e-3", ...] (values parsed as Python
  literals, else kept as strings). The programmatic twin of the command line, for sweeps,
  notebooks and benchmarks."""
  return TrainConfig.from_config_dict(apply_overrides(get_config_dict(spec), overrides))


def apply_overrides(config: ml_collections.ConfigDict,
                    overrides: "dict[str, Any] | Sequence[str]") -> ml_collections.ConfigDict:
  """Sets {"opt.lr": 1e-3} or ["opt.lr=1e-3", ...] in `config` (in place, and returns it);
  an unknown key is an error naming the closest valid one."""
  items = overrides.items() if isinstance(overrides, dict) else (
      _split_override(o) for o in overrides)
  valid = flat_keys()
  for key, value in items:
    if key not in valid:
      raise unknown_key_error(key, valid)
    *path, leaf = key.split(".")
    section = config
    for name in path:
      section = section[name]
    section[leaf] = value
  return config


def get_config_dict(spec: str = "") -> ml_collections.ConfigDict:
  """Runs a config file's get_config(variant); "" gives default_config()."""
  if not spec:
    return default_config()
  path, _, variant = spec.partition(":")
  if not os.path.exists(path):
    raise NotFound(f"config file {path!r} does not exist")
  module_spec = importlib.util.spec_from_file_location(
      "infir2_config_" + os.path.splitext(os.path.basename(path))[0], path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  config = module.get_config(variant or None)
  config.unlock()
  return config


def _split_override(override: str) -> tuple[str, Any]:
  if "=" not in override:
    raise ConfigError(f"override {override!r} must look like 'a.b=value'")
  key, text = override.split("=", 1)
  try:
    value = ast.literal_eval(text)
  except (ValueError, SyntaxError):
    value = text
  return key.strip(), value
