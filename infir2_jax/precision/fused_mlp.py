"""The SwiGLU MLP of a block-scaled FP8 recipe as one op: quantization fused into its producers.

  y = down(swiglu(gate(x), up(x))), every GEMM the recipe's, as one jax.custom_vjp:
  forward   x -> (x 1x128 tiles, x^T token tiles)         one read of x
            gu [M, 2F] = x . [Wg | Wu]                    gate and up as ONE GEMM
            h -> (h tiles, h^T tiles) from gu              SwiGLU fused with h's quantization
            y = h . Wd
  backward  dy -> (dy tiles, dy^T tiles)
            dh = dy . Wd^T ; dWd = h^T . dy                as Wd is stored, [F, D]
            dgu -> (tiles, token tiles) from (dh, gu)     SwiGLU's backward fused with the
                                                          quantization of dgate and dup
            dx = dgu . [Wg | Wu]^T                        ONE dgrad GEMM over K = 2F
            d[Wg | Wu] = x^T . dgu                        ONE wgrad GEMM, in [D, 2F]
On Hopper no bf16 h is ever written to memory (kernels.swiglu_quantize); the backward
computes dgu with XLA and quantizes it in one kernels.quantize_tiles call, or, with
fused_backward (precision.fused_mlp_backward), in one kernels.swiglu_bwd_quantize;
elsewhere the same numbers come from XLA (the kernels' references). Numerics against the
three-projection composition: every quantized operand is identical (F is a multiple of
128, so no tile or block straddles gate and up); dx sums the gate and up halves in one f32
accumulator instead of adding two bf16 products.

x may also be a NormedInput (precision/normed.py, precision.fused_norm): the pre-norm
block's RMSNorm not yet applied. x's tiles then come from h, inv and gamma in one read of h
(quantize_normed_rows; the normed x is never written), and the backward returns x's
cotangent through the norm's product (normed_vjp): the same numbers as materializing x first.

Remat names (model/remat.py): gu is FP8_GEMM_OUT (saved by "save_dots", as gate's and up's
outputs were), x^T, h^T and the weights' dgrad layouts are FP8_RESIDUALS. A NormedInput's
h, inv and gamma are residuals without a name: every policy recomputes them from what the
layer keeps anyway (h = x + o_proj's saved output, inv one row reduction of h, gamma a
param), as it recomputes RMSNorm's own residuals on the unfused path; naming them would
keep a second copy of the residual stream per layer under "save_dots_fp8".

Shape legend: M tokens, D width, F MLP width.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from infir2_jax.precision import cotangents, gemm
from infir2_jax.precision.dot_general import (
    FP8_GEMM_OUT, FP8_RESIDUALS, GemmPlan, check_quantize_backend, make_dot_general,
    normed_operand, quantize_rows, quantize_weight_both, quantize_x, quantizer_kernels)
from infir2_jax.precision.kernels import fused_quantize
from infir2_jax.precision.normed import (
    NormedInput, as_residual, from_residual, materialize, normed_vjp)
from infir2_jax.precision.quantize import QTensor, resolve_tile
from infir2_jax.precision.recipes import Recipe, get_recipe

TILE = 128
# kernels.swiglu_bwd_quantize: 575 us on the H200 against 710 for XLA's SwiGLU backward and
# one quantize_tiles of dgu at 16384 x 8960, once its code fits the instruction cache
# (session 17's unrolled kernel, 9,680 instructions, took 2,518 us; benchmarks/
# fused_bwd_bisect.py, NOTES_kernels.md), so precision.fused_mlp_backward is on by default.


def supports(recipe: "Recipe | str") -> bool:
  """Whether `recipe` has the fused MLP: every activation and gradient operand of its three
  GEMMs in 1x128 tiles (X and X^T alike, dY and dY^T alike), as the fused quantizers write."""
  recipe = get_recipe(recipe)
  acts = (recipe.fprop.lhs, recipe.wgrad.lhs)
  grads = (recipe.dgrad.lhs, recipe.wgrad.rhs)
  same = lambda specs: len({(s.fmt, s.scale_format) for s in specs}) == 1
  return (all(s.quantized and s.tile == (1, TILE) for s in acts + grads)
          and same(acts) and same(grads) and recipe.fprop.rhs.quantized
          and recipe.dgrad.rhs.quantized)


# --- SwiGLU, the producer: the model's op in every recipe --------------------------------

@jax.custom_vjp
def swiglu(gate, up):
  """silu(gate) * up computed in float32 and rounded once to the inputs' dtype; its backward
  is kernels.fused_quantize.swiglu_bwd_f32 (the same formula the fused kernel runs)."""
  return fused_quantize.swiglu_f32(gate.astype(jnp.float32), up.astype(jnp.float32))[0].astype(
      gate.dtype)


def _swiglu_fwd(gate, up):
  return swiglu(gate, up), (gate, up)


def _swiglu_bwd(res, dh):
  gate, up = res
  dg, du = fused_quantize.swiglu_bwd_f32(dh.astype(jnp.float32), gate.astype(jnp.float32),
                                         up.astype(jnp.float32))
  return dg.astype(gate.dtype), du.astype(up.dtype)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


# --- the fused MLP -------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _MlpPlan:
  gemm: GemmPlan   # dtypes: activations and weights in the compute dtype
  fast_accum: tuple[bool, bool, bool]
  fused_backward: bool = False


def _tiles(out, spec, spec_t) -> tuple[QTensor, QTensor]:
  """QTensors of a fused quantizer's (q, s, qT, sT)."""
  q, s, qt, st = out
  return (QTensor(q, s, resolve_tile(spec.tile, q.shape), spec.scale_format),
          QTensor(qt, st, resolve_tile(spec_t.tile, qt.shape), spec_t.scale_format))


