"""Grouped-query self-attention for training (packed documents) and for cached decoding.

Training attends within each packed document (segment ids) or over the whole row (causal).
On cuDNN the document mask runs as cuDNN's packed layout (model/packed_attention.py: no
[B, 1, L, L] mask, the blocks between documents skipped); XLA (CPU) applies the dense mask,
the reference the packed path is tested against.
Decoding is the same module called with `decode=True` and a mutable "cache" collection
(flax lm1b's pattern): each call appends its keys and values at the cache's write index,
and queries attend to the cached slots up to their own that hold keys of their segment
(padding carries segment 0, real tokens 1, so pad slots are never attended to by real ones).

Shape legend: B batch, L length, T tokens fed in one decoding call, S cache slots, H query
heads, K key/value heads, Dh head size, D width.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from infir2_jax.model import packed_attention
from infir2_jax.model.config import ModelConfig
from infir2_jax.model.axes import TOKEN_AXES, compute_axes
from infir2_jax.model.layers import (
    DotGeneralFactory, Linear, LinearParams, apply_rope, default_dot_general_factory,
    module_path, rope_cos_sin)
from infir2_jax.model.remat import ATTENTION_INPUTS
from infir2_jax.precision.gemm import target_platform
from infir2_jax.precision.normed import NormedInput, materialize
from infir2_jax.precision.per_shard import QkvAxes

CACHE = "cache"


def segment_mask(segment_ids_BxL: jax.Array) -> jax.Array:
  """[B, 1, L, L] boolean: query and key in the same packed segment (causality is separate).

  Passed with `is_causal=True`, so cuDNN's flash attention skips the blocks above the
  diagonal (half the work) and applies only this mask inside the causal triangle.
  """
  same_segment_BxLxL = segment_ids_BxL[:, :, None] == segment_ids_BxL[:, None, :]
  return same_segment_BxLxL[:, None]


def shard_for_cudnn(q_BxLxHxDh, k_BxLxKxDh, v_BxLxKxDh, mask_Bx1xLxL):
  """Shardings cuDNN attention's SPMD partitioner accepts: q, k and v alike, mask by batch.

  Its partitioner requires identical PartitionSpecs for q, k and v (split on batch and heads
  only) and the mask split on batch only; left to propagation, K and V come out sharded
  otherwise and the compile fails ("Query, key and value should have same sharding"). Where
  the KV heads are replicated but the query heads split (tensor degree > KV heads), K and V
  are repeated to one head per query head first, as Megatron does. No-op without a mesh.
  """
  if nn.logical_to_mesh_axes(("act_heads",)) != nn.logical_to_mesh_axes(("act_kv_heads",)):
    groups = q_BxLxHxDh.shape[2] // k_BxLxKxDh.shape[2]
    k_BxLxKxDh = jnp.repeat(k_BxLxKxDh, groups, axis=2)
    v_BxLxKxDh = jnp.repeat(v_BxLxKxDh, groups, axis=2)
  qkv = tuple(nn.with_logical_constraint(t, ("batch", "length", "act_heads", None))
              for t in (q_BxLxHxDh, k_BxLxKxDh, v_BxLxKxDh))
  if mask_Bx1xLxL is not None:
    mask_Bx1xLxL = nn.with_logical_constraint(mask_Bx1xLxL, ("batch", None, None, None))
  return (*qkv, mask_Bx1xLxL)


def implementation(cfg: ModelConfig, platform: str | None = None) -> str | None:
  """jax.nn.dot_product_attention's implementation for model.attention ("auto": cuDNN on
  a GPU target, else XLA); `platform` defaults to the one being compiled for."""
  platform = platform or target_platform()
  if cfg.attention == "cudnn" or (cfg.attention == "auto" and platform == "gpu"):
    return "cudnn"
  return None


def uses_packed_documents(cfg: ModelConfig, platform: str | None = None) -> bool:
  """Whether training attention runs cuDNN's packed layout (bounded by model.max_documents)."""
  return cfg.attention_mask == "document" and implementation(cfg, platform) == "cudnn"


