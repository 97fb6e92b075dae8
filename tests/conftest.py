"""Test-wide setup: 8 fake CPU devices for sharding tests, GPU tests behind a marker."""
import os

# Must happen before jax is imported anywhere.
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import pytest  # noqa: E402


def _has_gpu() -> bool:
  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:
    return False


def pytest_collection_modifyitems(config, items):
  if _has_gpu():
    return
  skip_gpu = pytest.mark.skip(reason="needs a GPU: run `pytest -m gpu` on the device machine")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip_gpu)
