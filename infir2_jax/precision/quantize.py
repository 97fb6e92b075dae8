"""Tile-wise FP8 quantization with current (just-in-time) scaling, and its inverse.

Semantics (the project's FP8 contract; infir2_jax.precision.kernels matches it bit for bit):
for every tile over the last two dims of x (leading dims are independent),
  x     = f32(x), with float32 subnormals (|x| < 2**-126) flushed to a signed zero
  amax  = max |x| over the tile
  s     = max(amax * RN32(1 / fmax), 2**-126)      (f32 multiply)
  scale = s ("fp32") or min(2**ceil(log2(s)), cap) ("ue8m0", exact, from the exponent bits;
          cap = 2**119 E4M3, 2**112 E5M2, so that fmax * scale is finite)
  inv   = RN32(1 / scale)                          (exact, once per tile; see below)
  q     = fp8(clip(x * inv, -fmax, fmax))          (f32 multiply, round to nearest even)
  dequantize(q) = f32(q) * scale, then cast.
For "ue8m0" this is bit-identical to the division form of the common contract (amax / fmax
and x / scale): inv is an exact power of two, and the power-of-two rounding of the scale
agrees (checked exhaustively). For "fp32" it is the reciprocal form on purpose: XLA's
algebraic simplifier turns x / broadcast(s) into x * broadcast(1 / s) on CPU and GPU, so
the IEEE-division form is not what XLA runs; the Pallas kernels must use this form too.
And inv is computed with formats.reciprocal_exact (integer long division), not 1 / scale:
XLA:GPU's f32 division is not correctly rounded, which flipped fp8 roundings on an H200
(for "ue8m0", formats.reciprocal_pow2: the same exact numbers from the exponent bits).

Decisions:
- Padding: a tile at the bottom/right edge holds only the real elements (the zero pad used
  to reshape never raises amax and is sliced off). q has x's shape; scale has shape
  (*lead, ceil(R / tr), ceil(C / tc)), or () per tensor (tile None).
- Floor: scales are at least 2**-126, so all-zero tiles give q = 0 and dequantize to 0.
- Overflow: a finite input never dequantizes to inf. UE8M0 scales stop at the cap above
  (at 2**120 an E4M3 x >= 3.2964854e38 rounded to q = 256 and 256 * 2**120 overflowed f32),
  so tiles with amax > fmax * cap (2.98e38 in both formats) saturate at +-fmax * cap.
  FP32 scales need no cap: fmax * s stays finite for every finite amax.
- NaN in a tile makes its scale NaN (so the whole tile dequantizes to NaN); +-inf makes the
  scale inf and the tile dequantizes to NaN (inf / inf = NaN, 0 * inf = NaN). Never finite.
- amax is computed on the integer bits of |x| (exact; NaN sorts above inf).
- q leaves through an optimization barrier, so XLA cannot fold the f32 -> fp8 -> f32 round
  trip of a later dequantize away (XLA:GPU does, by default).
- Subnormal inputs are flushed to zero first. XLA:CPU already treats them as zero (DAZ) and
  GPUs may not, so flushing explicitly makes every backend agree. They are below 1.2e-38:
  no bf16 activation or gradient of a trained model lives there.
- Tile entries may be -1 ("the whole axis", e.g. (1, -1) is one scale per row); entries
  larger than the axis act like the whole axis.
"""

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from infir2_jax.precision import formats
from infir2_jax.precision.formats import abs_bits  # quant_error.py imports it from here

Tile = tuple[int, int] | None


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


def resolve_tile(tile: Tile, shape: tuple[int, ...]) -> Tile:
  """Concrete tile over shape's last two dims: -1 and oversize entries become the dim."""
  if tile is None:
    return None
  if (not isinstance(tile, (tuple, list)) or len(tile) != 2
      or not all(isinstance(t, int) and (t > 0 or t == -1) for t in tile)):
    raise ValueError(f"tile={tile!r}: must be None (per tensor) or two positive ints over the "
                     "last two dims, -1 meaning the whole axis, e.g. (1, 128), (128, 128), (1, -1)")
  if len(shape) < 2:
    raise ValueError(f"tile={tile} needs an array of rank >= 2, got shape {shape}; "
                     "use tile=None for per-tensor scaling")
  rows, cols = shape[-2:]
  return tuple(max(1, d if t == -1 else min(t, d)) for t, d in zip(tile, (rows, cols)))


def scale_shape(shape: tuple[int, ...], tile: Tile) -> tuple[int, ...]:
  """Shape of the scale array of an x of `shape` quantized with `tile`."""
  tile = resolve_tile(tile, shape)
  if tile is None:
    return ()
  return (*shape[:-2], _cdiv(shape[-2], tile[0]), _cdiv(shape[-1], tile[1]))


def expand_scale(scale: jax.Array, tile: Tile, shape: tuple[int, ...]) -> jax.Array:
  """Broadcasts a tile-grid scale to the element grid of `shape` (a fusible broadcast)."""
  tile = resolve_tile(tile, shape)
  if tile is None:
    return scale
  expected = scale_shape(shape, tile)
  if scale.shape != expected:
    raise ValueError(f"scale.shape={scale.shape} does not match x shape {shape} with tile "
                     f"{tile}: expected {expected}")
  *lead, rt, ct = scale.shape
  (tr, tc), n = tile, len(lead)
  s = lax.broadcast_in_dim(scale, (*lead, rt, tr, ct, tc), (*range(n), n, n + 2))
  s = s.reshape(*lead, rt * tr, ct * tc)
  if (rt * tr, ct * tc) != tuple(shape[-2:]):
    s = s[..., :shape[-2], :shape[-1]]
  return s


