"""FP8 attention: the forward's two GEMMs in E4M3, the backward in BF16 (issue 39, step 1).

TransformerEngine's NVTE_FP8_DPA_BWD=0 pattern: QK^T and PV run on FP8 operands with the
recipe's tile scaling; the backward is the BF16 attention's, computed from the saved BF16
q, k and v (straight-through: the FP8 rounding of the forward is not differentiated).

The forward, per batch row and query head (GQA: a query head reads its group's key/value
head), over the keys a query may attend to (causal, and within its document when segment
ids are given):
  Q8, K8 = quantize(q), quantize(k)   1x128 tiles along the head dim: one scale per token
                                      and head (QK^T's contraction)
  S      = deq(Q8) deq(K8)^T / sqrt(Dh)               (float32)
  m      = max_j S_ij;  P~ = exp(S - m), 0 where masked;  l = sum_j P~_ij  (float32)
  P8     = quantize(P~)               1x128 tiles along the keys (PV's contraction)
  V8     = quantize(v)                1x128 tiles along the tokens, per head-dim column
  O      = deq(P8) deq(V8) / l
Every quantize is the project's FP8 contract (quantize.py): current scaling per tile, the
recipe's format and scale format (UE8M0: powers of two). With power-of-two scales the tile
scaling of P~ makes P8 independent of which power of two P~ is measured against, so a
one-pass kernel (online softmax: P~ against a running max) differs from this reference only
where its running max is not the final one by a power of two.

This module is the reference the Pallas kernel (precision/kernels/fp8_attention.py, the
forward on Hopper) is tested against and the path the CPU sweep runs (dense [B, K, G, L, L]
float32 scores: memory grows with L^2). `quantization_stats` measures what the forward's
quantization loses (always on this XLA forward).

V's tiles run along the tokens, so a tile that spans a document boundary gives the tokens
of both documents one scale: a document's output depends on its neighbour's values through
that scale (as the wgrad's 1x128 token tiles of every infir2 projection do), never through
the attention weights.
"""

import functools
import importlib
import logging

import jax
import jax.numpy as jnp
from jax import lax

from infir2_jax.precision import gemm
from infir2_jax.precision import quant_error
from infir2_jax.precision.quantize import quantize_tensor
from infir2_jax.precision.recipes import AttentionSpec

_TILE = (1, 128)
_HIGHEST = lax.Precision.HIGHEST
DENSE_SCORES_WARN_BYTES = 4 << 30   # one layer's [B, H, L, L] float32 scores above this


def allowed_keys(length: int, segment_ids_BxL: jax.Array | None) -> jax.Array:
  """[B or 1, L, L] boolean: key j is visible to query i (j <= i, same document)."""
  causal_LxL = jnp.arange(length)[:, None] >= jnp.arange(length)[None, :]
  if segment_ids_BxL is None:
    return causal_LxL[None]
  same_BxLxL = segment_ids_BxL[:, :, None] == segment_ids_BxL[:, None, :]
  return causal_LxL[None] & same_BxLxL


def _round_trip(x, spec: AttentionSpec):
  """(float32 dequantized x, its QTensor) with 1x128 tiles over x's last two dims."""
  xq = quantize_tensor(x, _TILE, spec.fmt, spec.scale_format)
  return xq.dequantize(jnp.float32), xq