def fused_quantizers(kernels, quantize_backend: str):
  """(swiglu_quantize, swiglu_bwd_quantize) of precision.quantize_backend: the Mosaic GPU
  kernels of the `kernels` module, or their Pallas Triton twins (kernels/quantize_triton.py)."""
  if quantize_backend == "triton":
    from infir2_jax.precision.kernels import quantize_triton
    return quantize_triton.swiglu_quantize_triton, quantize_triton.swiglu_bwd_quantize_triton
  return kernels.swiglu_quantize, kernels.swiglu_bwd_quantize


def _swiglu_tiles(plan: _MlpPlan, gu, spec, spec_t):
  """(h per spec, h^T per spec_t) of h = swiglu(gu); fused on Hopper."""
  gp = plan.gemm
  kernels = quantizer_kernels(gp, gu, spec, spec_t, tile=(1, TILE))
  if kernels is None:
    return quantize_rows(gp, fused_quantize.swiglu_reference(gu), spec, spec_t)
  swiglu_quantize = fused_quantizers(kernels, gp.quantize_backend)[0]
  return _tiles(swiglu_quantize(gu, fmt=spec.fmt, scale_format=spec.scale_format),
                spec, spec_t)


def _swiglu_bwd_tiles(plan: _MlpPlan, dh, gu, spec, spec_t):
  """(dgu per spec, dgu^T per spec_t) of dgu = [dgate | dup]; one kernel on Hopper with
  plan.fused_backward."""
  gp = plan.gemm
  kernels = quantizer_kernels(gp, dh, spec, spec_t, tile=(1, TILE))
  if kernels is None or gu.dtype != dh.dtype or not plan.fused_backward:
    return quantize_rows(gp, fused_quantize.swiglu_bwd_reference(dh, gu), spec, spec_t)
  swiglu_bwd_quantize = fused_quantizers(kernels, gp.quantize_backend)[1]
  return _tiles(swiglu_bwd_quantize(dh, gu, fmt=spec.fmt, scale_format=spec.scale_format),
                spec, spec_t)


def _matmul(plan: _MlpPlan, which: int, a, b, out_dtype, **kw):
  return gemm.matmul_nt(a, b, out_dtype=out_dtype, backend=plan.gemm.backend,
                        fast_accum=plan.fast_accum[which], **kw)


