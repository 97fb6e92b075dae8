"""FP8 element formats and scale formats, and the rules every quantizer shares.

The one owner of: the element formats (dtype, max), the scale formats, the 2**-126 scale
floor, abs_bits, the subnormal flush and scale_from_amax. precision/quantize.py (XLA) and
precision/kernels/quantize.py (Mosaic GPU) both call these, so the two agree bit for bit.
What the kernels call (abs_bits, flush_subnormals, scale_from_amax) is written in ops that
lower in Mosaic GPU: int32 bit ops, selects and numpy scalar constants (no jnp.ceil).
"""

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

# Smallest normal float32, 2**-126. It floors every scale (an all-zero tile gets a finite
# scale, so q = 0 and dequantize gives an exact 0 instead of 0/0 = NaN) and it is the flush
# threshold for subnormal inputs (flush_subnormals).
SCALE_FLOOR = float(np.finfo(np.float32).tiny)
SCALE_FLOOR_BITS = 0x00800000  # its float32 bits


@dataclasses.dataclass(frozen=True)
class Format:
  """An FP8 element format.

  Attributes:
    name: "e4m3" or "e5m2".
    dtype: the jnp dtype (float8_e4m3fn has no inf, max 448; float8_e5m2 max 57344).
    max: largest finite magnitude.
  """
  name: str
  dtype: jnp.dtype
  max: float

  @property
  def max_pow2_scale(self) -> float:
    """The largest power of two s with max * s finite in float32 (and bf16): 2**119 for
    E4M3, 2**112 for E5M2. UE8M0 scales stop here, so a finite input never dequantizes to
    inf: at 2**120 an E4M3 x >= 248 * 2**120 (3.2964854e38) rounds to q = 256 and
    256 * 2**120 = 2**128 overflows."""
    return float(2.0 ** np.floor(np.log2(np.finfo(np.float32).max / self.max)))


FORMATS = {
    "e4m3": Format("e4m3", jnp.dtype(jnp.float8_e4m3fn), 448.0),
    "e5m2": Format("e5m2", jnp.dtype(jnp.float8_e5m2), 57344.0),
}

# "ue8m0": scale = 2**ceil(log2(amax / fmax)) (an 8-bit exponent, as DeepSeek-V3 / InfiR2);
# "fp32": scale = amax / fmax, an ordinary float32.
SCALE_FORMATS = ("ue8m0", "fp32")


def get_format(name: str) -> Format:
  """Returns the Format called `name` ("e4m3" | "e5m2")."""
  if name not in FORMATS:
    raise ValueError(f"unknown FP8 format {name!r}; valid: {sorted(FORMATS)}")
  return FORMATS[name]


def check_scale_format(scale_format: str) -> str:
  if scale_format not in SCALE_FORMATS:
    raise ValueError(f"unknown scale format {scale_format!r}; valid: {list(SCALE_FORMATS)}")
  return scale_format


def is_fp8_dtype(dtype) -> bool:
  return jnp.dtype(dtype) in (FORMATS["e4m3"].dtype, FORMATS["e5m2"].dtype)


def abs_bits(x32: jax.Array) -> jax.Array:
  """|x| as int32 bits: ordered like |x|, with every NaN above +inf.

  A max over these is exact and NaN-propagating on every backend (XLA:CPU's vectorized float
  max drops NaNs, measured on jax 0.11.2).
  """
  return lax.bitcast_convert_type(x32, jnp.int32) & 0x7FFFFFFF


def flush_subnormals(x32: jax.Array) -> jax.Array:
  """float32 subnormals (|x| < 2**-126) to a signed zero; everything else unchanged.

  XLA:CPU already treats subnormals as zero (DAZ) and GPUs may not, so flushing explicitly
  makes every backend agree. The compare is on the bits, so DAZ cannot change it; x * 0 keeps
  the sign of zero, and NaN / inf (bits above the floor's) pass through.
  """
  return jnp.where(abs_bits(x32) < SCALE_FLOOR_BITS, x32 * 0.0, x32)


def round_up_pow2(s: jax.Array) -> jax.Array:
  """2**ceil(log2(s)) for positive normal float32 s, exactly, from the bits.

  Bumps the exponent field when the mantissa is non-zero (2**-126 for a positive subnormal,
  0 for 0). NaN and inf (exponent field all ones) are returned as they are: bumping NaN's
  would overflow into the sign bit. int32 ops, a select on the exponent field: this lowers in
  Mosaic GPU (jnp.ceil does not; and ceil / log2 are not exact).
  """
  bits = lax.bitcast_convert_type(s, jnp.int32)
  exponent = lax.shift_right_logical(bits, 23) & 0xFF
  bumped = exponent + ((bits & 0x7FFFFF) != 0).astype(jnp.int32)
  pow2 = lax.bitcast_convert_type(lax.shift_left(bumped, 23), jnp.float32)
  return jnp.where(exponent == 0xFF, s, pow2)


