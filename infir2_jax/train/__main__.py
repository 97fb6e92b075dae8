"""Entry point: `python -m infir2_jax.train [--config=configs/X.py] [--config.a.b=v] [--workdir=DIR]`.

With no --config it trains the embedded default (configs/default.py): a small Qwen2 on real
text, on a laptop CPU, in minutes. Re-running with the same --workdir resumes; re-running it
with a larger --config.steps continues a finished run (the log says where its lr goes).
A mistake in the config, the data or the run directory ends the run with one `error:` line;
--debug (or INFIR2_DEBUG=1) shows its traceback.
"""

import logging as std_logging
import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from infir2_jax import errors
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
  flags.DEFINE_bool("debug", False, "Show the traceback of a user error (a bad config key or "
                    "value, missing file, broken data), not only its one `error:` line; also "
                    f"{errors.DEBUG_ENV}=1.")
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


def _check_config_file(argv: list[str]) -> None:
  """Runs the --config file's get_config(variant) once before absl does: a missing file or
  an unknown variant is then a ConfigError / NotFound, not absl's flag-parsing traceback."""
  from infir2_jax.config import get_config_dict
  for i, arg in enumerate(argv[1:], 1):
    if arg.startswith("--config="):
      get_config_dict(arg.split("=", 1)[1])
    elif arg == "--config" and i + 1 < len(argv):   # `--config FILE`
      get_config_dict(argv[i + 1])


def run() -> None:
  from infir2_jax.config import check_override_flags
  helping = any(arg in _HELP_FLAGS for arg in sys.argv[1:])
  if helping:
    _add_config_keys_to_help()
  with errors.cli_errors():  # before absl parses anything: a typo names the key, lists all
    check_override_flags(sys.argv)
    if not helping:
      _check_config_file(sys.argv)
  config_flag, workdir_flag = _define_flags()

  def main(argv):
    if len(argv) > 1:
      raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    _quiet_library_logs()
    distributed.initialize()
    from infir2_jax.config import TrainConfig
    from infir2_jax.train.trainer import train
    with errors.cli_errors(flags.FLAGS.debug or errors.debug_requested()):
      train(TrainConfig.from_config_dict(config_flag.value), workdir_flag.value)

  try:
    app.run(main)
  except SystemExit as e:
    if helping and e.code == 1:  # absl ends --help with status 1; help asked for is success
      sys.exit(0)
    raise


if __name__ == "__main__":
  run()
