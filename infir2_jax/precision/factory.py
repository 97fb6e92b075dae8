"""make_dot_general_factory: PrecisionConfig -> (projection path, axes) -> dot_general."""

from infir2_jax.precision.config import PrecisionConfig, resolve_recipe
from infir2_jax.precision.dot_general import make_dot_general
from infir2_jax.precision.gemm import bf16_dot_general
from infir2_jax.precision.per_shard import ProjectionAxes, per_shard, shard_local
from infir2_jax.precision.telemetry import TelemetryDotGeneral, module_name


def make_dot_general_factory(cfg: PrecisionConfig, *, telemetry: bool = False):
  """Returns factory(path, axes=None) -> the dot_general of the projection at `path`.

  - bf16 projections (the bf16 recipe, bf16 overrides, the LM head by default) get
    gemm.bf16_dot_general (lax.dot_general, with f32 operands on CPU only, for speed).
  - FP8 projections get make_dot_general(recipe), run per shard (per_shard) when the recipe
    is shard-local and the layer gave its operands' logical axes.
  - With telemetry, FP8 projections get a TelemetryDotGeneral Module named
    module_name(path), created in the caller's compact method (so it becomes a child of the
    projection and can own sinks / sow stats). It runs globally: statistics sown inside
    shard_map would leak out of its trace.
  """
  if not isinstance(cfg, PrecisionConfig):
    raise TypeError(f"make_dot_general_factory needs a PrecisionConfig, got {type(cfg).__name__}")
  cache = {}

  def factory(path: str, axes: ProjectionAxes | None = None):
    recipe = resolve_recipe(cfg, path)
    if recipe.is_bf16:
      return bf16_dot_general
    if telemetry:
      return TelemetryDotGeneral(recipe, cfg.backend, name=module_name(path))
    if not shard_local(recipe):
      axes = None
    if (recipe.name, axes) not in cache:
      dot_general = make_dot_general(recipe, backend=cfg.backend)
      cache[recipe.name, axes] = dot_general if axes is None else per_shard(dot_general, axes)
    return cache[recipe.name, axes]

  return factory
