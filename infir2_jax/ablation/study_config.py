"""A study config file: a sweep config (ablation/grid.py) with a `study` section.

The section's settings are STUDY_DEFAULTS' keys: parallel (trainers at once on one device),
threads_per_run (XLA:CPU threads per trainer, 0 = the default). ablation/study.py runs the
grid; ablation/study_report.py writes its README from it.
"""

from infir2_jax.ablation.grid import SweepSpec, expand, spec_from_config
from infir2_jax.config import get_config_dict
from infir2_jax.errors import UserError

STUDY_DEFAULTS = {"parallel": 1, "threads_per_run": 0}


class StudyError(UserError, ValueError):
  """A study that cannot run as asked (another grid's results, a bad budget)."""


def load_study(path: str) -> tuple[SweepSpec, dict]:
  """A study config file -> (its grid as a SweepSpec, its `study` settings)."""
  config = get_config_dict(path)
  settings = dict(STUDY_DEFAULTS)
  if "study" in config:
    extra = config.study.to_dict() if hasattr(config.study, "to_dict") else dict(config.study)
    unknown = sorted(set(extra) - set(STUDY_DEFAULTS))
    if unknown:
      raise StudyError(f"unknown study setting(s) {unknown} in {path}; valid: "
                       f"{sorted(STUDY_DEFAULTS)}")
    settings.update(extra)
    del config["study"]
  spec = spec_from_config(config)
  for run in expand(spec):
    _check_telemetry_is_logged(dict(run.overrides), run.name)
  return spec, settings


def _check_telemetry_is_logged(overrides: dict, name: str) -> None:
  """The trainer writes telemetry on log steps only: any other period loses it silently."""
  every = overrides.get("precision.telemetry_every_steps", 0)
  log_every = overrides.get("log.every_steps", 1)
  if every and every % log_every:
    raise StudyError(f"run {name}: precision.telemetry_every_steps={every} is no multiple of "
                     f"log.every_steps={log_every}, so no telemetry would be written; make it "
                     "one")
