"""FP8 precision: recipes as data, the FP8 dot_general they inject, its kernels and telemetry.

The data flow, by file: recipes.py (what each GEMM of a projection quantizes) -> config.py
(which recipe runs where) -> factory.py (the model's hook: a dot_general per projection) ->
dot_general.py (fprop / dgrad / wgrad as one custom_vjp; per_shard.py runs it per device;
fused_mlp.py the SwiGLU MLP as one op, quantization fused into SwiGLU and its backward;
normed.py its input's RMSNorm fused into that quantization) ->
gemm.py (the NT GEMM on quantized operands: Pallas, native FP8 or dequantize) ->
kernels/ (Mosaic GPU kernels for Hopper). The FP8 contract itself: formats.py, quantize.py.
Inspection: telemetry.py (amax / flush / SNR of every operand), introspect.py (what ran).
"""

from infir2_jax.precision.config import PrecisionConfig, resolve_recipe
from infir2_jax.precision.dot_general import make_dot_general, quantized_dot_general
from infir2_jax.precision.factory import make_dot_general_factory
from infir2_jax.precision.fused_mlp import make_gated_mlp, swiglu
from infir2_jax.precision.formats import FORMATS, SCALE_FORMATS, get_format
from infir2_jax.precision.gemm import matmul_nt, target_platform
from infir2_jax.precision.introspect import fp8_gemm_report, format_report, hlo_fp8_gemm_count
from infir2_jax.precision.per_shard import MlpAxes, ProjectionAxes
from infir2_jax.precision.quantize import QTensor, dequantize, quantize, quantize_tensor
from infir2_jax.precision.recipes import (
    GemmSpec, OperandSpec, Recipe, get_recipe, recipe_names, register_recipe)
from infir2_jax.precision import telemetry

__all__ = [
    "PrecisionConfig", "resolve_recipe", "make_dot_general", "quantized_dot_general",
    "make_dot_general_factory", "make_gated_mlp", "swiglu", "MlpAxes", "FORMATS", "SCALE_FORMATS", "get_format", "matmul_nt",
    "target_platform", "fp8_gemm_report", "format_report", "hlo_fp8_gemm_count",
    "ProjectionAxes", "QTensor", "dequantize", "quantize", "quantize_tensor", "GemmSpec",
    "OperandSpec", "Recipe", "get_recipe", "recipe_names", "register_recipe", "telemetry",
]
