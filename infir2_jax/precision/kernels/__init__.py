"""Pallas Mosaic GPU kernels for Hopper: block-scaled FP8 GEMM and fused FP8 quantization.

Entry points (all take an `interpret` flag that runs the Mosaic GPU interpreter
on CPU, for tests):
  available()                      Hopper GPU present and Mosaic GPU importable.
  supports(m, n, k, ...)           whether block_scaled_matmul takes these operands.
  block_scaled_matmul(...)         the canonical NT contract (see gemm.py).
  matmul_kernel_scales(...)        the same with scales already in the kernel's layout
                                   (KernelScales, built by kernel_scales()).
  quantize_tiles(...)              1x128 tiles [+ token-axis tiles for wgrad].
  quantize_blocks(...)             128x128 weight blocks [+ transposed q].
  quantize_normed_tiles(...)       the tiles of an RMSNorm's output, from its input h.
  swiglu_quantize(...)             SwiGLU fused with the 1x128 tiles of its output.
  swiglu_bwd_quantize(...)         SwiGLU's backward fused with the tiles of dgate, dup.
and pure-jnp references `*_reference` of each.

Files: gemm.py (GEMM wrapper and reference), gemm_body.py (its Pallas body), tuning.py
(TuningConfig, default_config, fitting), quantize.py (quantization kernels and references), fused_quantize.py (quantization fused
into the elementwise producer of the operand).
The FP8 formats and scale rules they share are infir2_jax.precision.formats's.
"""
import functools
import importlib

import jax
import jax.numpy as jnp

from infir2_jax.precision import formats
from infir2_jax.precision.kernels.gemm import KernelScales
from infir2_jax.precision.kernels.gemm import OUT_DTYPES
from infir2_jax.precision.kernels.gemm import block_scaled_matmul
from infir2_jax.precision.kernels.gemm import block_scaled_matmul_reference
from infir2_jax.precision.kernels.gemm import kernel_scales
from infir2_jax.precision.kernels.gemm import matmul_kernel_scales
from infir2_jax.precision.kernels.fused_quantize import swiglu_bwd_quantize
from infir2_jax.precision.kernels.fused_quantize import swiglu_bwd_quantize_reference
from infir2_jax.precision.kernels.fused_quantize import swiglu_quantize
from infir2_jax.precision.kernels.fused_quantize import swiglu_quantize_reference
from infir2_jax.precision.kernels.quantize import quantize_blocks
from infir2_jax.precision.kernels.quantize import quantize_blocks_reference
from infir2_jax.precision.kernels.quantize import quantize_normed_tiles
from infir2_jax.precision.kernels.quantize import quantize_normed_tiles_reference
from infir2_jax.precision.kernels.quantize import quantize_tiles
from infir2_jax.precision.kernels.quantize import quantize_tiles_reference
from infir2_jax.precision.kernels.tuning import BLOCK
from infir2_jax.precision.kernels.tuning import TuningConfig
from infir2_jax.precision.kernels.tuning import default_config

__all__ = [
    "available", "supports", "TuningConfig", "default_config",
    "block_scaled_matmul", "block_scaled_matmul_reference",
    "KernelScales", "kernel_scales", "matmul_kernel_scales",
    "quantize_tiles", "quantize_tiles_reference",
    "quantize_blocks", "quantize_blocks_reference",
    "quantize_normed_tiles", "quantize_normed_tiles_reference",
    "swiglu_quantize", "swiglu_quantize_reference",
    "swiglu_bwd_quantize", "swiglu_bwd_quantize_reference",
]


@functools.cache
def available() -> bool:
  """True when the default backend is a Hopper (sm_90) GPU and Mosaic GPU imports."""
  try:
    devices = jax.devices()
  except RuntimeError:
    return False
  if not devices or devices[0].platform != "gpu":
    return False
  if getattr(devices[0], "compute_capability", None) != "9.0":
    return False  # wgmma is sm_90 only (Blackwell has tcgen05 instead).
  try:
    importlib.import_module("jax.experimental.pallas.mosaic_gpu")
  except ImportError:
    return False
  return True


def supports(m: int, n: int, k: int, a_dtype, b_dtype, b_scale_shape, out_dtype=jnp.bfloat16
             ) -> bool:
  """Whether block_scaled_matmul takes A [m, k], B [n, k] with this b_scale shape.

  Any positive M, N, K works (tails are padded or masked); operands must be e4m3
  or e5m2, out bfloat16 or float32, and b_scale [ceil(n/128), ceil(k/128)]
  (128x128 blocks) or [n, ceil(k/128)] (1x128 tiles). Pure shape logic: it does
  not check for a GPU (see available()).
  """
  if min(m, n, k) < 1:
    return False
  if not (formats.is_fp8_dtype(a_dtype) and formats.is_fp8_dtype(b_dtype)):
    return False
  if jnp.dtype(out_dtype) not in OUT_DTYPES:
    return False
  kb = -(-k // BLOCK)
  return tuple(b_scale_shape) in ((-(-n // BLOCK), kb), (n, kb))
