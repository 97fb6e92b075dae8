"""Test-wide setup: 8 fake CPU devices for sharding tests, GPU tests behind a marker."""
import os

# Must happen before jax is imported anywhere.
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import pytest  # noqa: E402

# One persistent compilation cache for the whole run (and its xdist workers): the many tests
# that train the same tiny configs compile each program once. INFIR2_TEST_JAX_CACHE="" turns
# it off; the trainer's own cache switch (INFIR2_COMPILATION_CACHE) is separate.
_CACHE = os.environ.get("INFIR2_TEST_JAX_CACHE", os.path.join(
    os.environ.get("TMPDIR", "/tmp"), f"infir2_test_jax_cache_{os.getuid()}"))
if _CACHE:
  jax.config.update("jax_compilation_cache_dir", _CACHE)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


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