def _forward(plan: _MlpPlan, x_MxD, wg_DxF, wu_DxF, wd_FxD):
  gp, r = plan.gemm, plan.gemm.recipe
  dtype = gp.compute_dtype
  with jax.named_scope("fp8_fprop"):
    xq, xt_DxM = quantize_x(gp, x_MxD, r.fprop.lhs, r.wgrad.lhs)
    wgu_2FxD, wgu_Dx2F = quantize_weight_both(gp, jnp.concatenate([wg_DxF, wu_DxF], axis=1),
                                              r.fprop.rhs, r.dgrad.rhs)
    gu_Mx2F = _matmul(plan, 0, xq, wgu_2FxD, dtype, isolate_kernel_output=True)
    gu_Mx2F = checkpoint_name(gu_Mx2F, FP8_GEMM_OUT)
    hq, ht_FxM = _swiglu_tiles(plan, gu_Mx2F, r.fprop.lhs, r.wgrad.lhs)
    wd_DxF, wd_FxD = quantize_weight_both(gp, wd_FxD, r.fprop.rhs, r.dgrad.rhs)
    y_MxD = _matmul(plan, 0, hq, wd_DxF, dtype, isolate_kernel_output=True)
  return y_MxD, (xt_DxM, gu_Mx2F, ht_FxM, wgu_Dx2F, wd_FxD)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused_mlp(plan: _MlpPlan, x_MxD, wg_DxF, wu_DxF, wd_FxD):
  """y [M, D]; x_MxD an array [M, D] or a NormedInput (h [..., D], _fused_operand)."""
  return _forward(plan, x_MxD, wg_DxF, wu_DxF, wd_FxD)[0]


def _fused_mlp_fwd(plan: _MlpPlan, x_MxD, wg_DxF, wu_DxF, wd_FxD):
  y_MxD, (xt, gu, ht, wgu, wd) = _forward(plan, x_MxD, wg_DxF, wu_DxF, wd_FxD)
  xt, ht, wgu, wd = checkpoint_name((xt, ht, wgu, wd), FP8_RESIDUALS)
  # unnamed (see the docstring); h kept in the compute dtype
  norm = as_residual(x_MxD) if isinstance(x_MxD, NormedInput) else None
  return y_MxD, (xt, gu, ht, wgu, wd, norm)


# dx, dWd and [dWg | dWu] are GEMM outputs rounded once. For a NormedInput x, dh, dinv and
# dgamma are not (normed_vjp: elementwise, and a sum over tokens for dgamma), yet the mark
# stays true where train/grads.py reads it: only for a param whose single use is a cast to
# a narrower float feeding this op. h and inv are activations, and gamma enters in float32
# (dot_general.normed_operand), so no param's gradient is ever taken as exact in bf16 here:
# the norm scale keeps its float32 gradient, as RMSNorm's elementwise use gives it.
@cotangents.cotangent_is_buffer
def _fused_mlp_bwd(plan: _MlpPlan, res, dy_MxD):
  gp, r = plan.gemm, plan.gemm.recipe
  xt_DxM, gu_Mx2F, ht_FxM, wgu_Dx2F, wd_FxD, norm = res
  f = ht_FxM.shape[0]
  dx_dtype = np.dtype(r.dgrad.out_dtype or gp.x_dtype)
  dw_dtype = np.dtype(r.wgrad.out_dtype or gp.w_dtype)
  with jax.named_scope("fp8_dgrad"):
    dyq, dyt_DxM = quantize_rows(gp, dy_MxD, r.dgrad.lhs, r.wgrad.rhs)
    dh_MxF = _matmul(plan, 1, dyq, wd_FxD, gp.compute_dtype)
  # The weight gradients come out in their params' layouts (wd [F, D], wg and wu [D, F]):
  # NT(a, b)^T = NT(b, a) over the same tiles, so the operands swap instead of the result
  # being transposed (on the H200 a transposed gradient made the optimizer's update a
  # transpose fusion at ~1/4 of the bandwidth: ~30 ms per 1.5B step).
  with jax.named_scope("fp8_wgrad"):
    dwd_FxD = _matmul(plan, 2, ht_FxM, dyt_DxM, dw_dtype)
  with jax.named_scope("fp8_dgrad"):
    dguq, dgut_2FxM = _swiglu_bwd_tiles(plan, dh_MxF, gu_Mx2F, r.dgrad.lhs, r.wgrad.rhs)
    dx_MxD = _matmul(plan, 1, dguq, wgu_Dx2F, dx_dtype)
  with jax.named_scope("fp8_wgrad"):
    dwgu_Dx2F = _matmul(plan, 2, xt_DxM, dgut_2FxM, dw_dtype)
  dx_MxD = dx_MxD.astype(gp.x_dtype)
  return (dx_MxD if norm is None else normed_vjp(from_residual(norm),
                                                 dx_MxD.reshape(norm.h.shape)),
          dwgu_Dx2F[:, :f].astype(gp.w_dtype), dwgu_Dx2F[:, f:].astype(gp.w_dtype),
          dwd_FxD.astype(gp.w_dtype))


