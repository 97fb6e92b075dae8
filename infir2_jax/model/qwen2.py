"""The Qwen2/Qwen2.5 decoder-only language model (Flax linen)."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from infir2_jax.model import layers
from infir2_jax.model.attention import Attention, document_runs
from infir2_jax.model.axes import compute_axes
from infir2_jax.model.config import ModelConfig
from infir2_jax.model.layers import (
    MLP, DotGeneralFactory, Linear, RMSNorm, default_dot_general_factory, embed_lookup,
    rope_cos_sin)
from infir2_jax.model.remat import POLICIES


class DecoderLayer(nn.Module):
  """Pre-norm block: x + attn(norm(x)), then h + mlp(norm(h))."""
  config: ModelConfig
  dot_general_factory: DotGeneralFactory = default_dot_general_factory

  @nn.compact
  def __call__(self, x_BxLxD, rope_BxLxDh, segments, decode: bool = False):
    """rope_BxLxDh: the (cos, sin) tables of the tokens' positions (layers.rope_cos_sin),
    made once per model call and shared by every layer (the positions [B, L] under
    INFIR2_ROPE=per_layer). segments: the segment ids [B, L], or with their runs
    (attention.document_runs), likewise made once."""
    cfg = self.config
    dtype, param_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
    norm = lambda name: RMSNorm(cfg.rms_norm_eps, dtype, param_dtype, name=name)
    # precision.fused_norm: the fused q/k/v product and the fused MLP quantize their norm's
    # output straight from the residual stream (its NormedInput), so the normed x and h are
    # never written (precision/normed.py).
    attn = Attention(cfg, self.dot_general_factory, name="self_attn")
    normed_x = norm("input_layernorm")(x_BxLxD, deferred=attn.takes_normed(x_BxLxD.ndim))
    h = x_BxLxD + attn(normed_x, rope_BxLxDh, segments, decode)
    mlp = MLP(cfg.intermediate_size, dtype, param_dtype, cfg.init_std,
              self.dot_general_factory, name="mlp")
    normed_h = norm("post_attention_layernorm")(h, deferred=mlp.takes_normed(h.ndim))
    out = h + mlp(normed_h)
    return nn.with_logical_constraint(out, ("batch", "length", "act_embed"))


def tied_head(dot_general, x_BxLxD, table_VxD):
  """Logits [B, L, V] in float32 against the (compute-dtype) embedding table."""
  return dot_general(x_BxLxD, table_VxD, (((x_BxLxD.ndim - 1,), (1,)), ((), ())),
                     precision=None, preferred_element_type=jnp.float32)


class Qwen2(nn.Module):
  """Qwen2 causal LM. `__call__` returns float32 logits [B, L, V].

  Every projection (q, k, v, o, gate, up, down, lm_head) gets its dot_general from
  `dot_general_factory`, the single point where a precision recipe plugs in.

  Decoding: `apply(..., decode=True, mutable=["cache"])` appends the tokens to each layer's
  KV cache (model.attention); the cache is sized by `init(..., decode=True)` on a batch of
  the full length (inference/generate.py does both).
  """
  config: ModelConfig
  dot_general_factory: DotGeneralFactory = default_dot_general_factory

  @nn.compact
  def __call__(self, tokens_BxL, positions_BxL=None, segment_ids_BxL=None,
               return_hidden: bool = False, decode: bool = False):
    cfg = self.config
    dtype, param_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
    if positions_BxL is None:
      positions_BxL = jnp.broadcast_to(jnp.arange(tokens_BxL.shape[-1]), tokens_BxL.shape)
    if segment_ids_BxL is None:
      segment_ids_BxL = jnp.ones_like(tokens_BxL)
    # RoPE's tables once for all layers: made inside each remat'd layer, the backward would
    # recompute them in every layer (sin and cos of [B, L, Dh], ~2 ms of a 1.5B/8k step).
    # Constants (stop_gradient: a remat'd layer would otherwise differentiate its inputs cos
    # and sin too), materialized once (the barrier: XLA fusing sin or cos into a consumer
    # can round them differently, so every remat policy reads the same bits).
    if layers.ROPE not in layers.ROPES:
      raise ValueError(f"INFIR2_ROPE={layers.ROPE!r}: one of {layers.ROPES}")
    rope_BxLxDh = positions_BxL   # INFIR2_ROPE=per_layer, the A/B form: each layer's own
    if layers.ROPE == "once":
      rope_BxLxDh = jax.lax.optimization_barrier(jax.lax.stop_gradient(
          rope_cos_sin(positions_BxL, cfg.head_size, cfg.rope_theta)))
    # Likewise the document kernel's runs of the segment ids (nine small kernels a layer).
    segments = segment_ids_BxL if decode else document_runs(cfg, segment_ids_BxL)

    embed = nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=param_dtype,
                     embedding_init=nn.with_logical_partitioning(
                         nn.initializers.normal(cfg.init_std), ("vocab", "embed")),
                     name="embed_tokens")
    table_VxD = nn.with_logical_constraint(embed.embedding.astype(dtype),
                                           compute_axes(("vocab", "embed")))
    x_BxLxD = embed_lookup(table_VxD, tokens_BxL)
    x_BxLxD = nn.with_logical_constraint(x_BxLxD, ("batch", "length", "act_embed"))

    if cfg.scan_layers and not (self.is_initializing() or decode):
      x_BxLxD = self._scanned_layers(x_BxLxD, rope_BxLxDh, segments)
    else:
      layer_cls = DecoderLayer
      if cfg.remat != "none" and not decode:
        layer_cls = nn.remat(DecoderLayer, policy=POLICIES[cfg.remat], prevent_cse=True,
                             static_argnums=(4,))
      for i in range(cfg.num_layers):
        x_BxLxD = layer_cls(cfg, self.dot_general_factory, name=f"layers_{i}")(
            x_BxLxD, rope_BxLxDh, segments, decode)
    x_BxLxD = RMSNorm(cfg.rms_norm_eps, dtype, param_dtype, name="norm")(x_BxLxD)
    if return_hidden:
      return x_BxLxD
    # LM head in the compute dtype with a float32 result: softmax and loss need f32.
    if cfg.tie_embeddings:
      return tied_head(self.dot_general_factory("lm_head"), x_BxLxD.astype(dtype), table_VxD)
    head = Linear(cfg.vocab_size, ("embed", "vocab"), False, dtype, param_dtype,
                  cfg.init_std, _f32_factory(self.dot_general_factory), name="lm_head")
    return head(x_BxLxD)

  def head_logits(self, params, hidden_BxLxD):
    """The LM head alone, from `params` (a pure function, outside apply): float32 logits of
    the final hidden states that `__call__(..., return_hidden=True)` returns. The chunked
    loss and decoding call it; the same computation as the end of `__call__`."""
    x_BxLxD = hidden_BxLxD.astype(jnp.dtype(self.config.dtype))
    weight, vocab_axis = self.head_weight(params)
    if vocab_axis == 0:   # the tied embedding table [V, D]
      return tied_head(self.dot_general_factory("lm_head"), x_BxLxD, weight)
    return _f32_factory(self.dot_general_factory)("lm_head")(
        x_BxLxD, weight, (((x_BxLxD.ndim - 1,), (0,)), ((), ())))

  def head_weight(self, params) -> tuple[jax.Array, int]:
    """(the LM head's weight in the compute dtype, its vocabulary axis) as head_logits uses
    it: the tied embedding table [V, D] (axis 0) or the kernel [D, V] (axis 1). The fused
    head and loss (model.loss_fused) take it with the hidden states."""
    cfg = self.config
    dtype = jnp.dtype(cfg.dtype)
    if cfg.tie_embeddings:
      return nn.with_logical_constraint(params["embed_tokens"]["embedding"].astype(dtype),
                                        compute_axes(("vocab", "embed"))), 0
    return nn.with_logical_constraint(params["lm_head"]["kernel"].astype(dtype),
                                      compute_axes(("embed", "vocab"))), 1

  def _scanned_layers(self, x_BxLxD, rope_BxLxDh, segments):
    """The layers as one lax.scan over their params, stacked on a leading axis per step."""
    cfg = self.config
    params = self.variables["params"]
    names = [f"layers_{i}" for i in range(cfg.num_layers)]
    missing = [n for n in names if n not in params]
    if missing:
      raise ValueError(f"model.scan_layers: params {missing[:3]} missing")
    # Layers use every param as p.astype(dtype) (Linear, RMSNorm, bias), so stacking the
    # compute-dtype copies is the same computation, gradients included, at half the bytes.
    dtype = jnp.dtype(cfg.dtype)
    stacked = jax.tree.map(lambda *xs: jnp.stack([x.astype(dtype) for x in xs]),
                           *(params[n] for n in names))
    layer = DecoderLayer(cfg, _uniform_factory(self.dot_general_factory, names), parent=None)

    def body(x, layer_params):
      return layer.apply({"params": layer_params}, x, rope_BxLxDh, segments), None

    if cfg.remat != "none":
      body = jax.checkpoint(body, policy=POLICIES[cfg.remat])
    x_BxLxD, _ = jax.lax.scan(body, x_BxLxD, stacked)
    return x_BxLxD


def _uniform_factory(factory: DotGeneralFactory, layer_names) -> DotGeneralFactory:
  """A factory for the scanned layer: every layer's projection must get the same one."""
  def uniform(make_one, path, axes=None):
    made = [make_one(f"{name}/{path}", axes) for name in layer_names]
    if any(not _same_op(m, made[0]) for m in made[1:]):
      raise ValueError(
          f"model.scan_layers=True runs one layer body for all layers, but the precision "
          f"differs between layers at '{path}' (per-layer precision.overrides or "
          "telemetry); set model.scan_layers=False")
    return made[0]

  def make(path, axes=None):
    return uniform(factory, path, axes)
  for hook in ("gated_mlp", "fused_qkv"):   # the factory's optional fused ops
    if hasattr(factory, hook):
      setattr(make, hook, functools.partial(uniform, getattr(factory, hook)))
  if hasattr(factory, "attention"):          # FP8 attention: attention(path)
    make.attention = lambda path: uniform(lambda p, _: factory.attention(p), path)
  return make


def _same_op(a, b) -> bool:
  """One op for every layer: the same object, or partials of one function and arguments."""
  if isinstance(a, functools.partial) and isinstance(b, functools.partial):
    return (a.func, a.args, a.keywords) == (b.func, b.args, b.keywords)
  return a is b


def _f32_factory(factory: DotGeneralFactory) -> DotGeneralFactory:
  """Wraps the factory so the untied LM head also returns float32 logits."""
  def make(path, axes=None):
    dot_general = factory(path, axes)
    def f32_dot_general(lhs, rhs, dimension_numbers, precision=None,
                        preferred_element_type=None):
      del preferred_element_type
      return dot_general(lhs, rhs, dimension_numbers, precision=precision,
                         preferred_element_type=jnp.float32)
    return f32_dot_general
  return make