def reciprocal_exact(s: jax.Array) -> jax.Array:
  """1 / s correctly rounded (RN) for float32 scales in [2**-126, 2**126), with no division.

  XLA:GPU's f32 division is not correctly rounded (measured on H200: 13% of 1/s off by
  one ulp), which would make fp32-scale quantization differ between backends. So the
  mantissa of 1/s is computed by integer long division: q = RN(2**47 / m) for the 24-bit
  significand m of s (24 shift-compare-subtract steps on uint32, on the small scale grid).
  Powers of two (every UE8M0 scale) come out exact. NaN -> NaN, +inf -> 0.
  """
  bits = lax.bitcast_convert_type(s.astype(jnp.float32), jnp.uint32)
  exponent = (bits >> 23) & 0xFF
  m = (bits & 0x7FFFFF) | 0x800000                   # significand in [2**23, 2**24)
  rem = jnp.full_like(m, 1 << 23)                    # 2**47 / m = (2**23 * 2**24) / m
  q = jnp.zeros_like(m)
  for _ in range(24):
    rem = rem << 1
    bit = (rem >= m).astype(jnp.uint32)
    rem = rem - bit * m
    q = (q << 1) | bit
  q = q + ((rem << 1) > m).astype(jnp.uint32)        # round to nearest (ties impossible)
  pow2 = (bits & 0x7FFFFF) == 0
  # 1/s = 2**(127 - E) for a power of two; else 2**(126 - E) * q / 2**23 (q in (2**23, 2**24)).
  out_bits = jnp.where(pow2, (254 - exponent) << 23,
                       ((253 - exponent) << 23) | (q & 0x7FFFFF))
  r = lax.bitcast_convert_type(out_bits.astype(jnp.uint32), jnp.float32)
  r = jnp.where(jnp.isinf(s), jnp.float32(0), r)
  return jnp.where(jnp.isnan(s), s, r)


def reciprocal_pow2(s: jax.Array) -> jax.Array:
  """1 / s for a power-of-two float32 s (every UE8M0 scale), exactly, from the exponent bits.

  Equal to reciprocal_exact on every power of two in [2**-126, 2**126] (1/s = 2**(127 - E)
  has the biased exponent 254 - E), NaN -> NaN, +inf -> 0, in a handful of int32 ops where
  reciprocal_exact unrolls 24 long-division steps: the XLA path's quantizers trace and
  compile 2-3x faster with it. Not for other values (the mantissa is ignored).
  """
  bits = lax.bitcast_convert_type(s.astype(jnp.float32), jnp.uint32)
  r = lax.bitcast_convert_type((254 - ((bits >> 23) & 0xFF)) << 23, jnp.float32)
  r = jnp.where(jnp.isinf(s), jnp.float32(0), r)
  return jnp.where(jnp.isnan(s), s, r)


def scale_from_amax(amax: jax.Array, fmt: str, scale_format: str) -> jax.Array:
  """The float32 scale of a tile with max |x| = amax (float32): the shared semantics.

  s = max(amax * RN32(1 / fmax), 2**-126), and for "ue8m0" min(round_up_pow2(s), cap) with
  cap = Format.max_pow2_scale (2**119 E4M3, 2**112 E5M2): tiles with amax > fmax * cap
  (2.98e38 in both formats) saturate at +-fmax * cap instead of dequantizing to inf. NaN
  and inf amax give a NaN / inf scale.
  """
  # amax * RN32(1 / fmax), a multiply: XLA rewrites division by a (broadcast) scalar into
  # exactly this anyway, so we write it down to make every backend agree. For "ue8m0" the
  # power-of-two result equals that of the IEEE division amax / fmax for every f32 amax
  # (checked exhaustively over a binade in tests/test_precision_quantize.py).
  s = amax * np.float32(1.0 / get_format(fmt).max)
  floor = np.float32(SCALE_FLOOR)
  s = jnp.where(s < floor, floor, s)                  # a select, so NaN passes on any backend
  if check_scale_format(scale_format) == "ue8m0":
    s = _cap_scale(round_up_pow2(s), get_format(fmt).max_pow2_scale)
  return s


def _cap_scale(s: jax.Array, cap: float) -> jax.Array:
  """min(s, cap) for positive finite s; inf and NaN pass (an int32 compare and a select)."""
  bits = lax.bitcast_convert_type(s, jnp.int32)
  cap_bits = int(np.float32(cap).view(np.int32))
  over = (bits > cap_bits) & (bits < 0x7F800000)      # +inf is 0x7F800000; NaN above it
  return jnp.where(over, np.float32(cap), s)
