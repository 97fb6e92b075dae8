"""The canonical NT GEMM out[M, N] = a[M, K] . b[N, K]^T on quantized operands, and its backends.

Execution paths, chosen per call from the operands' tiles and `backend`:
1. Pallas (`precision.kernels.block_scaled_matmul`): a in 1x128 tiles and b in 128x128
   blocks or 1x128 tiles, when backend is "pallas", or "auto" and `kernels.available()` (a
   Hopper GPU) and `kernels.supports(m, n, k, a_dtype, b_dtype, b_scale_shape, out_dtype)`.
2. Native FP8 (XLA): both operands with ONE scale along K (per tensor or per row): the fp8
   arrays go straight into lax.dot_general (f32 result), then the scales multiply the output.
   On GPU this is cuBLASLt's FP8 GEMM (`__cublas$lt$matmul$f8`); b stays [N, K] (K-major),
   the layout cuBLASLt takes without a transpose. precision=HIGHEST turns cuBLASLt's fast
   accumulation off (partial sums promoted to f32), unless GemmSpec.fast_accum.
3. Dequantize (XLA, any tiles): each operand is dequantized, then one dot with f32
   accumulation. With power-of-two (ue8m0) scales the dequantized values are exact in bf16
   (<= 4 significant bits times 2**k), so a bf16 x bf16 -> f32 dot computes exact products
   summed in f32: the contract's value up to the order of f32 additions. With fp32 scales,
   q * s needs up to 28 bits, so operands are dequantized in f32 and the dot runs at
   precision HIGHEST: each product then carries ~2**-24 relative rounding that the contract
   (which scales per-K-block partial sums) does not have; far below the FP8 error itself.
Unquantized operands (OperandSpec.fmt None) enter path 3 as they are.
"""

import functools
import importlib

import jax
import jax.numpy as jnp
from jax import lax

from infir2_jax.errors import ConfigError
from infir2_jax.precision import cotangents
from infir2_jax.precision.quantize import QTensor, expand_scale, resolve_tile

Operand = "QTensor | jax.Array"
BACKENDS = ("auto", "xla", "pallas")
_NT = (((1,), (1,)), ((), ()))


def check_backend(backend: str) -> str:
  if backend not in BACKENDS:
    raise ConfigError(f"precision backend {backend!r}; valid: {list(BACKENDS)}")
  return backend


def pallas_kernels(backend: str):
  """The Pallas kernels module when `backend` allows it and a Hopper GPU runs them, else None
  ("auto" falls back to XLA; "pallas" raises)."""
  if check_backend(backend) == "xla":
    return None
  # Looked up at call time (as sys.modules has it), so tests can stand in fake kernels.
  kernels = importlib.import_module("infir2_jax.precision.kernels")
  if kernels.available():
    return kernels
  if backend == "pallas":
    raise RuntimeError("precision.backend='pallas' but the Pallas kernels need a Hopper GPU "
                       "with Mosaic GPU (kernels.available() is False); use 'auto' or 'xla'")
  return None


def bf16_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
  """lax.dot_general for the BF16 GEMMs (the `bf16` recipe, the LM head).

  A wider result than the operands (bf16 x bf16 -> f32 logits) keeps its backward GEMMs in
  the operands' dtype: the f32 cotangent is rounded to bf16 first, as Megatron's bf16 output
  layer does. Plain autodiff would feed the f32 cotangent to dgrad and wgrad and so run them
  as f32 (TF32) GEMMs, at half the bf16 rate (the LM head is ~1/5 of a 1.5B model's FLOPs).
  """
  out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs.dtype, rhs.dtype))
  if (lhs.dtype == rhs.dtype and jnp.issubdtype(lhs.dtype, jnp.floating)
      and out_dtype.itemsize > lhs.dtype.itemsize):
    return _narrow_backward_dot(lhs, rhs, _hashable(dimension_numbers), precision, out_dtype)
  return _bf16_dot(lhs, rhs, dimension_numbers, precision, preferred_element_type)


def _bf16_dot(lhs, rhs, dimension_numbers, precision, preferred_element_type):
  """lax.dot_general; on CPU, bf16 operands are upcast and multiplied as f32.

  Products of bf16 values are exact in f32 and the sum is f32, which is what a GPU tensor core
  computes for a bf16 GEMM, while XLA:CPU's native bf16 dot runs ~6x slower.
  """
  if target_platform() != "cpu" or jnp.bfloat16 not in (lhs.dtype, rhs.dtype):
    return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                           preferred_element_type=preferred_element_type)
  out_dtype = preferred_element_type or jnp.result_type(lhs.dtype, rhs.dtype)
  y = lax.dot_general(lhs.astype(jnp.float32), rhs.astype(jnp.float32), dimension_numbers,
                      precision=precision, preferred_element_type=jnp.float32)
  return y.astype(out_dtype)


def target_platform() -> str:
  """The platform being compiled for: the mesh's devices, else the default backend (a
  deviceless compile for a GPU mesh runs on a CPU host)."""
  device = jax.sharding.get_abstract_mesh().abstract_device
  return device.platform if device is not None else jax.default_backend()


def _hashable(dimension_numbers):
  return tuple(tuple(tuple(int(d) for d in dims) for dims in pair) for pair in dimension_numbers)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _narrow_backward_dot(lhs, rhs, dimension_numbers, precision, out_dtype):
  return _bf16_dot(lhs, rhs, dimension_numbers, precision, out_dtype)


