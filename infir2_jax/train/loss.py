"""Token-level cross-entropy in float32, returned as sums so micro-batches add up exactly."""

import functools
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from infir2_jax.precision import gemm
from infir2_jax.precision.cotangents import cotangent_is_buffer


# How the loss takes log-sum-exp over the vocabulary: "one_pass" reads the float32 logits
# once, the max and the sum of exponentials carried together in one variadic reduction;
# "two_pass" is jax.nn.logsumexp (a max pass, then a sum pass); "auto" (default) is one_pass
# where the program is lowered for a CUDA GPU and two_pass elsewhere (XLA:CPU runs the
# variadic reduction element by element: in one noisy A/B the default CPU step took 244 ms
# against 209).
# INFIR2_LOGSUMEXP, for A/B runs.
LOGSUMEXP = os.environ.get("INFIR2_LOGSUMEXP", "auto")
LOGSUMEXPS = ("auto", "one_pass", "two_pass")


def logsumexp(x: jax.Array) -> jax.Array:
  """log(sum(exp(x))) over the last axis of float32 x, without overflow (LOGSUMEXP). Its
  derivative is the softmax exp(x - lse) in every form, as the fused loss's own."""
  if LOGSUMEXP not in LOGSUMEXPS:
    raise ValueError(f"INFIR2_LOGSUMEXP={LOGSUMEXP!r}: one of {LOGSUMEXPS}")
  return _logsumexp(LOGSUMEXP, x)


def _two_pass(x):
  return jax.nn.logsumexp(x, axis=-1)


def _max_and_sum(a, b):
  """Merges two (max m, sum of exp(x - m)) pairs: each sum rescaled to the larger max (a
  factor of exactly 1 where its max is the larger: no -inf - -inf)."""
  (m1, s1), (m2, s2) = a, b
  m = jnp.maximum(m1, m2)
  rescale = lambda mi, si: si * jnp.where(mi == m, 1.0, jnp.exp(mi - m))
  return m, rescale(m1, s1) + rescale(m2, s2)


def _one_pass(x):
  """One variadic reduction over the last axis: each element enters as (x, 1) and pairs merge
  by _max_and_sum (the online softmax's running max and sum), so the logits [tokens, V] are
  read once where the max-then-sum form reads them twice (0.8 ms a pass for a 1.5B chunk of
  4,096 tokens on the H100)."""
  m, s = jax.lax.reduce((x, jnp.ones_like(x)), (np.float32(-np.inf), np.float32(0)),
                        _max_and_sum, (x.ndim - 1,))
  return m + jnp.log(s)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _logsumexp(form: str, x: jax.Array) -> jax.Array:
  if form == "auto":
    return jax.lax.platform_dependent(x, cuda=_one_pass, default=_two_pass)
  return _one_pass(x) if form == "one_pass" else _two_pass(x)


@_logsumexp.defjvp
def _logsumexp_jvp(form, primals, tangents):
  (x,), (t,) = primals, tangents
  out = _logsumexp(form, x)
  return out, jnp.sum(jnp.exp(x - out[..., None]) * t, axis=-1)


