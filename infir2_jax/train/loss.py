"""Token-level cross-entropy in float32, returned as sums so micro-batches add up exactly."""

from collections.abc import Callable

import jax
import jax.numpy as jnp


def cross_entropy_sums(logits_BxLxV: jax.Array, targets_BxL: jax.Array,
                       weights_BxL: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(sum of weighted token losses, sum of weights). Per-token mean = first / second.

  Logits are upcast to float32 before the log-softmax (they usually already are).
  """
  logits = logits_BxLxV.astype(jnp.float32)
  log_z_BxL = jax.nn.logsumexp(logits, axis=-1)
  target_logit_BxL = jnp.take_along_axis(logits, targets_BxL[..., None], axis=-1)[..., 0]
  weights = weights_BxL.astype(jnp.float32)
  return jnp.sum((log_z_BxL - target_logit_BxL) * weights), jnp.sum(weights)


def chunked_cross_entropy_sums(logits_fn: Callable[[jax.Array], jax.Array],
                               hidden_BxLxD: jax.Array, targets_BxL: jax.Array,
                               weights_BxL: jax.Array, chunk: int):
  """cross_entropy_sums(logits_fn(hidden), ...) over chunks of `chunk` positions per row.

  A rematerialized scan: one chunk's logits [B, chunk, V] are live at a time, in the
  backward pass too (recomputed there), instead of the whole [B, L, V] in float32.
  """
  rows, length = targets_BxL.shape
  if length % chunk:
    raise ValueError(f"model.loss_chunk={chunk} must divide the sequence length {length}")
  split = lambda x: jnp.moveaxis(x.reshape(rows, length // chunk, chunk, *x.shape[2:]), 1, 0)

  @jax.checkpoint
  def body(sums, chunk_inputs):
    hidden, targets, weights = chunk_inputs
    loss, count = cross_entropy_sums(logits_fn(hidden), targets, weights)
    return (sums[0] + loss, sums[1] + count), None

  zero = jnp.zeros((), jnp.float32)
  sums, _ = jax.lax.scan(body, (zero, zero),
                         (split(hidden_BxLxD), split(targets_BxL), split(weights_BxL)))
  return sums