def check_documents(segment_ids_BxL, cfg: ModelConfig) -> None:
  """Raises ValueError when a row holds more documents than the packed layout takes."""
  most = int(np.max(packed_attention.runs_per_row_np(segment_ids_BxL), initial=0))
  if most > cfg.max_documents:
    raise ValueError(
        f"a batch row holds {most} documents (runs of segment ids), more than "
        f"model.max_documents={cfg.max_documents} that cuDNN's packed attention is built for; "
        f"set --config.model.max_documents={most} or more (its cost grows with it), or "
        "model.attention_mask='causal' to attend across documents")


def document_runs(cfg: ModelConfig, segment_ids_BxL: jax.Array):
  """segment_ids_BxL as the layers should get them: DocumentRuns (the ids with the runs the
  training attention's document kernel takes, made here once for all layers) where that
  kernel runs (uses_packed_documents), else the ids themselves."""
  if not uses_packed_documents(cfg):
    return segment_ids_BxL
  segment_ids_BxL = nn.with_logical_constraint(segment_ids_BxL, ("batch", None))
  if cfg.document_kernel == "fa3_varlen":
    runs = (packed_attention.cu_seqlens(segment_ids_BxL,
                                        segment_ids_BxL.shape[0] * cfg.max_documents),)
  else:
    runs = tuple(nn.with_logical_constraint(r, ("batch", None))
                 for r in packed_attention.segment_runs(segment_ids_BxL, cfg.max_documents))
  # materialized once (the barrier: XLA would otherwise fuse them into each layer's use)
  return packed_attention.DocumentRuns(segment_ids_BxL, lax.optimization_barrier(runs))


def bf16_train_attention(cfg: ModelConfig, q_BxLxHxDh, k_BxLxKxDh, v_BxLxKxDh,
                         segment_ids_BxL, runs: tuple | None = None):
  """The training attention in BF16: causal, within documents where segment ids are given
  (None: over the whole row). On cuDNN documents run as its packed layout (or FA3 varlen,
  model.document_kernel), from `runs` where document_runs made them; XLA applies the dense
  mask. Also the backward of the FP8 attention (its gradients are this function's)."""
  impl = implementation(cfg)
  if segment_ids_BxL is not None and impl == "cudnn":
    q_BxLxHxDh, k_BxLxKxDh, v_BxLxKxDh, _ = shard_for_cudnn(
        q_BxLxHxDh, k_BxLxKxDh, v_BxLxKxDh, None)
    segment_ids_BxL = nn.with_logical_constraint(segment_ids_BxL, ("batch", None))
    if cfg.document_kernel == "fa3_varlen":
      return packed_attention.fa3_varlen(
          q_BxLxHxDh, k_BxLxKxDh, v_BxLxKxDh, segment_ids_BxL,
          q_BxLxHxDh.shape[0] * cfg.max_documents, runs=runs)
    return packed_attention.cudnn_packed(q_BxLxHxDh, k_BxLxKxDh, v_BxLxKxDh,
                                         segment_ids_BxL, cfg.max_documents, runs=runs)
  mask_Bx1xLxL = None if segment_ids_BxL is None else segment_mask(segment_ids_BxL)
  if impl == "cudnn":
    q_BxLxHxDh, k_BxLxKxDh, v_BxLxKxDh, mask_Bx1xLxL = shard_for_cudnn(
        q_BxLxHxDh, k_BxLxKxDh, v_BxLxKxDh, mask_Bx1xLxL)
  return jax.nn.dot_product_attention(q_BxLxHxDh, k_BxLxKxDh, v_BxLxKxDh, mask=mask_Bx1xLxL,
                                      is_causal=True, implementation=impl)