def _forward(q_BxLxHxDh, k_BxLxKxDh, v_BxLxKxDh, segment_ids_BxL, spec: AttentionSpec):
  """(out [B, L, H, Dh] in q's dtype, {operand: (float32 value, QTensor)} for the
  statistics, operands "q", "k", "p", "v" in the layouts they are quantized in, and the
  [B|1, 1, 1, L, S] mask of allowed keys)."""
  batch, length, heads, dh = q_BxLxHxDh.shape
  kv_heads = k_BxLxKxDh.shape[2]
  if heads % kv_heads:
    raise ValueError(f"FP8 attention: {heads} query heads are not a multiple of {kv_heads} "
                     "key/value heads")
  groups = heads // kv_heads
  scores_bytes = 4 * batch * heads * length * length
  if scores_bytes > DENSE_SCORES_WARN_BYTES:
    logging.warning(
        "FP8 attention runs on XLA with dense scores (the FP8 attention kernel runs only on "
        "a Hopper GPU, head dim 128, rows a multiple of 128): one "
        "layer's [%d, %d, %d, %d] float32 scores take %.1f GiB, and the forward holds several "
        "such arrays; at this sequence length use recipe infir2 (BF16 attention) for speed "
        "and memory, or shorter rows to study FP8 attention's numerics", batch, heads,
        length, length, scores_bytes / 2**30)
  q32, qq = _round_trip(q_BxLxHxDh, spec)
  k32, kq = _round_trip(k_BxLxKxDh, spec)
  q32 = q32.reshape(batch, length, kv_heads, groups, dh)
  scores = jnp.einsum("blkgd,bskd->bkgls", q32, k32, precision=_HIGHEST)
  scores = scores * jnp.float32(1.0 / dh ** 0.5)
  allowed = allowed_keys(length, segment_ids_BxL)[:, None, None]   # [B|1, 1, 1, L, S]
  scores = jnp.where(allowed, scores, -jnp.inf)
  row_max = jnp.max(scores, axis=-1, keepdims=True)   # finite: the diagonal is allowed
  p = jnp.where(allowed, jnp.exp(scores - row_max), 0.0)
  row_sum = jnp.sum(p, axis=-1, keepdims=True)
  p32, pq = _round_trip(p, spec)                               # tiles along the keys
  v_BxKxDhxL = jnp.transpose(v_BxLxKxDh, (0, 2, 3, 1))
  v32, vq = _round_trip(v_BxKxDhxL, spec)                      # tiles along the tokens
  out = jnp.einsum("bkgls,bkds->bkgld", p32, v32, precision=_HIGHEST) / row_sum
  out_BxLxHxDh = jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(batch, length, heads, dh)
  operands = {"q": (q_BxLxHxDh, qq), "k": (k_BxLxKxDh, kq), "p": (p, pq),
              "v": (v_BxKxDhxL, vq)}
  return out_BxLxHxDh.astype(q_BxLxHxDh.dtype), operands, allowed


def bf16_attention(q_BxLxHxDh, k_BxLxKxDh, v_BxLxKxDh, segment_ids_BxL):
  """The unquantized attention (XLA): causal, within documents when segment ids are given."""
  length = q_BxLxHxDh.shape[1]
  mask = None if segment_ids_BxL is None else allowed_keys(length, segment_ids_BxL)[:, None]
  return jax.nn.dot_product_attention(q_BxLxHxDh, k_BxLxKxDh, v_BxLxKxDh, mask=mask,
                                      is_causal=True)


def _kernel_module(q, k, v, segment_ids, use_kernel: bool):
  """The FP8 attention kernel's module where it is asked for (use_kernel), a Hopper GPU runs
  the Pallas kernels and the kernel takes these shapes, else None (the XLA forward below)."""
  if not use_kernel or gemm.pallas_kernels("auto") is None:
    return None
  kernel = importlib.import_module("infir2_jax.precision.kernels.fp8_attention")
  return kernel if kernel.supports(q, k, v, segment_ids) else None


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def fp8_attention(q_BxLxHxDh, k_BxLxKxDh, v_BxLxKxDh, segment_ids_BxL, spec: AttentionSpec,
                  use_kernel: bool = False, backward=None):
  """Causal (document-masked where segment ids are given) GQA attention, FP8 forward.

  q [B, L, H, Dh], k and v [B, L, K, Dh] (H a multiple of K), segment_ids [B, L] int or
  None. Returns [B, L, H, Dh] in q's dtype. Gradients: the BF16 attention's (module doc):
  those of `backward(q, k, v, segment_ids)`, the model's own BF16 attention (on a GPU
  cuDNN's packed kernel, model/attention.bf16_train_attention, which recomputes its forward
  for them), or where None `bf16_attention` (XLA, dense [L, L] scores).
  With use_kernel (precision.fp8_attention_kernel), on a Hopper GPU the forward is the
  Mosaic GPU kernel (precision/kernels/fp8_attention.py: one pass, running max; head dim
  128, rows a multiple of 128, contiguous documents) where it takes the shapes; elsewhere,
  and by default, this module's XLA forward (dense scores). The kernel is opt-in: on the
  H200 (session 24) it departs from its reference by 10% of max |out|, which the Mosaic
  GPU interpreter does not reproduce. Under a multi-device mesh the kernel is an opaque
  custom call that XLA runs whole per device (no shard_map yet).
  """
  kernel = _kernel_module(q_BxLxHxDh, k_BxLxKxDh, v_BxLxKxDh, segment_ids_BxL, use_kernel)
  if kernel is not None:
    return kernel.fp8_attention_forward(q_BxLxHxDh, k_BxLxKxDh, v_BxLxKxDh, segment_ids_BxL,
                                        fmt=spec.fmt, scale_format=spec.scale_format)
  return _forward(q_BxLxHxDh, k_BxLxKxDh, v_BxLxKxDh, segment_ids_BxL, spec)[0]


