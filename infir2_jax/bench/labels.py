"""Benchmark variant labels: "recipe~a.b=v~INFIR2_NAME=value~--xla_flag=v" parts (no jax
import: the benchmarks' parent processes read labels before any child starts)."""


def is_env_part(part: str) -> bool:
  """Whether a variant label's part ("infir2~INFIR2_KERNEL_QUANTIZE=full") is an
  environment variable of the variant's child process rather than a config override."""
  name = part.split("=", 1)[0]
  return "=" in part and name.startswith("INFIR2_") and name.upper() == name


def env_of(label: str) -> dict[str, str]:
  """The environment variables a label sets for its child ("~INFIR2_NAME=value" parts)."""
  return dict(o.split("=", 1) for o in label.split("~")[1:] if is_env_part(o))
