"""Token-level cross-entropy in float32, returned as sums so micro-batches add up exactly."""

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
