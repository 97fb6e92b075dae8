"""make_dot_general(recipe): lax.dot_general's signature, FP8 fprop/dgrad/wgrad as a custom_vjp.

Any dimension numbers without batch dims are first canonicalized (outside the custom_vjp, so
plain autodiff handles the reshapes) to the NT form x [M, K] . w [N, K]^T: Flax Dense
(((x.ndim-1,), (0,)), ((), ())), DenseGeneral's several contracting dims, and the tied LM
head's (((x.ndim-1,), (1,)), ((), ())) all land there; w [N, K] is K-major, as cuBLASLt and
the Pallas kernel want it. Inside (recipes.py has the operand layouts):
  fprop  y [M, N]  = NT(x [M, K], w [N, K])        under jax.named_scope("fp8_fprop")
  dgrad  dx [M, K] = NT(dy [M, N], w^T [K, N])     under jax.named_scope("fp8_dgrad")
  wgrad  dw [N, K] = NT(dy^T [N, M], x^T [K, M])   under jax.named_scope("fp8_wgrad")
wgrad is computed as the transpose of the contract's X^T dY (a = dY^T, b = X^T): same
operands and tiles, the [N, K] gradient of w comes out directly, with no output transpose.

Residuals: the backward GEMMs' own quantized operands, made in the forward pass. X^T in its
wgrad tiling (1x128 along tokens: 1 byte + 1/128 scales per element, instead of 2 bytes of
bf16 X) and W in its dgrad tiling; when the backward tiling equals the forward one transposed
(128x128 blocks, per tensor) the forward QTensor is reused, not re-quantized. An operand the
recipe keeps in bf16 is saved as is. So under infir2 the layer saves fp8 X^T + fp8 W^T.
Under remat, the model's policy decides by the names FP8_GEMM_OUT and FP8_RESIDUALS.
The `precision` argument is ignored on quantized paths (the recipe decides).

The lhs of a Dense contraction (its last axis, no batch dims) may be a NormedInput
(normed.py, precision.fused_norm: the fused q|k|v product's input_layernorm not yet
applied): X's tiles then come from the residual stream h in one read (quantize_normed_rows;
the normed X is never written), the residuals keep h, inv and gamma (unnamed, as the fused
MLP's), and the backward returns their cotangents through the norm's product (normed_vjp):
the numbers of materializing X first. With telemetry X is materialized first (its
statistics compare X with its tiles).
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from infir2_jax.precision import cotangents, gemm, quant_error
from infir2_jax.precision.gemm import bf16_dot_general
from infir2_jax.precision.normed import (
    NormedInput, as_residual, from_residual, materialize, normed_vjp, stream)
from infir2_jax.precision.quantize import QTensor, quantize_tensor, resolve_tile
from infir2_jax.precision.recipes import OperandSpec, Recipe, get_recipe

# Names for remat policies (model/qwen2.py). A Pallas GEMM is no dot_general, so the
# "save_dots" policy saves the FP8 GEMM's output by this name, or the backward pass would
# recompute the forward GEMMs; FP8_RESIDUALS (the fp8 X^T and W^T the backward GEMMs take)
# are saved only by "save_dots_fp8", else recomputed by re-quantizing the recomputed X.
FP8_GEMM_OUT = "fp8_gemm_out"
FP8_RESIDUALS = "fp8_residuals"
QUANTIZE_BACKENDS = ("mosaic", "triton")   # kernels of the 1x128 tile quantizers on Hopper
SINK_SHAPE = (2, 2, len(quant_error.STAT_NAMES))   # (dgrad, wgrad) x (lhs, rhs) x stats
FPROP_STATS_SHAPE = (2, len(quant_error.STAT_NAMES))  # (x, w) x stats


@dataclasses.dataclass(frozen=True)
class GemmPlan:
  """What one FP8 product runs: its recipe, backend and dtypes (static under jit)."""
  recipe: Recipe
  backend: str
  out_dtype: np.dtype
  x_dtype: np.dtype
  w_dtype: np.dtype
  compute_dtype: np.dtype   # of unquantized (OperandSpec.fmt None) operands
  telemetry: bool
  has_sink: bool
  # w arrives as stored by Flax Dense, [K, N] (`w` below is then w_KxN): both weight layouts
  # come from one read of it, and wgrad writes dW as [K, N], with no transpose either way.
  w_stored_kxn: bool = False
  # Which kernels make the 1x128 tile quantizations (X, dY) on Hopper: "mosaic" (kernels.
  # quantize_tiles) or "triton" (kernels/quantize_triton.py); precision.quantize_backend.
  quantize_backend: str = "mosaic"


def quantize_operand(x: jax.Array, spec: OperandSpec, compute_dtype=None):
  """x quantized per spec (a QTensor), or x in compute_dtype when the spec keeps it high."""
  if not spec.quantized:
    return x if compute_dtype is None else x.astype(compute_dtype)
  return quantize_tensor(x, spec.tile, spec.fmt, spec.scale_format)


def transposed_operand(prev, raw: jax.Array, spec: OperandSpec, compute_dtype):
  """raw^T quantized per spec, reusing `prev` (raw's quantized form) when it is the same."""
  if not spec.quantized:
    return raw.T.astype(compute_dtype)
  if (isinstance(prev, QTensor) and prev.fmt == spec.fmt
      and prev.scale_format == spec.scale_format
      and resolve_tile(spec.tile, raw.T.shape) == (None if prev.tile is None
                                                   else prev.tile[::-1])):
    return prev.transpose()
  return quantize_operand(raw.T, spec)


def quantizer_kernels(plan: GemmPlan, x, *specs: OperandSpec, tile):
  """The kernels module when its fused quantizer for `tile` applies to x and all specs."""
  quantized = [sp for sp in specs if sp.quantized]
  if (x.dtype != jnp.bfloat16 or x.ndim != 2 or not specs[0].quantized
      or any(sp.tile != tile or (sp.fmt, sp.scale_format) != (specs[0].fmt,
                                                             specs[0].scale_format)
             for sp in quantized)):
    return None
  return gemm.pallas_kernels(plan.backend)


def tile_quantizer(kernels, quantize_backend: str):
  """quantize_tiles of precision.quantize_backend: the Mosaic GPU kernel of the `kernels`
  module, or its Pallas Triton twin (kernels/quantize_triton.py); the same contract."""
  if quantize_backend == "triton":
    from infir2_jax.precision.kernels import quantize_triton
    return quantize_triton.quantize_tiles_triton
  return kernels.quantize_tiles


def quantize_rows(plan: GemmPlan, x_MxK, spec: OperandSpec, spec_t: "OperandSpec | None"):
  """(x per spec, x^T per spec_t or None): X in fprop+wgrad, dY in dgrad+wgrad.

  On Hopper both come from one read of x (quantize_tiles, with_transpose; the kernel of
  plan.quantize_backend).
  """
  specs = (spec,) if spec_t is None else (spec, spec_t)
  kernels = quantizer_kernels(plan, x_MxK, *specs, tile=(1, 128))
  if kernels is None:
    xq = quantize_operand(x_MxK, spec, plan.compute_dtype)
    xt = None if spec_t is None else transposed_operand(xq, x_MxK, spec_t, plan.compute_dtype)
    return xq, xt
  both = spec_t is not None and spec_t.quantized
  quantize_tiles = tile_quantizer(kernels, plan.quantize_backend)
  out = quantize_tiles(x_MxK, fmt=spec.fmt, scale_format=spec.scale_format,
                       with_transpose=both)
  xq = QTensor(out[0], out[1], resolve_tile(spec.tile, x_MxK.shape), spec.scale_format)
  if spec_t is None:
    return xq, None
  if not both:
    return xq, x_MxK.T.astype(plan.compute_dtype)
  return xq, QTensor(out[2], out[3], resolve_tile(spec_t.tile, x_MxK.T.shape),
                     spec.scale_format)


def _normed_kernel(plan: GemmPlan, n: NormedInput, spec: OperandSpec,
                   spec_t: "OperandSpec | None"):
  """kernels.quantize_normed_tiles where it applies to n and both specs, else None: on
  Hopper (quantizer_kernels), with the Mosaic GPU quantizers (it has no Triton twin) and a
  kernels module that has it (looked up at call time, as gemm.pallas_kernels does)."""
  if spec_t is None or not (spec.quantized and spec_t.quantized):
    return None
  if plan.quantize_backend != "mosaic":
    return None
  kernels = quantizer_kernels(plan, stream(n), spec, spec_t, tile=(1, 128))
  return None if kernels is None else getattr(kernels, "quantize_normed_tiles", None)


def quantize_normed_rows(plan: GemmPlan, n: NormedInput, spec: OperandSpec,
                         spec_t: "OperandSpec | None"):
  """quantize_rows(plan, materialize(n), spec, spec_t) for n of a 2-D h [M, K] (a pre-norm
  block's operand, normed.py): on Hopper both tile sets from one read of h, y never
  written; elsewhere y made, then quantize_rows.

  The fallback's y passes an optimization barrier: fused into XLA's quantizer, y's rounding
  to bf16 is dropped (xla_allow_excess_precision folds convert(convert(y32, bf16), f32)),
  and the tiles would be those of the float32 product, not of y as the kernel quantizes it
  (on CPU 3.5% of the FP8 values differed; the unfused model's XLA path can fold RMSNorm's
  y into its quantizer the same way)."""
  quantize_normed_tiles = _normed_kernel(plan, n, spec, spec_t)
  if quantize_normed_tiles is None:
    return quantize_rows(plan, lax.optimization_barrier(materialize(n)), spec, spec_t)
  q, s, qt, st = quantize_normed_tiles(stream(n), n.inv, n.gamma, fmt=spec.fmt,
                                       scale_format=spec.scale_format, with_transpose=True)
  return (QTensor(q, s, resolve_tile(spec.tile, q.shape), spec.scale_format),
          QTensor(qt, st, resolve_tile(spec_t.tile, qt.shape), spec_t.scale_format))


def quantize_x(plan: GemmPlan, x, spec: OperandSpec, spec_t: "OperandSpec | None"):
  """quantize_rows of an activation x: an array [M, K], or a NormedInput (h [..., K],
  inv [..., 1]) whose tiles come from h as [M, K] rows, no normed x written."""
  if isinstance(x, NormedInput):
    k = x.h.shape[-1]
    rows = dataclasses.replace(x, h=x.h.reshape(-1, k), inv=x.inv.reshape(-1, 1))
    return quantize_normed_rows(plan, rows, spec, spec_t)
  return quantize_rows(plan, x, spec, spec_t)


def normed_operand(x: NormedInput) -> NormedInput:
  """A NormedInput as a custom_vjp's operand: gamma in float32, h with its leading dims.

  Leading dims kept: normed_vjp then sums dgamma over the same axes as autodiff through
  RMSNorm does (a bf16 sum: over [B, L] and over [B * L] its bits differed on CPU). gamma
  in float32: the op's backward is marked cotangent_is_buffer, which train/grads.py reads
  only for a param whose single use is a cast to a narrower float feeding the op; dgamma is
  an elementwise product's sum, no GEMM output, so gamma must never be such a param (a
  float32 param stays as it is; a narrower one enters by a widening cast)."""
  return dataclasses.replace(x, gamma=x.gamma.astype(jnp.float32))


def _quantize_weight(plan: GemmPlan, w_NxK, spec: OperandSpec):
  """W^T per spec; 128x128 blocks by kernels.quantize_blocks on Hopper."""
  kernels = quantizer_kernels(plan, w_NxK, spec, tile=(128, 128))
  if kernels is None:
    return quantize_operand(w_NxK, spec, plan.compute_dtype)
  q, scale = kernels.quantize_blocks(w_NxK, fmt=spec.fmt, scale_format=spec.scale_format)
  return QTensor(q, scale, resolve_tile(spec.tile, w_NxK.shape), spec.scale_format)


def quantize_weight_both(plan: GemmPlan, w_KxN, spec_t: OperandSpec, spec: OperandSpec):
  """(W^T per spec_t, W per spec): a weight stored [K, N] as fprop's rhs [N, K] and dgrad's
  rhs [K, N]. On Hopper, 128x128 blocks in both layouts come from one read of W
  (kernels.quantize_blocks with_transpose; the blocks are transpose-symmetric), and no bf16
  transpose of W is made."""
  kernels = (quantizer_kernels(plan, w_KxN, spec_t, spec, tile=(128, 128))
             if spec_t.quantized and spec.quantized else None)
  if kernels is None:
    w_NxK = w_KxN.T
    wq = quantize_operand(w_NxK, spec_t, plan.compute_dtype)
    return wq, transposed_operand(wq, w_NxK, spec, plan.compute_dtype)
  q, s, qt = kernels.quantize_blocks(w_KxN, fmt=spec.fmt, scale_format=spec.scale_format,
                                     with_transpose=True)
  w = QTensor(q, s, resolve_tile(spec.tile, w_KxN.shape), spec.scale_format)
  return QTensor(qt, s.T, resolve_tile(spec_t.tile, qt.shape), spec.scale_format), w


def _dtype(name, default):
  return np.dtype(name) if name is not None else default


def _weight_operands(plan: GemmPlan, w, dgrad_spec):
  """(W^T [N, K] per fprop's rhs spec, W [K, N] per dgrad_spec or None): from w [N, K], or
  from w [K, N] in one read when plan.w_stored_kxn."""
  r = plan.recipe
  if plan.w_stored_kxn:
    return quantize_weight_both(plan, w, r.fprop.rhs, dgrad_spec or r.dgrad.rhs)
  wq = _quantize_weight(plan, w, r.fprop.rhs)
  return wq, (None if dgrad_spec is None
              else transposed_operand(wq, w, dgrad_spec, plan.compute_dtype))


def _w_NxK(plan: GemmPlan, w):
  return w.T if plan.w_stored_kxn else w


def _fprop(plan: GemmPlan, x_MxK, w, xt_spec=None, dgrad_spec=None):
  spec = plan.recipe.fprop
  with jax.named_scope("fp8_fprop"):
    xq, xt = quantize_x(plan, x_MxK, spec.lhs, xt_spec)
    wq, w_KxN = _weight_operands(plan, w, dgrad_spec)
    y_MxN = gemm.matmul_nt(xq, wq, out_dtype=_dtype(spec.out_dtype, plan.out_dtype),
                           backend=plan.backend, fast_accum=spec.fast_accum,
                           isolate_kernel_output=True)  # saved under remat: see matmul_nt
    y_MxN = y_MxN.astype(plan.out_dtype)
  fstats = None
  if plan.telemetry:
    with jax.named_scope("fp8_telemetry"):
      fstats = jnp.stack([quant_error.operand_stats(x_MxK, xq),
                          quant_error.operand_stats(_w_NxK(plan, w), wq)])
  return y_MxN, xq, xt, w_KxN, fstats


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fp8_matmul(plan: GemmPlan, x_MxK, w, sink):
  """y [M, N]; x_MxK an array [M, K] or a NormedInput (h [..., K], normed_operand)."""
  del sink
  # A NormedInput's tiles come from its one kernel only together with X^T's: asked for and
  # dropped, rather than the normed X written out for the quantizer.
  xt_spec = plan.recipe.wgrad.lhs if isinstance(x_MxK, NormedInput) else None
  y_MxN, _, _, _, fstats = _fprop(plan, x_MxK, w, xt_spec=xt_spec)
  return (y_MxN, fstats) if plan.telemetry else y_MxN


def _fp8_matmul_fwd(plan: GemmPlan, x_MxK, w, sink):
  r = plan.recipe
  # X^T for wgrad (tiles along tokens) is made with X's fprop quantization: one read on GPU;
  # W [K, N] for dgrad (N last) with W^T's, reused or from the same read.
  y_MxN, _, xt_KxM, w_KxN, fstats = _fprop(plan, x_MxK, w, xt_spec=r.wgrad.lhs,
                                           dgrad_spec=r.dgrad.rhs)
  bstats = None
  if plan.has_sink:
    with jax.named_scope("fp8_telemetry"):
      bstats = jnp.stack([quant_error.operand_stats(_w_NxK(plan, w).T, w_KxN),
                          quant_error.operand_stats(x_MxK.T, xt_KxM)])
  out = (y_MxN, fstats) if plan.telemetry else y_MxN
  xt_KxM, w_KxN = checkpoint_name((xt_KxM, w_KxN), FP8_RESIDUALS)
  # unnamed, as the fused MLP's (fused_mlp.py says why); h kept in the compute dtype
  norm = as_residual(x_MxK) if isinstance(x_MxK, NormedInput) else None
  return out, (xt_KxM, w_KxN, bstats, norm)


@cotangents.cotangent_is_buffer   # dx and dW: GEMM outputs, each rounded once to its dtype
def _fp8_matmul_bwd(plan: GemmPlan, res, g):
  r = plan.recipe
  xt_KxM, w_KxN, bstats, norm = res
  dy_MxN = g[0] if plan.telemetry else g
  with jax.named_scope("fp8_dgrad"):
    dyq, dyt_NxM = quantize_rows(plan, dy_MxN, r.dgrad.lhs, r.wgrad.rhs)
    dx_MxK = gemm.matmul_nt(dyq, w_KxN, out_dtype=_dtype(r.dgrad.out_dtype, plan.x_dtype),
                            backend=plan.backend, fast_accum=r.dgrad.fast_accum)
  with jax.named_scope("fp8_wgrad"):  # NT(a, b)^T = NT(b, a): dW in w's own layout
    a, b = (xt_KxM, dyt_NxM) if plan.w_stored_kxn else (dyt_NxM, xt_KxM)
    dw = gemm.matmul_nt(a, b, out_dtype=_dtype(r.wgrad.out_dtype, plan.w_dtype),
                        backend=plan.backend, fast_accum=r.wgrad.fast_accum)
  sink_ct = None
  if plan.has_sink:
    with jax.named_scope("fp8_telemetry"):
      dgrad = jnp.stack([quant_error.operand_stats(dy_MxN, dyq), bstats[0]])
      wgrad = jnp.stack([bstats[1], quant_error.operand_stats(dy_MxN.T, dyt_NxM)])
      sink_ct = jnp.stack([dgrad, wgrad])
  dx_MxK = dx_MxK.astype(plan.x_dtype)
  if norm is not None:   # dh, dinv and dgamma: not GEMM outputs (normed_operand says why)
    dx_MxK = normed_vjp(from_residual(norm), dx_MxK.reshape(norm.h.shape))
  return dx_MxK, dw.astype(plan.w_dtype), sink_ct


_fp8_matmul.defvjp(_fp8_matmul_fwd, _fp8_matmul_bwd)


def _lhs_rows(lhs, lc, lf, m: int, k: int):
  """x_MxK of lhs: its free dims then its contracted ones as [M, K]; a NormedInput (only
  contracted on its last axis) as it is, h [..., K] (normed_operand)."""
  if isinstance(lhs, NormedInput):
    if lc != (len(lf),):
      raise NotImplementedError(f"a NormedInput lhs of shape {lhs.h.shape} is contracted on "
                                f"its last axis only (Dense), got contracting dims {lc}")
    return normed_operand(lhs)
  x = lhs if lf + lc == tuple(range(lhs.ndim)) else jnp.transpose(lhs, lf + lc)
  return x.reshape(m, k)


def canonicalize(lhs: "jax.Array | NormedInput", rhs: jax.Array, dimension_numbers):
  """(x_MxK, w, out_shape, stored_kxn) for dimension numbers without batch dims: w is
  [K, N] (stored_kxn) when rhs is contracted on its leading axes, as stored, else w_NxK. No
  op touches rhs but the one that makes w (a use the gradient analysis, train/grads.py,
  follows to the GEMM). A NormedInput lhs stays one (_lhs_rows)."""
  (lc, rc), (lb, rb) = dimension_numbers
  if tuple(lb) or tuple(rb):
    raise NotImplementedError(
        f"FP8 dot_general supports no batch dimensions, got lhs {tuple(lb)} rhs {tuple(rb)}; "
        "batched GEMMs (attention) stay in bf16 by design")
  shape = lhs.shape
  lc = tuple(d % len(shape) for d in lc)
  rc = tuple(d % rhs.ndim for d in rc)
  if len(lc) != len(rc) or any(shape[i] != rhs.shape[j] for i, j in zip(lc, rc)):
    raise ValueError(f"contracting dims {lc} of lhs {shape} and {rc} of rhs {rhs.shape} "
                     "do not match")
  lf = tuple(d for d in range(len(shape)) if d not in lc)
  rf = tuple(d for d in range(rhs.ndim) if d not in rc)
  k = math.prod(shape[d] for d in lc)
  m = math.prod(shape[d] for d in lf)
  n = math.prod(rhs.shape[d] for d in rf)
  x = _lhs_rows(lhs, lc, lf, m, k)
  out_shape = tuple(shape[d] for d in lf) + tuple(rhs.shape[d] for d in rf)
  if rc + rf == tuple(range(rhs.ndim)):   # stored [K..., N...] (Flax Dense): kept as [K, N]
    return x, rhs.reshape(k, n), out_shape, True
  w = rhs if rf + rc == tuple(range(rhs.ndim)) else jnp.transpose(rhs, rf + rc)
  return x, w.reshape(n, k), out_shape, False


def quantized_dot_general(lhs, rhs, dimension_numbers, preferred_element_type=None, *,
                          recipe: Recipe, backend: str = "auto", telemetry: bool = False,
                          sink=None, quantize_backend: str = "mosaic"):
  """The FP8 dot_general of `recipe`; with telemetry returns (y, fprop_stats [2, 3]). lhs
  may be a NormedInput (the module docstring)."""
  if telemetry and isinstance(lhs, NormedInput):
    lhs = materialize(lhs)   # the statistics compare x with its tiles: x must exist
  # A kernel contracted on its leading axes (Flax Dense [K, N], DenseGeneral [K..., N...])
  # enters as stored, reshaped to [K, N]: W^T is made inside, from the same read as W, and
  # dW leaves as [K, N] (no transposes for XLA to run either way).
  x_MxK, w, out_shape, stored_kxn = canonicalize(lhs, rhs, dimension_numbers)
  out_dtype = np.dtype(preferred_element_type if preferred_element_type is not None
                       else jnp.result_type(lhs.dtype, rhs.dtype))
  plan = GemmPlan(recipe, gemm.check_backend(backend), out_dtype, np.dtype(lhs.dtype),
               np.dtype(rhs.dtype), np.dtype(jnp.result_type(lhs.dtype, rhs.dtype)),
               telemetry, telemetry and sink is not None, stored_kxn, quantize_backend)
  out = _fp8_matmul(plan, x_MxK, w, sink)
  if telemetry:
    return checkpoint_name(out[0], FP8_GEMM_OUT).reshape(out_shape), out[1]
  return checkpoint_name(out, FP8_GEMM_OUT).reshape(out_shape)


def check_quantize_backend(quantize_backend: str) -> str:
  """quantize_backend, or a ValueError naming the valid ones."""
  if quantize_backend not in QUANTIZE_BACKENDS:
    raise ValueError(f"quantize_backend={quantize_backend!r}: one of {QUANTIZE_BACKENDS}")
  return quantize_backend


def make_dot_general(recipe: "Recipe | str", *, backend: str = "auto",
                     quantize_backend: str = "mosaic"):
  """A function with lax.dot_general's signature running `recipe`'s three GEMMs.
  quantize_backend: the kernels of the X and dY tile quantizations on Hopper ("mosaic" or
  "triton", precision.quantize_backend).

  The bf16 recipe (no quantized operand) returns lax.dot_general itself, so XLA sees the
  ordinary graph.
  """
  recipe = get_recipe(recipe)
  gemm.check_backend(backend)
  check_quantize_backend(quantize_backend)
  if recipe.is_bf16:
    return bf16_dot_general

  def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                  **unused_kwargs):
    del precision, unused_kwargs  # the recipe decides the numerics
    return quantized_dot_general(lhs, rhs, dimension_numbers, preferred_element_type,
                                 recipe=recipe, backend=backend,
                                 quantize_backend=quantize_backend)

  dot_general.recipe = recipe
  return dot_general