def _narrow_backward_dot_fwd(lhs, rhs, dimension_numbers, precision, out_dtype):
  return _bf16_dot(lhs, rhs, dimension_numbers, precision, out_dtype), (lhs, rhs)


@cotangents.cotangent_is_buffer   # dgrad and wgrad: bf16 GEMM outputs
def _narrow_backward_dot_bwd(dimension_numbers, precision, out_dtype, residuals, g):
  lhs, rhs = residuals
  _, vjp = jax.vjp(lambda a, b: _bf16_dot(a, b, dimension_numbers, precision, lhs.dtype),
                   lhs, rhs)
  return vjp(g.astype(lhs.dtype))


_narrow_backward_dot.defvjp(_narrow_backward_dot_fwd, _narrow_backward_dot_bwd)


def _is_block_scaled(a: QTensor, b: QTensor) -> bool:
  """a in 1x128 tiles along K; b in 128x128 blocks or 1x128 tiles: the kernel's contract."""
  tile_128 = lambda t: resolve_tile((1, 128), t.shape)
  return a.tile == tile_128(a) and b.tile in (resolve_tile((128, 128), b.shape), tile_128(b))


def _row_scale(t: QTensor) -> jax.Array:
  """The scale of a one-K-block operand as a scalar or a [rows, 1] column."""
  if t.tile is None:
    return t.scale
  return expand_scale(t.scale, t.tile, (t.shape[0], 1))


def _native_fp8(a: QTensor, b: QTensor, out_dtype, fast_accum: bool) -> jax.Array:
  precision = lax.Precision.DEFAULT if fast_accum else lax.Precision.HIGHEST
  y_MxN = lax.dot_general(a.q, b.q, _NT, precision=precision,
                          preferred_element_type=jnp.float32)
  sa, sb = _row_scale(a), _row_scale(b)
  y_MxN = y_MxN * sa * (sb.T if sb.ndim else sb)
  return y_MxN.astype(out_dtype)


def _dequantized(a: Operand, b: Operand, out_dtype) -> jax.Array:
  def operand(t):
    if isinstance(t, QTensor):
      return t.dequantize(jnp.bfloat16 if t.scale_format == "ue8m0" else jnp.float32)
    return t
  a, b = operand(a), operand(b)
  if jnp.float32 in (a.dtype, b.dtype):
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    precision = lax.Precision.HIGHEST  # no TF32 / bf16 passes on GPU
  else:
    dtype = jnp.result_type(a.dtype, b.dtype)
    a, b = a.astype(dtype), b.astype(dtype)
    precision = None
  y_MxN = _bf16_dot(a, b, _NT, precision, jnp.float32)  # inside the FP8 custom_vjp: no autodiff
  return y_MxN.astype(out_dtype)


def _one_k_block(t: Operand) -> bool:
  return isinstance(t, QTensor) and (t.tile is None or t.tile[1] == t.shape[1])


def matmul_nt(a: Operand, b: Operand, *, out_dtype, backend: str = "auto",
              fast_accum: bool = False, isolate_kernel_output: bool = False) -> jax.Array:
  """out[M, N] = a[M, K] . b[N, K]^T with f32 accumulation, on the best available path.

  Args:
    a, b: QTensor (quantized) or plain arrays (kept in their dtype), both 2-D, K last.
    out_dtype: dtype of the result.
    backend: "auto" | "xla" | "pallas" (see module docstring).
    fast_accum: allow non-promoting FP8 accumulation on the native FP8 path.
    isolate_kernel_output: pass the Pallas kernel's result through an optimization barrier.
      For outputs a scanned, rematerialized layer saves for the backward pass (the fprop):
      XLA:GPU's dynamic-slice fusion otherwise fuses the kernel into the dynamic-update-slice
      that stacks the saved value, and because the value has other users it CLONES the
      custom call: every saved FP8 GEMM ran twice per step (756 instead of 588 GEMMs in the
      1.5B step, +31 ms of 519; benchmarks/NOTES_e2e.md). The barrier costs
      nothing at run time; the stacking becomes an ordinary (async) copy.
  """
  if a.shape[1] != b.shape[1] or len(a.shape) != 2 or len(b.shape) != 2:
    raise ValueError(f"matmul_nt needs a [M, K] and b [N, K], got {a.shape} and {b.shape}")
  if isinstance(a, QTensor) and isinstance(b, QTensor):
    if _is_block_scaled(a, b):
      kernels = pallas_kernels(backend)
      if kernels is not None:
        (m, k), n = a.shape, b.shape[0]
        if kernels.supports(m, n, k, a.q.dtype, b.q.dtype, b.scale.shape, out_dtype):
          out = kernels.block_scaled_matmul(a.q, a.scale, b.q, b.scale, out_dtype=out_dtype)
          return lax.optimization_barrier(out) if isolate_kernel_output else out
        if backend == "pallas":
          raise ValueError(
              f"backend='pallas': the kernel does not support a {a.q.dtype}{a.shape} x "
              f"b {b.q.dtype}{b.shape} (b tile {b.tile}, out {jnp.dtype(out_dtype)}); "
              "use backend='auto' to fall back to XLA")
    if _one_k_block(a) and _one_k_block(b):
      return _native_fp8(a, b, out_dtype, fast_accum)
  return _dequantized(a, b, out_dtype)
