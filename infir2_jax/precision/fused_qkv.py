"""The q, k and v projections as one product (a block-scaled FP8 recipe, or bf16).

  [q | k | v] [M, Nq + 2 Nk] = x [M, D] . [Wq | Wk | Wv]    ONE FP8 dot_general (dot_general.py)

against three, it runs
  - one fprop, one dgrad (over K = Nq + 2 Nk) and one wgrad GEMM instead of three each: the
    k and v GEMMs alone are narrow (N or K = 256 at 1.5B, 512 at 7B) and ran at 540-787
    TFLOP/s on the H200 against 1202-1328 for the wide ones (issue 33's profile);
  - one dY quantization of [dq | dk | dv] and one of the weights, and no sum of three bf16
    dx products.
The three quantizations of x (and their saved X^T) were one already: XLA merges identical
kernel calls. Session 26 (H100): the fused GEMMs take 0.68-0.86x the three's time at 1.5B,
the step 351.0 against 352.5 ms (benchmarks/NOTES_e2e.md).

Numerics against three projections, where every quantized operand's tiles are at most
128 x 128 (per_shard.shard_local: infir2 and its variants) and each width Nq, Nk is a multiple
of 128: no tile or block straddles two projections, so every quantized operand is the same,
q, k and v come out bit for bit, and so do the weight gradients (wgrad reads the same
tiles); dx sums the three dgrad products in one float32 accumulator instead of rounding
each to bf16 and adding them (as the fused MLP's dx does). Other widths, or recipes with
row- or tensor-wide scales (whose amax would span the concatenation), run the three
projections as before.

The bf16 recipe (Megatron's fused linear_qkv): XLA's dot merger already makes q|k|v one GEMM
in the forward and in wgrad, but not in dgrad, where it ran three GEMMs into [M, D] (two of
them K = Nk, narrow) and added their bf16 results. On the concatenated weights dgrad is one
GEMM over K = Nq + 2 Nk, summed in its float32 accumulator and rounded once: q, k, v and
the weight gradients are unchanged, dx is closer to float64.

x may be a NormedInput (precision/normed.py, precision.fused_norm): the input_layernorm not
yet applied. The one FP8 product quantizes it straight from the residual stream
(dot_general.py takes it as its lhs), so the normed x is never written; the three products
and the bf16 recipe (no quantizer to fuse it into) get it materialized.

Shape legend: M tokens, D width, Nq = H x Dh, Nk = KV x Dh.
"""

import jax.numpy as jnp

from infir2_jax.precision.cotangents import broadcast_like
from infir2_jax.precision.dot_general import make_dot_general
from infir2_jax.precision.normed import NormedInput, materialize
from infir2_jax.precision.per_shard import shard_local
from infir2_jax.precision.recipes import Recipe, get_recipe

TILE = 128


def supports(recipe: "Recipe | str") -> bool:
  """Whether `recipe` has the fused q/k/v product: bf16, or every quantized operand in
  tiles of at most 128 x 128 (the concatenation then changes no scale)."""
  recipe = get_recipe(recipe)
  return recipe.is_bf16 or shard_local(recipe)


def make_fused_qkv(recipe: "Recipe | str", *, backend: str = "auto",
                   quantize_backend: str = "mosaic", fused_norm: bool = False):
  """qkv(x [..., D], wq [D, Nq], wk [D, Nk], wv [D, Nk], biases=None) -> (q, k, v) [..., N*]
  of `recipe` (one that `supports`), all in the compute dtype: one product on the
  concatenated weights where every width is a multiple of 128 (any width for bf16), else
  three. biases (bq [Nq], bk, bv [Nk]) are added as one [Nq + 2 Nk] vector to the one
  product, so the backward sums their gradients from [dq | dk | dv] as it is built (one
  pass, fused with it, instead of re-reading dq, dk and dv: session 32), in float32
  (cotangents.broadcast_like); the values are those of adding each to its slice. x may be a
  NormedInput with h [..., D] (the module docstring). fused_norm (precision.fused_norm) sets
  qkv.accepts_normed, which tells the model to hand it its norm's NormedInput rather than
  the normed x; never for bf16, which would only materialize it."""
  recipe = get_recipe(recipe)
  if not supports(recipe):
    raise ValueError(f"recipe {recipe.name!r} has no fused q/k/v product (needs bf16 or a "
                     "recipe whose quantized tiles are at most 128 x 128); use its dot_general")
  dot_general = make_dot_general(recipe, backend=backend, quantize_backend=quantize_backend)

  def qkv(x, wq, wk, wv, biases=None):
    widths = (wq.shape[1], wk.shape[1], wv.shape[1])
    three = not recipe.is_bf16 and any(n % TILE for n in widths)
    if isinstance(x, NormedInput) and (three or recipe.is_bf16):
      x = materialize(x)
    dims = (((x.ndim - 1,), (0,)), ((), ()))
    if three:
      outs = tuple(dot_general(x, w, dims) for w in (wq, wk, wv))
      return outs if biases is None else tuple(
          y + broadcast_like(b, y) for y, b in zip(outs, biases))
    y = dot_general(x, jnp.concatenate([wq, wk, wv], axis=1), dims)
    if biases is not None:
      y = y + broadcast_like(jnp.concatenate(biases), y)
    nq, nk, _ = widths
    return y[..., :nq], y[..., nq:nq + nk], y[..., nq + nk:]

  qkv.recipe = recipe
  qkv.accepts_normed = fused_norm and not recipe.is_bf16
  return qkv
