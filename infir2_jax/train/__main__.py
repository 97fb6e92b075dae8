"""Entry point: `python -m infir2_jax.train [--config=configs/X.py] [--config.a.b=v] [--workdir=DIR]`.

With no --config it trains the embedded default (configs/default.py): a small Qwen2 on real
text, on a laptop CPU, in minutes. Re-running with the same --workdir resumes.
"""

import logging as std_logging
import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from infir2_jax.parallel import distributed  # defines --coordinator_address, --num_processes

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_DEFAULT_CONFIG = os.path.join(_REPO, "configs", "default.py")
_HELP_FLAGS = ("--help", "-h", "-?", "--helpshort", "--helpfull")


def _define_flags():
  config = config_flags.DEFINE_config_file(
      "config", _DEFAULT_CONFIG, "Config file (configs/*.py[:variant]); override keys with "
      "--config.a.b=value (all keys: see above).", lock_config=True)
  workdir = flags.DEFINE_string(
      "workdir", "runs/default", "Run directory: checkpoints, metrics.jsonl, TensorBoard events.")
  return config, workdir


def _quiet_library_logs() -> None:
  """orbax and grain log every checkpoint step at INFO; keep the console for our metrics."""
  if flags.FLAGS["verbosity"].present:
    return
  logging.set_verbosity(logging.WARNING)
  std_logging.getLogger().setLevel(std_logging.WARNING)


def _add_config_keys_to_help() -> None:
  """absl's --help prints __main__'s docstring: append every config key to it."""
  from infir2_jax.train.config_help import reference
  main = sys.modules["__main__"]
  main.__doc__ = (main.__doc__ or "") + "\n" + reference().replace("%", "%%")


def run() -> None:
  from infir2_jax.config import check_override_flags
  if any(arg in _HELP_FLAGS for arg in sys.argv[1:]):
    _add_config_keys_to_help()
  try:  # before absl parses anything, so a typo names the key and lists the valid ones
    check_override_flags(sys.argv)
  except ValueError as e:
    sys.exit(f"error: {e}")
  config_flag, workdir_flag = _define_flags()

  def main(argv):
    if len(argv) > 1:
      raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    _quiet_library_logs()
    distributed.initialize()
    from infir2_jax.config import TrainConfig
    from infir2_jax.train.preflight import InsufficientMemoryError
    from infir2_jax.train.trainer import train
    try:
      train(TrainConfig.from_config_dict(config_flag.value), workdir_flag.value)
    except InsufficientMemoryError as e:  # one line, before anything was allocated
      sys.exit(f"error: {e}")

  app.run(main)


if __name__ == "__main__":
  run()
