"""Attention within packed documents without a dense mask: segment runs -> flash kernels.

A row of packed documents has its segment ids as runs of equal values (the data pipeline
numbers documents 1, 2, ... and padding 0). Causal attention restricted to each run is what
the model's dense [B, 1, L, L] segment mask computes; the kernels here take the runs' starts
and lengths instead and skip the blocks between documents:
  cudnn_packed  cuDNN's packed layout (jax's fused_attention_stablehlo with q/kv offsets and
                lengths, at most `max_segments` runs per row)
  fa3_varlen    FlashAttention-3's varlen kernel (flash-attn3-jax), rows flattened into one
                ragged batch of runs
  dense_cudnn   the dense-mask form they replace (the reference on GPU)

Shape legend: B rows, L length, H query heads, K key/value heads, D head size, M max runs.
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class DocumentRuns(NamedTuple):
  """A batch's segment ids with the runs its document kernel takes, made once per model
  call (model/qwen2.py) and handed to every layer in place of the ids alone. Made inside
  each layer, the runs cost nine small kernels a layer, and again in each remat'd layer's
  backward (session 32). runs: cudnn_packed's (lengths [B, M], offsets [B, M + 1]) or
  fa3_varlen's (cu_seqlens [R + 1],)."""
  segment_ids_BxL: jax.Array
  runs: tuple


def split_runs(segments) -> tuple:
  """(segment ids [B, L] or None, the precomputed runs or None) of a layer's `segments`:
  DocumentRuns, or the ids (or None) alone."""
  if isinstance(segments, DocumentRuns):
    return segments.segment_ids_BxL, segments.runs
  return segments, None


def run_starts(segment_ids_BxL: jax.Array) -> jax.Array:
  """[B, L] bool: where a run of equal segment ids begins (position 0 always)."""
  first = jnp.ones(segment_ids_BxL.shape[:1] + (1,), bool)
  return jnp.concatenate([first, segment_ids_BxL[:, 1:] != segment_ids_BxL[:, :-1]], axis=1)


def runs_per_row(segment_ids_BxL: jax.Array) -> jax.Array:
  """[B] number of runs (documents, and the padding run) in each row."""
  return jnp.sum(run_starts(segment_ids_BxL), axis=1)


def runs_per_row_np(segment_ids_BxL) -> np.ndarray:
  """runs_per_row on the host, for a batch before it is dispatched."""
  seg = np.asarray(segment_ids_BxL)
  return 1 + np.sum(seg[:, 1:] != seg[:, :-1], axis=1)


def segment_runs(segment_ids_BxL: jax.Array, max_segments: int):
  """(lengths [B, M], offsets [B, M + 1]) of each row's runs, unused entries -1 (cuDNN's form).

  Rows with more than M runs lose the runs past the M-th: callers check runs_per_row first.
  """
  rows, length = segment_ids_BxL.shape
  starts = jax.vmap(lambda s: jnp.nonzero(s, size=max_segments, fill_value=length)[0])(
      run_starts(segment_ids_BxL)).astype(jnp.int32)
  ends = jnp.concatenate([starts[:, 1:], jnp.full((rows, 1), length, jnp.int32)], axis=1)
  valid = starts < length
  lengths_BxM = jnp.where(valid, ends - starts, -1)
  offsets_BxM1 = jnp.concatenate([jnp.where(valid, starts, -1),
                                  jnp.full((rows, 1), -1, jnp.int32)], axis=1)
  return lengths_BxM, offsets_BxM1


def cu_seqlens(segment_ids_BxL: jax.Array, max_runs: int) -> jax.Array:
  """[max_runs + 1] int32 starts of the runs of the flattened rows, then B * L (FA3's form).

  Unused entries repeat B * L: zero-length sequences at the end.
  """
  total = segment_ids_BxL.size
  starts = jnp.nonzero(run_starts(segment_ids_BxL).reshape(-1), size=max_runs,
                       fill_value=total)[0].astype(jnp.int32)
  return jnp.concatenate([starts, jnp.full((1,), total, jnp.int32)])


def dense_cudnn(q_BxLxHxD, k_BxLxKxD, v_BxLxKxD, segment_ids_BxL):
  """The dense-mask form: cuDNN with a [B, 1, L, L] same-segment mask and is_causal."""
  same = segment_ids_BxL[:, :, None] == segment_ids_BxL[:, None, :]
  return jax.nn.dot_product_attention(q_BxLxHxD, k_BxLxKxD, v_BxLxKxD, mask=same[:, None],
                                      is_causal=True, implementation="cudnn")


def cudnn_packed(q_BxLxHxD, k_BxLxKxD, v_BxLxKxD, segment_ids_BxL, max_segments: int,
                 runs: tuple | None = None):
  """Causal attention within each run by cuDNN's packed layout (Hopper, cuDNN >= 9.6).

  Its softmax statistics (kept for the backward pass) are [B * M, H, L] float32: M scales
  the memory, so keep it near the real number of documents per row. runs: segment_runs'
  (lengths, offsets) of the ids if made already (DocumentRuns).
  """
  from jax._src.cudnn import fused_attention_stablehlo as cudnn  # pylint: disable=g-import-not-at-top
  lengths, offsets = runs if runs is not None else segment_runs(segment_ids_BxL, max_segments)
  return cudnn.dot_product_attention(
      q_BxLxHxD, k_BxLxKxD, v_BxLxKxD, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=offsets,
      kv_offsets=offsets, scale=1.0 / math.sqrt(q_BxLxHxD.shape[-1]),
      mask_type=cudnn.MaskType.PADDING_CAUSAL, qkv_layout="BTNH")


def fa3_varlen(q_BxLxHxD, k_BxLxKxD, v_BxLxKxD, segment_ids_BxL, max_runs: int | None = None,
               runs: tuple | None = None):
  """Causal attention within each run by FlashAttention-3's varlen kernel (Hopper). runs:
  (cu_seqlens(ids, max_runs),) if made already (DocumentRuns)."""
  from flash_attn3_jax import flash_mha_varlen  # pylint: disable=g-import-not-at-top
  rows, length, heads, dim = q_BxLxHxD.shape
  max_runs = max_runs or rows * max(1, length // 16)
  cu = runs[0] if runs is not None else cu_seqlens(segment_ids_BxL, max_runs)
  flat = lambda t: t.reshape(rows * length, *t.shape[2:])
  out = flash_mha_varlen(flat(q_BxLxHxD), flat(k_BxLxKxD), flat(v_BxLxKxD), cu, cu,
                         max_seqlen_q=length, max_seqlen_k=length,
                         softmax_scale=1.0 / math.sqrt(dim), is_causal=True)
  return out.reshape(rows, length, heads, dim)
