"""make_dot_general_factory: PrecisionConfig -> (projection path -> dot_general), the model's hook."""

from collections.abc import Callable

from infir2_jax.precision.config import PrecisionConfig, resolve_recipe
from infir2_jax.precision.dot_general import make_dot_general
from infir2_jax.precision.gemm import bf16_dot_general
from infir2_jax.precision.telemetry import TelemetryDotGeneral, module_name


def make_dot_general_factory(cfg: PrecisionConfig, *,
                             telemetry: bool = False) -> Callable[[str], Callable]:
  """Returns factory(path) -> dot_general for the projection at `path`.

  bf16 projections (the bf16 recipe, bf16 overrides, the LM head by default) get
  gemm.bf16_dot_general (lax.dot_general, with f32 operands on CPU only, for speed). FP8
  projections get make_dot_general(recipe) or, with telemetry, a TelemetryDotGeneral Module named module_name(path), created in the caller's compact
  method (so it becomes a child of the projection and can own sinks / sow stats).
  """
  if not isinstance(cfg, PrecisionConfig):
    raise TypeError(f"make_dot_general_factory needs a PrecisionConfig, got {type(cfg).__name__}")
  cache: dict[str, Callable] = {}

  def factory(path: str):
    recipe = resolve_recipe(cfg, path)
    if recipe.is_bf16:
      return bf16_dot_general
    if telemetry:
      return TelemetryDotGeneral(recipe, cfg.backend, name=module_name(path))
    if recipe.name not in cache:
      cache[recipe.name] = make_dot_general(recipe, backend=cfg.backend)
    return cache[recipe.name]

  return factory
