"""Recipes as data, the registry, PrecisionConfig validation, per-path resolution, the factory."""

from jax import lax
import pytest

from infir2_jax.precision.gemm import bf16_dot_general
from infir2_jax.precision import (
    GemmSpec, OperandSpec, PrecisionConfig, Recipe, get_recipe, make_dot_general_factory,
    recipe_names, register_recipe, resolve_recipe, telemetry)
from infir2_jax.precision import recipes

NAMES = ["bf16", "fp8_tensorwise", "fp8_rowwise", "infir2", "infir2_fp32_scale",
         "infir2_e5m2_grad", "infir2_bf16_wgrad", "infir2_wgrad_dy_bf16"]


def test_named_recipes_exist():
  assert set(NAMES) <= set(recipe_names())


def test_unknown_recipe_lists_names():
  with pytest.raises(ValueError, match="unknown precision recipe 'fp9'.*infir2"):
    get_recipe("fp9")


def _ops(recipe):
  r = get_recipe(recipe)
  return {role: ((g.lhs.fmt, g.lhs.tile, g.lhs.scale_format),
                 (g.rhs.fmt, g.rhs.tile, g.rhs.scale_format)) for role, g in r.gemms().items()}


def test_infir2_is_the_papers_recipe():
  act, wt = ("e4m3", (1, 128), "ue8m0"), ("e4m3", (128, 128), "ue8m0")
  assert _ops("infir2") == {"fprop": (act, wt), "dgrad": (act, wt), "wgrad": (act, act)}
  assert all(g.accum_dtype == "float32" and not g.fast_accum
             for g in get_recipe("infir2").gemms().values())


def test_ablations_differ_only_where_named():
  base = _ops("infir2")
  fp32 = _ops("infir2_fp32_scale")
  assert all(op[2] == "fp32" for g in fp32.values() for op in g)
  assert {r: tuple(op[:2] for op in g) for r, g in fp32.items()} == \
         {r: tuple(op[:2] for op in g) for r, g in base.items()}
  e5 = _ops("infir2_e5m2_grad")
  assert e5["dgrad"][0][0] == e5["wgrad"][1][0] == "e5m2"          # dY only
  assert e5["fprop"] == base["fprop"] and e5["dgrad"][1] == base["dgrad"][1]
  hw = get_recipe("infir2_bf16_wgrad")
  assert not hw.wgrad.quantized and hw.fprop == get_recipe("infir2").fprop
  dy = get_recipe("infir2_wgrad_dy_bf16")   # only the wgrad's dY^T leaves FP8
  infir2 = get_recipe("infir2")
  assert (dy.fprop, dy.dgrad, dy.wgrad.lhs) == (infir2.fprop, infir2.dgrad, infir2.wgrad.lhs)
  assert infir2.wgrad.rhs.quantized and not dy.wgrad.rhs.quantized


def test_tensorwise_and_rowwise():
  t = _ops("fp8_tensorwise")
  assert t["fprop"] == (("e4m3", None, "fp32"),) * 2
  assert t["dgrad"][0][0] == t["wgrad"][1][0] == "e5m2"           # gradients in E5M2
  r = _ops("fp8_rowwise")
  assert all(op == ("e4m3", (1, -1), "ue8m0") for g in r.values() for op in g)
  assert get_recipe("bf16").is_bf16 and not get_recipe("infir2").is_bf16


def test_register_custom_recipe():
  spec = OperandSpec("e5m2", (1, 64), "fp32")
  custom = Recipe("test_custom", GemmSpec(spec, spec), GemmSpec(spec, spec), GemmSpec())
  try:
    register_recipe(custom)
    assert get_recipe("test_custom") is custom
    with pytest.raises(ValueError, match="already registered"):
      register_recipe(custom)
    assert PrecisionConfig(recipe="test_custom").recipe == "test_custom"
  finally:
    recipes._REGISTRY.pop("test_custom", None)