def cross_entropy_sums(logits_BxLxV: jax.Array, targets_BxL: jax.Array,
                       weights_BxL: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(sum of weighted token losses, sum of weights). Per-token mean = first / second.

  Logits are upcast to float32 before the log-softmax (they usually already are).
  """
  logits = logits_BxLxV.astype(jnp.float32)
  log_z_BxL = logsumexp(logits)
  target_logit_BxL = jnp.take_along_axis(logits, targets_BxL[..., None], axis=-1)[..., 0]
  weights = weights_BxL.astype(jnp.float32)
  return jnp.sum((log_z_BxL - target_logit_BxL) * weights), jnp.sum(weights)


def _check_chunk(targets_BxL: jax.Array, chunk: int):
  length = targets_BxL.shape[-1]
  if length % chunk:
    raise ValueError(f"model.loss_chunk={chunk} must divide the sequence length {length}")


def _split_chunks(x_BxL: jax.Array, chunk: int) -> jax.Array:
  """[B, L, ...] -> [L / chunk, B, chunk, ...]: the chunks to scan over."""
  rows, length = x_BxL.shape[:2]
  return jnp.moveaxis(x_BxL.reshape(rows, length // chunk, chunk, *x_BxL.shape[2:]), 1, 0)


def chunked_cross_entropy_sums(logits_fn: Callable[[jax.Array], jax.Array],
                               hidden_BxLxD: jax.Array, targets_BxL: jax.Array,
                               weights_BxL: jax.Array, chunk: int):
  """cross_entropy_sums(logits_fn(hidden), ...) over chunks of `chunk` positions per row.

  A rematerialized scan: one chunk's logits [B, chunk, V] are live at a time, in the
  backward pass too (recomputed there), instead of the whole [B, L, V] in float32.
  """
  _check_chunk(targets_BxL, chunk)
  split = functools.partial(_split_chunks, chunk=chunk)

  @jax.checkpoint
  def body(sums, chunk_inputs):
    hidden, targets, weights = chunk_inputs
    loss, count = cross_entropy_sums(logits_fn(hidden), targets, weights)
    return (sums[0] + loss, sums[1] + count), None

  zero = jnp.zeros((), jnp.float32)
  sums, _ = jax.lax.scan(body, (zero, zero),
                         (split(hidden_BxLxD), split(targets_BxL), split(weights_BxL)))
  return sums


def fused_head_cross_entropy_sums(hidden_BxLxD: jax.Array, weight: jax.Array,
                                  targets_BxL: jax.Array, weights_BxL: jax.Array, chunk: int,
                                  vocab_axis: int) -> tuple[jax.Array, jax.Array]:
  """cross_entropy_sums of the BF16 LM head's float32 logits, a chunk of `chunk` positions
  per row at a time, with each chunk's gradient made in the forward pass (model.loss_fused).

  The LM head and the loss are one custom derivative (Liger-Kernel's fused linear
  cross-entropy, in XLA ops): the forward scan computes a chunk's logits, its log-sum-exp
  and loss, and at once the gradient of the summed loss with respect to them,
  (softmax - onehot(target)) x weight, rounded to the operands' dtype (the bf16-cotangent
  rule of precision/gemm.py's head), and from it the chunk's hidden-state gradient and its
  share of the head weight's gradient (summed over chunks in float32, rounded once). No
  [B, L, V] float32 logits exist, and unlike chunked_cross_entropy_sums no LM-head GEMM is
  recomputed in the backward pass: it scales the saved gradients by the loss's cotangent.

  weight: the head in the compute dtype, [V, D] (vocab_axis=0: the tied embedding table) or
  [D, V] (vocab_axis=1: an untied kernel). The count (second output) has no gradient.
  """
  _check_chunk(targets_BxL, chunk)
  dtypes = (jnp.dtype(hidden_BxLxD.dtype), jnp.dtype(weight.dtype))
  return _fused_head_ce(hidden_BxLxD, weight, targets_BxL, weights_BxL, chunk, vocab_axis,
                        dtypes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _fused_head_ce(hidden, weight, targets, weights, chunk, vocab_axis, dtypes):
  """Not differentiated (evaluation): the chunks' loss alone, no gradients made."""
  del dtypes
  logits_dims = (((2,), (1 - vocab_axis,)), ((), ()))
  head = lambda h: gemm.bf16_dot_general(h, weight, logits_dims,
                                         preferred_element_type=jnp.float32)
  return chunked_cross_entropy_sums(head, hidden, targets, weights, chunk)


def _fused_head_ce_fwd(hidden, weight, targets, weights, chunk, vocab_axis, dtypes):
  del dtypes
  d_axis = 1 - vocab_axis
  split = functools.partial(_split_chunks, chunk=chunk)
  # [B, C, D] x weight -> [B, C, V]; [B, C, V] x weight -> [B, C, D]; over the chunk's tokens:
  # [B, C, V] x [B, C, D] -> [V, D] (tied) or [B, C, D] x [B, C, V] -> [D, V] (untied).
  logits_dims = (((2,), (d_axis,)), ((), ()))
  dgrad_dims = (((2,), (vocab_axis,)), ((), ()))
  wgrad_dims = (((0, 1), (0, 1)), ((), ()))

  def body(carry, chunk_inputs):
    loss, count, dweight = carry
    h, t, m = chunk_inputs
    logits = gemm.bf16_dot_general(h, weight, logits_dims, preferred_element_type=jnp.float32)
    log_z = logsumexp(logits)
    target_logit = jnp.take_along_axis(logits, t[..., None], axis=-1)[..., 0]
    m = m.astype(jnp.float32)
    loss, count = loss + jnp.sum((log_z - target_logit) * m), count + jnp.sum(m)
    onehot = jax.nn.one_hot(t, logits.shape[-1], dtype=jnp.float32)
    dlogits = ((jnp.exp(logits - log_z[..., None]) - onehot) * m[..., None]).astype(h.dtype)
    dh = gemm.bf16_dot_general(dlogits, weight, dgrad_dims,
                               preferred_element_type=jnp.float32)
    pair = (dlogits, h) if vocab_axis == 0 else (h, dlogits)
    dweight = dweight + gemm.bf16_dot_general(*pair, wgrad_dims,
                                              preferred_element_type=jnp.float32)
    return (loss, count, dweight), dh

  zero = jnp.zeros((), jnp.float32)
  init = (zero, zero, jnp.zeros(weight.shape, jnp.float32))
  (loss, count, dweight), dh_chunks = jax.lax.scan(
      body, init, (split(hidden), split(targets), split(weights)))
  dh = jnp.moveaxis(dh_chunks, 0, 1).reshape(hidden.shape)
  return (loss, count), (dh, dweight, targets, weights)


@cotangent_is_buffer
def _fused_head_ce_bwd(chunk, vocab_axis, dtypes, residuals, cotangents):
  """The saved float32 gradients times the loss sum's cotangent (1 under jax.grad of the
  sum, as the train step takes it), rounded once to the inputs' dtypes, as the BF16 head's
  GEMMs round their outputs. The token count has no gradient. Marked cotangent_is_buffer:
  an untied head's gradient then stays in bf16 to the optimizer (train/grads.py), with no
  float32 copy of it ([D, V]: 2 GiB at 7B) live at the step's peak."""
  del chunk, vocab_axis
  dh, dweight, targets, weights = residuals
  h_dtype, w_dtype = dtypes
  g = cotangents[0]
  return ((dh * g).astype(h_dtype), (dweight * g).astype(w_dtype),
          np.zeros(targets.shape, jax.dtypes.float0), jnp.zeros_like(weights))


_fused_head_ce.defvjp(_fused_head_ce_fwd, _fused_head_ce_bwd)
