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
and pure-jnp references `*_reference` of each.
"""
import functools
import importlib

import jax
import jax.numpy as jnp

from infir2_jax.precision.kernels.gemm import BLOCK
from infir2_jax.precision.kernels.gemm import DEFAULT_CONFIG
from infir2_jax.precision.kernels.gemm import FP8_DTYPES
from infir2_jax.precision.kernels.gemm import OUT_DTYPES
from infir2_jax.precision.kernels.gemm import TuningConfig
from infir2_jax.precision.kernels.gemm import default_config
from infir2_jax.precision.kernels.gemm import block_scaled_matmul
from infir2_jax.precision.kernels.gemm import block_scaled_matmul_reference
from infir2_jax.precision.kernels.gemm import KernelScales
from infir2_jax.precision.kernels.gemm import kernel_scales
from infir2_jax.precision.kernels.gemm import matmul_kernel_scales
from infir2_jax.precision.kernels.quantize import quantize_blocks
from infir2_jax.precision.kernels.quantize import quantize_blocks_reference
from infir2_jax.precision.kernels.quantize import quantize_tiles
from infir2_jax.precision.kernels.quantize import quantize_tiles_reference
from infir2_jax.precision.kernels.quantize import scale_from_amax

__all__ = [
    "available", "supports", "TuningConfig", "DEFAULT_CONFIG", "default_config",
    "block_scaled_matmul", "block_scaled_matmul_reference",
    "KernelScales", "kernel_scales", "matmul_kernel_scales",
    "quantize_tiles", "quantize_tiles_reference",
    "quantize_blocks", "quantize_blocks_reference", "scale_from_amax",
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
  if jnp.dtype(a_dtype) not in FP8_DTYPES or jnp.dtype(b_dtype) not in FP8_DTYPES:
    return False
  if jnp.dtype(out_dtype) not in OUT_DTYPES:
    return False
  kb = -(-k // BLOCK)
  return tuple(b_scale_shape) in ((-(-n // BLOCK), kb), (n, kb))