@pytest.mark.parametrize("kwargs,match", [
    (dict(fmt="e4m4"), "e4m4"), (dict(scale_format="e8m0"), "e8m0"),
    (dict(tile=(0, 128)), "tile")])
def test_operand_spec_validation(kwargs, match):
  with pytest.raises(ValueError, match=match):
    OperandSpec(**kwargs)


def test_gemm_spec_validation():
  with pytest.raises(ValueError, match="accum_dtype"):
    GemmSpec(accum_dtype="bfloat16")
  with pytest.raises(ValueError, match="out_dtype"):
    GemmSpec(out_dtype="int8")


def test_config_defaults_and_validation():
  cfg = PrecisionConfig()
  assert (cfg.recipe, cfg.overrides, cfg.backend, cfg.telemetry_every_steps) == \
      ("bf16", (), "auto", 0)
  assert PrecisionConfig(overrides=["a=bf16"]).overrides == ("a=bf16",)  # list -> tuple
  for kwargs, match in [
      (dict(recipe="fp4"), "precision.recipe='fp4'.*valid"),
      (dict(overrides=("layers_0",)), "REGEX=RECIPE"),
      (dict(overrides="layers_0=bf16"), "tuple"),
      (dict(overrides=("layers_(0=bf16",)), "bad regex"),
      (dict(overrides=("layers_0=fp4",)), "unknown recipe 'fp4'"),
      (dict(backend="triton"), "backend 'triton'"),
      (dict(telemetry_every_steps=-1), "telemetry_every_steps")]:
    with pytest.raises(ValueError, match=match):
      PrecisionConfig(**kwargs)


def test_resolve_recipe_overrides_and_head():
  cfg = PrecisionConfig(recipe="infir2", overrides=(
      "layers_(0|27)/=bf16", "mlp/down_proj=infir2_bf16_wgrad", "down_proj=fp8_rowwise"))
  name = lambda path: resolve_recipe(cfg, path).name
  assert name("layers_0/self_attn/q_proj") == "bf16"
  assert name("layers_27/mlp/up_proj") == "bf16"
  assert name("layers_1/self_attn/q_proj") == "infir2"
  assert name("layers_2/mlp/down_proj") == "infir2_bf16_wgrad"      # first match wins
  assert name("layers_270/mlp/up_proj") == "infir2"                  # "layers_27/" only
  assert name("lm_head") == "bf16" and name("embed_tokens") == "bf16"
  everything = PrecisionConfig(recipe="infir2", overrides=(".*=fp8_rowwise",))
  assert resolve_recipe(everything, "lm_head").name == "bf16"      # head needs opting in
  head = PrecisionConfig(recipe="infir2", quantize_lm_head=True,
                         overrides=("lm_head=fp8_tensorwise",))
  assert resolve_recipe(head, "lm_head").name == "fp8_tensorwise"


def test_factory():
  factory = make_dot_general_factory(PrecisionConfig(recipe="infir2",
                                                     overrides=("layers_0/=bf16",)))
  assert factory("layers_0/mlp/up_proj") is bf16_dot_general
  assert factory("lm_head") is bf16_dot_general
  dg = factory("layers_1/mlp/up_proj")
  assert dg is not lax.dot_general and dg.recipe.name == "infir2"
  assert factory("layers_2/mlp/up_proj") is dg                        # one per recipe
  assert make_dot_general_factory(PrecisionConfig())("layers_1/mlp/up_proj") is bf16_dot_general
  t_factory = make_dot_general_factory(PrecisionConfig(recipe="infir2"), telemetry=True)
  module = t_factory("layers_1/mlp/up_proj")
  assert isinstance(module, telemetry.TelemetryDotGeneral) and module.name == "fp8_up_proj"
  assert t_factory("lm_head") is bf16_dot_general
  with pytest.raises(TypeError, match="PrecisionConfig"):
    make_dot_general_factory({"recipe": "infir2"})
