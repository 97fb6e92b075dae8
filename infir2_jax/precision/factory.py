"""make_dot_general_factory: PrecisionConfig -> (projection path, axes) -> dot_general."""

import functools

from infir2_jax.precision.config import PrecisionConfig, resolve_recipe
from infir2_jax.precision import fp8_attention, fused_mlp, fused_qkv
from infir2_jax.precision.dot_general import make_dot_general
from infir2_jax.precision.gemm import bf16_dot_general
from infir2_jax.precision.per_shard import (
    MlpAxes, ProjectionAxes, QkvAxes, per_shard, per_shard_mlp, per_shard_qkv, shard_local)
from infir2_jax.precision.telemetry import TelemetryAttention, TelemetryDotGeneral, module_name


def make_dot_general_factory(cfg: PrecisionConfig, *, telemetry: bool = False):
  """Returns factory(path, axes=None) -> the dot_general of the projection at `path`, and
  factory.gated_mlp(path, axes=None) -> the fused MLP of the MLP at `path` or None.

  - bf16 projections (the bf16 recipe, bf16 overrides, the LM head by default) get
    gemm.bf16_dot_general (lax.dot_general, with f32 operands on CPU only, for speed).
  - FP8 projections get make_dot_general(recipe), run per shard (per_shard) when the recipe
    is shard-local and the layer gave its operands' logical axes.
  - With telemetry, FP8 projections get a TelemetryDotGeneral Module named
    module_name(path), created in the caller's compact method (so it becomes a child of the
    projection and can own sinks / sow stats). It runs globally: statistics sown inside
    shard_map would leak out of its trace.
  - gated_mlp: the SwiGLU MLP as one FP8 op (precision.fused_mlp: quantization fused into
    SwiGLU and its backward, gate and up as one GEMM) where its three projections share a
    recipe that fused_mlp.supports, without telemetry, unless cfg.fused_mlp is False; None
    elsewhere (the model then
    composes the three projections' dot_generals). Its `accepts_normed` is cfg.fused_norm:
    the model then hands it the post-attention norm's NormedInput (precision/normed.py).
  - fused_qkv: factory.fused_qkv(path, axes=None) -> the q, k and v projections of the
    attention module at `path` as one product (precision.fused_qkv: one GEMM each way;
    FP8 or bf16) where they share a recipe that fused_qkv.supports, without telemetry,
    unless cfg.fused_qkv is False; None elsewhere (three dot_generals). It runs per shard
    (per_shard_qkv) for bf16 too, so that each device concatenates its own heads. Its
    `accepts_normed` is cfg.fused_norm for FP8 recipes: the model then hands it the
    input_layernorm's NormedInput.
  - attention: factory.attention(path) -> the FP8 attention of the attention module at
    `path` ("layers_0/self_attn") where its recipe has an `attention` spec
    (fp8_attention.fp8_attention, called as attend(q, k, v, segment_ids or None); with
    telemetry a TelemetryAttention Module that also sows its forward's statistics); None
    elsewhere (the model's BF16 attention).
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
      dot_general = make_dot_general(recipe, backend=cfg.backend,
                                     quantize_backend=cfg.quantize_backend)
      cache[recipe.name, axes] = dot_general if axes is None else per_shard(dot_general, axes)
    return cache[recipe.name, axes]

  def gated_mlp(path: str, axes: MlpAxes | None = None):
    recipes = {resolve_recipe(cfg, f"{path}/{name}")
               for name in ("gate_proj", "up_proj", "down_proj")}
    if telemetry or not cfg.fused_mlp or len(recipes) != 1:
      return None
    (recipe,) = recipes
    if recipe.is_bf16 or not fused_mlp.supports(recipe):
      return None
    if not shard_local(recipe):
      axes = None
    key = ("mlp", recipe.name, axes)
    if key not in cache:
      mlp = fused_mlp.make_gated_mlp(recipe, backend=cfg.backend,
                                     fused_backward=cfg.fused_mlp_backward,
                                     quantize_backend=cfg.quantize_backend,
                                     fused_norm=cfg.fused_norm)
      cache[key] = mlp if axes is None else per_shard_mlp(mlp, axes)
    return cache[key]

  def qkv(path: str, axes: QkvAxes | None = None):
    recipes = {resolve_recipe(cfg, f"{path}/{name}") for name in ("q_proj", "k_proj", "v_proj")}
    if telemetry or not cfg.fused_qkv or len(recipes) != 1:
      return None
    (recipe,) = recipes
    if not fused_qkv.supports(recipe):
      return None
    key = ("qkv", recipe.name, axes)
    if key not in cache:
      fn = fused_qkv.make_fused_qkv(recipe, backend=cfg.backend,
                                    quantize_backend=cfg.quantize_backend,
                                    fused_norm=cfg.fused_norm)
      cache[key] = fn if axes is None else per_shard_qkv(fn, axes)
    return cache[key]

  def attention(path: str):
    spec = resolve_recipe(cfg, path).attention
    if spec is None:
      return None
    if telemetry:
      return TelemetryAttention(spec, name=module_name(path))
    return functools.partial(fp8_attention.fp8_attention, spec=spec,
                             use_kernel=cfg.fp8_attention_kernel and cfg.backend != "xla")

  factory.gated_mlp = gated_mlp
  factory.fused_qkv = qkv
  factory.attention = attention
  return factory