class Attention(nn.Module):
  """Grouped-query self-attention with q/k/v biases; softmax in float32.

  x may be a pre-norm's NormedInput (RMSNorm(deferred=True)): the factory's fused q/k/v
  product takes it as it is where it accepts_normed (takes_normed), anything else gets it
  materialized, the norm's y bit for bit. x is read by nothing but the q/k/v projections."""
  config: ModelConfig
  dot_general_factory: DotGeneralFactory = default_dot_general_factory

  def _dense(self, features, axes, bias, name):
    cfg = self.config
    return Linear(features, axes, bias, dtype=jnp.dtype(cfg.dtype),
                  param_dtype=jnp.dtype(cfg.param_dtype), init_std=cfg.init_std,
                  dot_general_factory=self.dot_general_factory, name=name)

  @nn.nowrap
  def _fused_op(self, ndim: int):
    """The factory's fused q/k/v product for this path and an x of `ndim` dims, or None."""
    if not hasattr(self.dot_general_factory, "fused_qkv") or ndim - 1 > len(TOKEN_AXES):
      return None
    q_axes, kv_axes = compute_axes(("embed", "heads")), compute_axes(("embed", "kv_heads"))
    axes = QkvAxes(x=(*TOKEN_AXES[:ndim - 1], q_axes[0]), q=q_axes, kv=kv_axes)
    return self.dot_general_factory.fused_qkv(module_path(self), axes)

  def takes_normed(self, ndim: int) -> bool:
    """Whether an x of `ndim` dims should come as its norm's NormedInput: the fused q/k/v
    product runs here and accepts one (precision.fused_norm)."""
    return getattr(self._fused_op(ndim), "accepts_normed", False)

  @nn.compact
  def __call__(self, x_BxLxD: "jax.Array | NormedInput", rope_BxLxDh, segments,
               decode: bool = False):
    """rope_BxLxDh: (cos, sin) [B, L, Dh] of the tokens' positions (layers.rope_cos_sin), or
    the positions [B, L] themselves (INFIR2_ROPE=per_layer: the tables made here).
    segments: the segment ids [B, L], or document_runs' DocumentRuns (the ids with their
    runs, made once for all layers)."""
    cfg = self.config
    segment_ids_BxL, runs = packed_attention.split_runs(segments)
    if isinstance(x_BxLxD, NormedInput) and not self.takes_normed(x_BxLxD.ndim):
      x_BxLxD = materialize(x_BxLxD)
    batch, length, width = x_BxLxD.shape
    heads, kv_heads, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_size
    q, k, v = self._qkv(x_BxLxD)
    q_BxLxHxDh = q.reshape(batch, length, heads, dh)
    k_BxLxKxDh = k.reshape(batch, length, kv_heads, dh)
    v_BxLxKxDh = v.reshape(batch, length, kv_heads, dh)
    q_BxLxHxDh = nn.with_logical_constraint(q_BxLxHxDh, ("batch", "length", "act_heads", None))

    shared_tables = isinstance(rope_BxLxDh, tuple)
    cos, sin = rope_BxLxDh if shared_tables else rope_cos_sin(rope_BxLxDh, dh, cfg.rope_theta)
    q_BxLxHxDh = apply_rope(q_BxLxHxDh, cos, sin)
    k_BxLxKxDh = apply_rope(k_BxLxKxDh, cos, sin)
    if shared_tables:  # the save-dots remat policies keep these rather than redo RoPE
      q_BxLxHxDh, k_BxLxKxDh, v_BxLxKxDh = checkpoint_name(
          (q_BxLxHxDh, k_BxLxKxDh, v_BxLxKxDh), ATTENTION_INPUTS)

    cached = self._append_to_cache(k_BxLxKxDh, v_BxLxKxDh, segment_ids_BxL) if decode else None
    if cached is not None:
      out_BxLxHxDh = jax.nn.dot_product_attention(q_BxLxHxDh, cached[0], cached[1],
                                                  mask=cached[2])
    else:
      out_BxLxHxDh = self._train_attention(q_BxLxHxDh, k_BxLxKxDh, v_BxLxKxDh, segment_ids_BxL,
                                           runs)
    out_BxLxHDh = out_BxLxHxDh.reshape(batch, length, heads * dh)
    return self._dense(width, ("heads", "embed"), False, "o_proj")(out_BxLxHDh)

  def _qkv(self, x_BxLxD: "jax.Array | NormedInput"):
    """(q [B, L, H Dh], k, v [B, L, K Dh]): as the factory's fused q/k/v product where it
    offers one (precision.fused_qkv; the same params), else three projections. x is a
    NormedInput only where that product takes one (__call__ materialized it otherwise)."""
    cfg = self.config
    heads, kv_heads, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_size
    specs = (("q_proj", heads * dh, ("embed", "heads")),
             ("k_proj", kv_heads * dh, ("embed", "kv_heads")),
             ("v_proj", kv_heads * dh, ("embed", "kv_heads")))
    normed = isinstance(x_BxLxD, NormedInput)
    fused = self._fused_op(x_BxLxD.ndim)
    if fused is None:
      return tuple(self._dense(n, axes, cfg.qkv_bias, name)(x_BxLxD)
                   for name, n, axes in specs)
    dtype = jnp.dtype(cfg.dtype)
    params = [LinearParams(n, axes, cfg.qkv_bias, dtype, jnp.dtype(cfg.param_dtype),
                           cfg.init_std, name=name)(x_BxLxD.shape[-1])
              for name, n, axes in specs]
    biases = tuple(bias for _, bias in params) if cfg.qkv_bias else None
    return fused(x_BxLxD if normed else x_BxLxD.astype(dtype),
                 *(kernel for kernel, _ in params), biases=biases)

  def _train_attention(self, q_BxLxHxDh, k_BxLxKxDh, v_BxLxKxDh, segment_ids_BxL, runs):
    document = self.config.attention_mask == "document"
    segment_ids_BxL = segment_ids_BxL if document else None
    fp8_attention = getattr(self.dot_general_factory, "attention", None)
    attend = fp8_attention(module_path(self)) if fp8_attention is not None else None
    if attend is not None:   # a recipe with FP8 attention (precision/fp8_attention.py)
      return attend(q_BxLxHxDh, k_BxLxKxDh, v_BxLxKxDh, segment_ids_BxL,
                    backward=functools.partial(bf16_train_attention, self.config))
    return bf16_train_attention(self.config, q_BxLxHxDh, k_BxLxKxDh, v_BxLxKxDh,
                                segment_ids_BxL, runs=runs)

  def _append_to_cache(self, k_BxTxKxDh, v_BxTxKxDh, segment_ids_BxT):
    """Writes this call's keys, values and segment ids at the cache's index; returns
    (k, v [B, S, K, Dh], mask [B, 1, T, S]), or None in the call that sizes the cache
    (model.init with decode=True: S = that call's length)."""
    sizing = not self.has_variable(CACHE, "k")
    k_cache = self.variable(CACHE, "k", jnp.zeros, k_BxTxKxDh.shape, k_BxTxKxDh.dtype)
    v_cache = self.variable(CACHE, "v", jnp.zeros, v_BxTxKxDh.shape, v_BxTxKxDh.dtype)
    seg_cache = self.variable(CACHE, "segment_ids", jnp.zeros, segment_ids_BxT.shape, jnp.int32)
    index = self.variable(CACHE, "index", lambda: jnp.zeros((), jnp.int32))
    if sizing:
      return None
    at, length = index.value, k_BxTxKxDh.shape[1]
    write = lambda cache, new: lax.dynamic_update_slice_in_dim(
        cache.value, new.astype(cache.value.dtype), at, axis=1)
    k_cache.value = write(k_cache, k_BxTxKxDh)
    v_cache.value = write(v_cache, v_BxTxKxDh)
    seg_cache.value = write(seg_cache, segment_ids_BxT)
    index.value = at + length
    slots = k_cache.value.shape[1]
    # Slots past the index are still zero, and past every query's own slot: causality
    # keeps them out.
    causal_TxS = jnp.arange(slots)[None, :] <= (at + jnp.arange(length))[:, None]
    same_BxTxS = segment_ids_BxT[:, :, None] == seg_cache.value[:, None, :]
    return k_cache.value, v_cache.value, (causal_TxS[None] & same_BxTxS)[:, None]
