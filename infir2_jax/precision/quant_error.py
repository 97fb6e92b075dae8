"""Quantization error statistics of one operand: amax, flush-to-zero fraction, SNR (dB)."""

import jax
import jax.numpy as jnp
from jax import lax

from infir2_jax.precision.quantize import QTensor, abs_bits

STAT_NAMES = ("amax", "flush_frac", "snr_db")


def operand_stats(x: jax.Array, xq: "QTensor | jax.Array") -> jax.Array:
  """[amax, flush_frac, snr_db] (float32) of the quantized operand xq against x.

  amax: max |x| (NaN if x has a NaN). flush_frac: the fraction of x's nonzero elements that
  quantize to zero (0 when x has none). snr_db: 10 log10(sum x^2 / sum (x - dq(x))^2),
  +inf when the quantization is exact (including an all-zero x). An operand that is not
  quantized (xq is a plain array) reports flush_frac 0 and snr_db +inf.
  """
  x32 = x.astype(jnp.float32)
  amax = lax.bitcast_convert_type(jnp.max(abs_bits(x32)), jnp.float32)
  if not isinstance(xq, QTensor):
    return jnp.stack([amax, jnp.float32(0), jnp.float32(jnp.inf)])
  nonzero = x32 != 0
  flushed = nonzero & (xq.q.astype(jnp.float32) == 0)
  n_nonzero = jnp.sum(nonzero, dtype=jnp.float32)
  flush_frac = jnp.sum(flushed, dtype=jnp.float32) / jnp.maximum(n_nonzero, 1.0)
  signal = jnp.sum(x32 * x32)
  noise = jnp.sum(jnp.square(x32 - xq.dequantize(jnp.float32)))
  snr_db = jnp.where(noise == 0, jnp.inf, 10.0 * jnp.log10(signal / noise))
  return jnp.stack([amax, flush_frac, snr_db]).astype(jnp.float32)
