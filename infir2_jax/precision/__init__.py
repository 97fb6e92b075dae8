"""FP8 precision: formats, tile quantization, recipes, the FP8 dot_general and its telemetry."""

from infir2_jax.precision.config import PrecisionConfig, resolve_recipe
from infir2_jax.precision.dot_general import make_dot_general, quantized_dot_general
from infir2_jax.precision.factory import make_dot_general_factory
from infir2_jax.precision.formats import FORMATS, SCALE_FORMATS, get_format
from infir2_jax.precision.gemm import matmul_nt
from infir2_jax.precision.introspect import fp8_gemm_report, format_report, hlo_fp8_gemm_count
from infir2_jax.precision.quantize import QTensor, dequantize, quantize, quantize_tensor
from infir2_jax.precision.recipes import (
    GemmSpec, OperandSpec, Recipe, get_recipe, recipe_names, register_recipe)
from infir2_jax.precision import telemetry

__all__ = [
    "PrecisionConfig", "resolve_recipe", "make_dot_general", "quantized_dot_general",
    "make_dot_general_factory", "FORMATS", "SCALE_FORMATS", "get_format", "matmul_nt",
    "fp8_gemm_report", "format_report", "hlo_fp8_gemm_count", "QTensor", "dequantize",
    "quantize", "quantize_tensor", "GemmSpec", "OperandSpec", "Recipe", "get_recipe",
    "recipe_names", "register_recipe", "telemetry",
]