OPERANDS = ("q", "k", "p", "v")   # the rows of operand_stats


def operand_stats(q_BxLxHxDh, k_BxLxKxDh, v_BxLxKxDh, segment_ids_BxL,
                  spec: AttentionSpec) -> jax.Array:
  """[4, 3] float32: quant_error.operand_stats (amax, flush_frac, snr_db) of Q, K, P and V
  as the forward quantizes them, for the trainer's telemetry (precision/telemetry.py).
  P's flush fraction counts its nonzero probabilities, masked keys left out."""
  _, operands, _ = _forward(q_BxLxHxDh, k_BxLxKxDh, v_BxLxKxDh, segment_ids_BxL, spec)
  return jnp.stack([quant_error.operand_stats(*operands[name]) for name in OPERANDS])


def _fp8_attention_fwd(q, k, v, segment_ids, spec, use_kernel, backward):
  out = fp8_attention(q, k, v, segment_ids, spec, use_kernel, backward)
  return out, (q, k, v, segment_ids)


def _fp8_attention_bwd(spec, use_kernel, backward, residuals, g):
  del spec, use_kernel
  q, k, v, segment_ids = residuals
  attend = bf16_attention if backward is None else backward
  _, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, segment_ids), q, k, v)
  return (*vjp(g), None)


fp8_attention.defvjp(_fp8_attention_fwd, _fp8_attention_bwd)


def quantization_stats(q_BxLxHxDh, k_BxLxKxDh, v_BxLxKxDh, segment_ids_BxL,
                       spec: AttentionSpec) -> dict[str, jax.Array]:
  """What the FP8 forward's quantization loses, as float32 scalars.

  p_flush: the share of the attended probabilities P~ (allowed, normal in float32) whose
  FP8 code is zero (they vanish from PV); p_flush_mass: the share of P~'s sum they held.
  p_snr_db, q_snr_db, k_snr_db, v_snr_db: each quantized operand's signal-to-noise ratio
  (quant_error.operand_stats). out_rel_err: the relative L2 distance of the FP8 forward's output from the unquantized attention's (both
  in float32).
  """
  f32 = lambda x: x.astype(jnp.float32)
  out, operands, allowed = _forward(f32(q_BxLxHxDh), f32(k_BxLxKxDh), f32(v_BxLxKxDh),
                                    segment_ids_BxL, spec)
  p, pq = operands["p"]
  # Attended: a normal float32 probability (exp underflows below ~e^-87 differently on
  # each backend, and the quantizer flushes subnormals anyway).
  attended = allowed & (p >= jnp.finfo(jnp.float32).tiny)
  flushed = attended & (pq.q.astype(jnp.float32) == 0)
  stats = {"p_flush": jnp.sum(flushed) / jnp.maximum(jnp.sum(attended), 1),
           "p_flush_mass": jnp.sum(jnp.where(flushed, p, 0.0)) / jnp.sum(p)}
  for name in OPERANDS:
    stats[f"{name}_snr_db"] = quant_error.operand_stats(*operands[name])[2]
  want = bf16_attention(f32(q_BxLxHxDh), f32(k_BxLxKxDh), f32(v_BxLxKxDh), segment_ids_BxL)
  stats["out_rel_err"] = jnp.linalg.norm(out - want) / jnp.linalg.norm(want)
  return stats
