"""The Qwen2/Qwen2.5 decoder-only language model (Flax linen)."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from infir2_jax.model.config import ModelConfig
from infir2_jax.precision.dot_general import FP8_GEMM_OUT, FP8_RESIDUALS
from infir2_jax.precision.gemm import target_platform
from infir2_jax.sharding import compute_axes
from infir2_jax.model.layers import (
    MLP, Attention, DotGeneralFactory, Linear, RMSNorm, default_dot_general_factory)

_cp = jax.checkpoint_policies
# The primitive of cuDNN's fused attention forward (jax.nn.dot_product_attention with
# implementation="cudnn"): its outputs are the attention output and the softmax statistics
# that cuDNN's backward kernel takes.
CUDNN_ATTENTION_FWD = "dot_product_attention_fwd_wrapper"


def cudnn_attention_saveable(prim, *_, **__) -> bool:
  """Remat policy: keep cuDNN attention's forward outputs (a custom call, no dot_general).

  Without it every save-dots policy runs the attention forward twice per step, once more in
  the backward pass to rebuild the softmax statistics (counted in the compiled HLO by
  tests/test_remat_attention.py). Costs B x L x H x Dh in the compute dtype per layer."""
  return prim.name == CUDNN_ATTENTION_FWD


def _save_any(*policies):
  """Logical OR of remat policies (JAX's save_from_both_policies, for any number)."""
  return functools.reduce(_cp.save_from_both_policies, policies)


_REMAT_POLICIES = {
    "full": None,  # save nothing: recompute the whole layer in the backward pass
    # matmul outputs, XLA's and our FP8 GEMMs' (a Pallas call is no dot_general), and
    # cuDNN attention's output and softmax statistics
    "save_dots": _save_any(
        _cp.dots_with_no_batch_dims_saveable, _cp.save_only_these_names(FP8_GEMM_OUT),
        cudnn_attention_saveable),
    # ... and the FP8 operands of the backward GEMMs (no re-quantization, more memory)
    "save_dots_fp8": _save_any(
        _cp.dots_with_no_batch_dims_saveable,
        _cp.save_only_these_names(FP8_GEMM_OUT, FP8_RESIDUALS), cudnn_attention_saveable),
}


class DecoderLayer(nn.Module):
  """Pre-norm block: x + attn(norm(x)), then h + mlp(norm(h))."""
  config: ModelConfig
  dot_general_factory: DotGeneralFactory = default_dot_general_factory

  @nn.compact
  def __call__(self, x_BxLxD, positions_BxL, segment_ids_BxL):
    cfg = self.config
    dtype, param_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
    norm = lambda name: RMSNorm(cfg.rms_norm_eps, dtype, param_dtype, name=name)
    implementation = {"xla": None, "cudnn": "cudnn", "auto": None}[cfg.attention]
    if cfg.attention == "auto" and target_platform() == "gpu":
      implementation = "cudnn"
    attn = Attention(cfg.num_heads, cfg.num_kv_heads, cfg.head_size, cfg.rope_theta,
                     cfg.qkv_bias, implementation, dtype, param_dtype, cfg.init_std,
                     self.dot_general_factory, cfg.attention_mask == "document",
                     name="self_attn")
    h = x_BxLxD + attn(norm("input_layernorm")(x_BxLxD), positions_BxL, segment_ids_BxL)
    mlp = MLP(cfg.intermediate_size, dtype, param_dtype, cfg.init_std,
              self.dot_general_factory, name="mlp")
    out = h + mlp(norm("post_attention_layernorm")(h))
    return nn.with_logical_constraint(out, ("batch", "length", "act_embed"))


def tied_head(dot_general, x_BxLxD, table_VxD):
  """Logits [B, L, V] in float32 against the (compute-dtype) embedding table."""
  return dot_general(x_BxLxD, table_VxD, (((x_BxLxD.ndim - 1,), (1,)), ((), ())),
                     precision=None, preferred_element_type=jnp.float32)


class Qwen2(nn.Module):
  """Qwen2 causal LM. `__call__` returns float32 logits [B, L, V].

  Every projection (q, k, v, o, gate, up, down, lm_head) gets its dot_general from
  `dot_general_factory`, the single point where a precision recipe plugs in.
  """
  config: ModelConfig
  dot_general_factory: DotGeneralFactory = default_dot_general_factory

  @nn.compact
  def __call__(self, tokens_BxL, positions_BxL=None, segment_ids_BxL=None,
               return_hidden: bool = False):
    cfg = self.config
    dtype, param_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
    if positions_BxL is None:
      positions_BxL = jnp.broadcast_to(jnp.arange(tokens_BxL.shape[-1]), tokens_BxL.shape)
    if segment_ids_BxL is None:
      segment_ids_BxL = jnp.ones_like(tokens_BxL)

    embed = nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=param_dtype,
                     embedding_init=nn.with_logical_partitioning(
                         nn.initializers.normal(cfg.init_std), ("vocab", "embed")),
                     name="embed_tokens")
    table_VxD = nn.with_logical_constraint(embed.embedding.astype(dtype),
                                           compute_axes(("vocab", "embed")))
    x_BxLxD = jnp.take(table_VxD, tokens_BxL, axis=0)
    x_BxLxD = nn.with_logical_constraint(x_BxLxD, ("batch", "length", "act_embed"))

    if cfg.scan_layers and not self.is_initializing():
      x_BxLxD = self._scanned_layers(x_BxLxD, positions_BxL, segment_ids_BxL)
    else:
      layer_cls = DecoderLayer
      if cfg.remat != "none":
        layer_cls = nn.remat(DecoderLayer, policy=_REMAT_POLICIES[cfg.remat], prevent_cse=True)
      for i in range(cfg.num_layers):
        x_BxLxD = layer_cls(cfg, self.dot_general_factory, name=f"layers_{i}")(
            x_BxLxD, positions_BxL, segment_ids_BxL)
    x_BxLxD = RMSNorm(cfg.rms_norm_eps, dtype, param_dtype, name="norm")(x_BxLxD)
    if return_hidden:
      return x_BxLxD
    # LM head in the compute dtype with a float32 result: softmax and loss need f32.
    if cfg.tie_embeddings:
      return tied_head(self.dot_general_factory("lm_head"), x_BxLxD.astype(dtype), table_VxD)
    head = Linear(cfg.vocab_size, ("embed", "vocab"), False, dtype, param_dtype,
                  cfg.init_std, self._f32_factory(), name="lm_head")
    return head(x_BxLxD)

  def head_logits(self, params, hidden_BxLxD):
    """The LM head alone, from `params` (a pure function, outside apply): float32 logits of
    the final hidden states that `__call__(..., return_hidden=True)` returns. The chunked
    loss calls it per chunk; the same computation as the end of `__call__`."""
    cfg = self.config
    dtype = jnp.dtype(cfg.dtype)
    x_BxLxD = hidden_BxLxD.astype(dtype)
    if cfg.tie_embeddings:
      table_VxD = nn.with_logical_constraint(params["embed_tokens"]["embedding"].astype(dtype),
                                             compute_axes(("vocab", "embed")))
      return tied_head(self.dot_general_factory("lm_head"), x_BxLxD, table_VxD)
    kernel_DxV = nn.with_logical_constraint(params["lm_head"]["kernel"].astype(dtype),
                                            compute_axes(("embed", "vocab")))
    return self._f32_factory()("lm_head")(x_BxLxD, kernel_DxV,
                                          (((x_BxLxD.ndim - 1,), (0,)), ((), ())))

  def _scanned_layers(self, x_BxLxD, positions_BxL, segment_ids_BxL):
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
    layer = DecoderLayer(cfg, self._uniform_factory(names), parent=None)

    def body(x, layer_params):
      return layer.apply({"params": layer_params}, x, positions_BxL, segment_ids_BxL), None

    if cfg.remat != "none":
      body = jax.checkpoint(body, policy=_REMAT_POLICIES[cfg.remat])
    x_BxLxD, _ = jax.lax.scan(body, x_BxLxD, stacked)
    return x_BxLxD

  def _uniform_factory(self, layer_names):
    """A factory for the scanned layer: every layer's projection must get the same one."""
    factory = self.dot_general_factory

    def make(path):
      made = [factory(f"{name}/{path}") for name in layer_names]
      if any(m is not made[0] for m in made[1:]):
        raise ValueError(
            f"model.scan_layers=True runs one layer body for all layers, but the precision "
            f"differs between layers at '{path}' (per-layer precision.overrides or "
            "telemetry); set model.scan_layers=False")
      return made[0]
    return make

  def _f32_factory(self):
    """Wraps the factory so the untied LM head also returns float32 logits."""
    factory = self.dot_general_factory

    def make(path):
      dot_general = factory(path)
      def f32_dot_general(lhs, rhs, dimension_numbers, precision=None,
                          preferred_element_type=None):
        del preferred_element_type
        return dot_general(lhs, rhs, dimension_numbers, precision=precision,
                           preferred_element_type=jnp.float32)
      return f32_dot_general
    return make