_fused_mlp.defvjp(_fused_mlp_fwd, _fused_mlp_bwd)


def _composed(recipe: Recipe, backend: str, quantize_backend: str = "mosaic"):
  """The same MLP as three products of the recipe (widths that are not whole tiles)."""
  dot_general = make_dot_general(recipe, backend=backend, quantize_backend=quantize_backend)
  dims = lambda x: (((x.ndim - 1,), (0,)), ((), ()))

  def mlp(x, wg, wu, wd):
    h = swiglu(dot_general(x, wg, dims(x)), dot_general(x, wu, dims(x)))
    return dot_general(h, wd, dims(h))
  return mlp


def _fused_operand(x, d: int):
  """_fused_mlp's x: an array as [M, D] rows; a NormedInput as dot_general.normed_operand
  has it (h with its leading dims, gamma in float32: that function says why)."""
  if isinstance(x, NormedInput):
    return normed_operand(x)
  return x.reshape(-1, d)


def make_gated_mlp(recipe: "Recipe | str", *, backend: str = "auto",
                   fused_backward: bool = False, quantize_backend: str = "mosaic",
                   fused_norm: bool = False):
  """mlp(x [..., D], w_gate [D, F], w_up [D, F], w_down [F, D]) -> y [..., D] of `recipe`
  (one that `supports`), all in the compute dtype; F not a multiple of 128 runs the
  composition of three products instead. x may be a NormedInput with h [..., D] (the
  pre-norm block's RMSNorm, applied inside: precision/normed.py). fused_backward: SwiGLU's
  backward and dgu's quantization as one kernel on Hopper (precision.fused_mlp_backward).
  quantize_backend: "mosaic" or "triton", the kernels of its 1x128 tile quantizers,
  SwiGLU's included (precision.quantize_backend). fused_norm (precision.fused_norm) sets
  mlp.accepts_normed, which tells the model to hand the MLP its norm's NormedInput rather
  than the normed x."""
  check_quantize_backend(quantize_backend)
  recipe = get_recipe(recipe)
  if not supports(recipe):
    raise ValueError(f"recipe {recipe.name!r} has no fused MLP (needs 1x128 tiles for every "
                     "activation and gradient operand); use its dot_general")
  gemm.check_backend(backend)
  fast_accum = (recipe.fprop.fast_accum, recipe.dgrad.fast_accum, recipe.wgrad.fast_accum)
  composed = _composed(recipe, backend, quantize_backend)

  def mlp(x, wg_DxF, wu_DxF, wd_FxD):
    x_dtype = np.dtype(x.dtype)   # a NormedInput's: the compute dtype its y rounds to
    (d, f), lead = wg_DxF.shape, x.shape[:-1]
    if f % TILE or wu_DxF.shape != (d, f) or wd_FxD.shape != (f, d) or x.shape[-1] != d:
      x = materialize(x) if isinstance(x, NormedInput) else x
      return composed(x, wg_DxF, wu_DxF, wd_FxD)
    dtype = np.dtype(jnp.result_type(x_dtype, wg_DxF.dtype))
    plan = _MlpPlan(GemmPlan(recipe, backend, dtype, x_dtype,
                             np.dtype(wg_DxF.dtype), dtype, False, False,
                             quantize_backend=quantize_backend),
                    fast_accum, fused_backward)
    return _fused_mlp(plan, _fused_operand(x, d), wg_DxF, wu_DxF, wd_FxD).reshape(*lead, d)

  mlp.recipe = recipe
  mlp.accepts_normed = fused_norm
  return mlp