def _tile_amax(x32: jax.Array, tile: Tile) -> jax.Array:
  """max |x| per tile by zero-pad + reshape + reduce, NaN if the tile holds a NaN.

  The max runs on the integer bits: XLA:CPU's vectorized float max drops NaNs (measured on
  jax 0.11.2), and integer max is exact and NaN-propagating by construction.
  """
  a = abs_bits(x32)
  if tile is None:
    return lax.bitcast_convert_type(jnp.max(a), jnp.float32)
  *lead, rows, cols = x32.shape
  (tr, tc) = tile
  rt, ct = _cdiv(rows, tr), _cdiv(cols, tc)
  if (rt * tr, ct * tc) != (rows, cols):
    a = jnp.pad(a, [(0, 0)] * len(lead) + [(0, rt * tr - rows), (0, ct * tc - cols)])
  amax = jnp.max(a.reshape(*lead, rt, tr, ct, tc), axis=(-3, -1))
  return lax.bitcast_convert_type(amax, jnp.float32)


def quantize(x: jax.Array, tile: Tile, fmt: str = "e4m3", scale_format: str = "ue8m0"):
  """Quantizes x to FP8 with one current scale per tile of its last two dims.

  Args:
    x: float array (bf16/f16/f32), rank >= 2 unless tile is None.
    tile: (rows, cols) over the last two dims: (1, 128) token tiles, (128, 128) blocks,
      (1, -1) or (1, K) per row, None per tensor.
    fmt: "e4m3" | "e5m2".
    scale_format: "ue8m0" (power of two) | "fp32".

  Returns:
    (q, scale): q has x's shape and the FP8 dtype; scale is float32 with shape
    scale_shape(x.shape, tile).
  """
  f = formats.get_format(fmt)
  formats.check_scale_format(scale_format)
  tile = resolve_tile(tile, x.shape)
  x32 = formats.flush_subnormals(jnp.asarray(x, jnp.float32))
  scale = formats.scale_from_amax(_tile_amax(x32, tile), fmt, scale_format)
  # Barrier: left fusible, XLA inlines the 24-step reciprocal into every element's
  # expression and compiles for minutes; it belongs on the small scale grid anyway. A UE8M0
  # scale's reciprocal is exact from its exponent bits (the same numbers, far fewer ops).
  reciprocal = formats.reciprocal_pow2 if scale_format == "ue8m0" else formats.reciprocal_exact
  inv = lax.optimization_barrier(reciprocal(scale))
  y = x32 * expand_scale(inv, tile, x.shape)
  fmax = jnp.float32(f.max)
  # clip as selects: NaN passes through whatever a backend's min/max do with NaN.
  y = jnp.where(y > fmax, fmax, jnp.where(y < -fmax, -fmax, y))
  # The barrier keeps q a real FP8 array: XLA:GPU (xla_allow_excess_precision, on by default)
  # folds convert(convert(y, f8), f32) into y, which silently un-quantizes every dequantize,
  # telemetry statistic and dequantized GEMM downstream (measured on an H200).
  q = lax.optimization_barrier(y.astype(f.dtype))
  return q, scale


def dequantize(q: jax.Array, scale: jax.Array, tile: Tile, dtype=jnp.bfloat16) -> jax.Array:
  """f32(q) * scale per tile, cast to dtype (exact in bf16 for power-of-two scales)."""
  x32 = q.astype(jnp.float32) * expand_scale(scale, resolve_tile(tile, q.shape), q.shape)
  return x32.astype(dtype)


@dataclasses.dataclass(frozen=True)
class QTensor:
  """A quantized operand: q, its scale grid, and (static) how it was made.

  `tile` is the resolved tile (concrete ints, or None per tensor), so transposing a 2-D
  QTensor is exact: q.T, scale.T and the tile reversed describe the same numbers.
  """
  q: jax.Array
  scale: jax.Array
  tile: Tile = dataclasses.field(metadata=dict(static=True))
  scale_format: str = dataclasses.field(metadata=dict(static=True))

  @property
  def shape(self) -> tuple[int, ...]:
    return self.q.shape

  @property
  def fmt(self) -> str:
    return "e4m3" if self.q.dtype == formats.FORMATS["e4m3"].dtype else "e5m2"

  def dequantize(self, dtype=jnp.bfloat16) -> jax.Array:
    return dequantize(self.q, self.scale, self.tile, dtype)

  def transpose(self) -> "QTensor":
    if self.q.ndim != 2:
      raise ValueError(f"QTensor.transpose needs a 2-D operand, got shape {self.q.shape}")
    tile = None if self.tile is None else self.tile[::-1]
    scale = self.scale if self.tile is None else self.scale.T
    return QTensor(self.q.T, scale, tile, self.scale_format)


jax.tree_util.register_dataclass(QTensor, data_fields=["q", "scale"],
                                 meta_fields=["tile", "scale_format"])


def quantize_tensor(x: jax.Array, tile: Tile, fmt: str = "e4m3",
                    scale_format: str = "ue8m0") -> QTensor:
  """quantize() packaged as a QTensor."""
  q, scale = quantize(x, tile, fmt, scale_format)
  return QTensor(q, scale, resolve_tile(tile, x.shape), scale_format)
