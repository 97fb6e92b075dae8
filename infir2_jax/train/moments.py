"""Adam with its two moments stored in bf16 or FP8; the update itself is computed in float32.

`scale_by_adam_stored(b1, b2, eps, moments)` is optax.scale_by_adam with a codec between
steps: each step decodes the stored moments to float32, updates them and computes Adam's
direction exactly as optax does (same functions, same order), and only what is carried to
the next step is rounded. Codecs (`opt.moments`, train/optim.py):

  bf16  both moments rounded to bfloat16 (nearest even): 4 bytes per parameter, not 8.
  fp8   both moments in E4M3 with COAT's dynamic range expansion (arXiv 2410.19313), one
        group per 128 consecutive elements of the last axis: 2.125 bytes per parameter.

FP8 encoding of a float32 moment x, per group G (128 elements along the last axis):
  a     = max |x| over G                        (the group's scale, float32, stored)
  k     = min(log2(R) / log2(a / min{|x| > 0 in G}), K_MAX), R = 448 / 2**-6, E4M3's normal
          range: the exponent that stretches the group's range onto the format's (stored)
  z     = sign(x) (|x| / a)**k                  in [-1, 1], max |z| = 1
  q     = e4m3(448 z)                           rounded to nearest even (stored)
  x'    = sign(q) a |q / 448|**(1 / k)
q is what precision/quantize.py's quantize(z, (1, 128), "e4m3", "fp32") computes, whose scale
would be RN32(1 / 448) in every group that is not all zero (z is normalized): the cast is
written out, without the quantizer's per-tensor scale machinery (its exact reciprocal alone
is ~150 HLO ops per moment, and the 7B has 339 tensors: minutes of compile).
Subnormal float32 inputs are flushed first, as the quantizer does (formats.flush_subnormals).
A group whose values span less than E4M3's range gets k > 1 (more relative precision than
plain E4M3), one that spans more gets k < 1 (nothing flushes to zero). Why both moments and
not E5M2 or sqrt(v): replaying 100 steps of the default model's real gradients through each
storage (per-128-group scales), the relative error of Adam's direction against float32
moments was 5.8% with both moments expanded, 9.8% with a plain E4M3 first moment, 14.5% with
sqrt(v) in E4M3 or v in E5M2, and plain E4M3 v flushed small second moments to zero (single
steps off by hundreds); tests/test_optim_moments.py checks the ranking on a smaller model.

The state keeps the params' tree structure: every stored part (q, a, k) is a tree shaped
like the params, so optax.tree_map_params (parallel/state.py) shards the moments like their
params; a and k have the params' rank with the last axis divided by 128.
"""

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from infir2_jax.precision import formats

MOMENT_DTYPES = ("fp32", "bf16", "fp8")   # valid values of opt.moments
GROUP = 128                               # FP8: elements per group along the last axis
K_MAX = 16.0                              # FP8: largest expansion exponent (near-flat groups)
_E4M3 = formats.get_format("e4m3")
_LOG2_RANGE = float(np.log2(_E4M3.max / 2.0**-6))   # log2 of E4M3's normal range, ~14.8
_Z_SCALE = np.float32(1.0 / _E4M3.max)   # q -> z


class MathOps(NamedTuple):
  """The float32 functions the codec and Adam's direction are written with. PRECISE (jnp's,
  compiled by XLA) is the reference everywhere; train/fp8_adam.py's Triton kernel passes the
  GPU's approximate instructions instead (fp8_adam.FAST_PTX): the same formulas, ~2 ulp per
  function, which the 3-bit mantissa of what is stored cannot see."""
  log2: Callable[[jax.Array], jax.Array]
  exp2: Callable[[jax.Array], jax.Array]
  div: Callable[[jax.Array, jax.Array], jax.Array]
  sqrt: Callable[[jax.Array], jax.Array]


PRECISE = MathOps(jnp.log2, jnp.exp2, jnp.divide, jnp.sqrt)


@dataclasses.dataclass(frozen=True)
class Codec:
  """How a float32 moment is stored: encode(x) -> parts, decode(parts, shape) -> float32.

  Every part is an array; part i of every param forms one tree shaped like the params.
  """
  name: str
  parts: int               # arrays per stored moment
  encode: Callable[[jax.Array], tuple[jax.Array, ...]]
  decode: Callable[[tuple[jax.Array, ...], tuple[int, ...]], jax.Array]
  zeros: Callable[[tuple[int, ...]], tuple[jax.Array, ...]]   # encode(zeros(shape)), cheaply


def group_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
  """Shape of the per-group arrays (a, k) of an FP8 moment of `shape`."""
  if not shape:
    return ()
  return (*shape[:-1], -(-shape[-1] // GROUP))


def _grouped(x: jax.Array) -> jax.Array:
  """(..., C) -> (..., ceil(C / GROUP), GROUP), zero-padded (zeros change no group's range)."""
  x = x.reshape(1) if x.ndim == 0 else x
  cols = x.shape[-1]
  groups = -(-cols // GROUP)
  if groups * GROUP != cols:
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, groups * GROUP - cols)])
  return x.reshape(*x.shape[:-1], groups, GROUP)


def _ungrouped(xg: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  cols = shape[-1] if shape else 1
  return xg.reshape(*xg.shape[:-2], -1)[..., :cols].reshape(shape)


def _group_range(xg: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(max |x|, min nonzero |x|) per group [..., G, 1]; exact, on the float bits."""
  bits = formats.abs_bits(xg)
  big = np.int32(np.iinfo(np.int32).max)
  amax = jnp.max(bits, axis=-1, keepdims=True)
  amin = jnp.min(jnp.where(bits == 0, big, bits), axis=-1, keepdims=True)
  as_float = lambda b: lax.bitcast_convert_type(b, jnp.float32)
  return as_float(amax), jnp.where(amin == big, as_float(amax), as_float(amin))


def encode_groups(xg: jax.Array, ops: MathOps = PRECISE
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """fp8_encode of grouped float32 values [..., G, GROUP] (subnormals not yet flushed):
  (q float8_e4m3fn [..., G, GROUP], a [..., G, 1], k [..., G, 1]). train/fp8_adam.py
  runs the same ops on its blocks of groups."""
  xg = formats.flush_subnormals(xg)
  return encode_in_range(xg, *_group_range(xg), ops=ops)


def flushed_range(xg: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The (max |x|, min nonzero |x|) per group [..., G, 1] that encode_groups(xg) uses."""
  return _group_range(formats.flush_subnormals(xg))


def encode_in_range(xg: jax.Array, amax: jax.Array, amin: jax.Array, ops: MathOps = PRECISE
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """encode_groups with its group range given (flushed xg and its flushed_range)."""
  # log2 of the range as a difference: amax / amin would overflow for extreme groups.
  spread = ops.log2(amax) - ops.log2(amin)
  k = jnp.minimum(jnp.where(spread > 0, ops.div(_LOG2_RANGE, jnp.where(spread > 0, spread, 1.0)),
                            K_MAX), K_MAX)
  ratio = ops.div(jnp.abs(xg), jnp.where(amax > 0, amax, 1.0))  # in [0, 1]; 0: a zero group
  z = jnp.sign(xg) * ops.exp2(k * ops.log2(ratio))          # log2(0) = -inf -> z = 0
  fmax = np.float32(_E4M3.max)
  y = z * fmax
  y = jnp.where(y > fmax, fmax, jnp.where(y < -fmax, -fmax, y))  # float32 rounding at +-1
  return y.astype(_E4M3.dtype), amax, k


def decode_groups(qg: jax.Array, amax: jax.Array, k: jax.Array, ops: MathOps = PRECISE
                  ) -> jax.Array:
  """The float32 values [..., G, GROUP] of grouped parts (q [..., G, GROUP], a and k
  [..., G, 1])."""
  zg = qg.astype(jnp.float32) * _Z_SCALE
  return jnp.sign(zg) * amax * ops.exp2(ops.div(ops.log2(jnp.abs(zg)), k))


def fp8_encode(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(q float8_e4m3fn of x's shape, a float32, k float32 of group_shape(x.shape))."""
  # Flushing commutes with the zero padding: flushed here as the reference always did.
  xg = _grouped(formats.flush_subnormals(jnp.asarray(x, jnp.float32)))
  qg, amax, k = encode_groups(xg)
  shape = group_shape(x.shape)
  return _ungrouped(qg, x.shape), amax.reshape(shape), k.reshape(shape)


def fp8_decode(parts: tuple[jax.Array, ...], shape: tuple[int, ...]) -> jax.Array:
  """The float32 moment of fp8_encode's parts."""
  q, amax, k = parts
  qg = _grouped(q)
  xg = decode_groups(qg, amax.reshape(*qg.shape[:-1], 1), k.reshape(*qg.shape[:-1], 1))
  return _ungrouped(xg, shape)


def _cast_codec(name: str, dtype) -> Codec:
  return Codec(name, 1, lambda x: (x.astype(dtype),),
               lambda parts, shape: parts[0].astype(jnp.float32),
               lambda shape: (jnp.zeros(shape, dtype),))


def fp8_zeros(shape: tuple[int, ...]) -> tuple[jax.Array, jax.Array, jax.Array]:
  """fp8_encode of zeros: q = 0, a = 0 and k = K_MAX (a zero group has no spread)."""
  return (jnp.zeros(shape, _E4M3.dtype), jnp.zeros(group_shape(shape), jnp.float32),
          jnp.full(group_shape(shape), K_MAX, jnp.float32))


CODECS = {
    "fp32": _cast_codec("fp32", jnp.float32),  # lossless: the tests' check of the plumbing
    "bf16": _cast_codec("bf16", jnp.bfloat16),
    "fp8": Codec("fp8", 3, fp8_encode, fp8_decode, fp8_zeros),
}


def get_codec(moments: str) -> Codec:
  if moments not in CODECS:
    raise ValueError(f"opt.moments={moments!r}; valid: {list(MOMENT_DTYPES)}")
  return CODECS[moments]


class StoredAdamState(NamedTuple):
  """Adam's state with encoded moments. mu and nu are tuples of trees shaped like the params
  (bf16: (values,); fp8: (q, a, k)), so each part is sharded like its param."""
  count: jax.Array
  mu: tuple[Any, ...]
  nu: tuple[Any, ...]


def _encode_tree(codec: Codec, tree) -> tuple[Any, ...]:
  """A tree of float32 arrays -> a tuple of trees, one per stored part."""
  treedef = jax.tree.structure(tree)
  encoded = [codec.encode(x) for x in jax.tree.leaves(tree)]
  return tuple(treedef.unflatten([e[i] for e in encoded]) for i in range(codec.parts))


def _decode_tree(codec: Codec, parts: tuple[Any, ...], like) -> Any:
  """The inverse of _encode_tree; `like` gives the tree structure and the shapes."""
  leaves = [jax.tree.leaves(p) for p in parts]
  treedef = jax.tree.structure(like)
  return treedef.unflatten([codec.decode(tuple(lv[i] for lv in leaves), x.shape)
                            for i, x in enumerate(jax.tree.leaves(like))])


def init_of(codec: Codec) -> Callable[[Any], StoredAdamState]:
  """The init of a stored-moment Adam: zero moments, encoded by `codec`."""
  def init_fn(params):
    # One jax.tree.map per part (not leaves/unflatten): optax.tree_map_params' placeholder
    # params must come back as a placeholder at every part.
    zeros = lambda: tuple(jax.tree.map(lambda p, i=i: codec.zeros(jnp.shape(p))[i], params)
                          for i in range(codec.parts))
    return StoredAdamState(jnp.zeros([], jnp.int32), zeros(), zeros())
  return init_fn


def scale_by_adam_stored(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                         eps_root: float = 0.0, moments: str = "bf16"
                         ) -> optax.GradientTransformation:
  """optax.scale_by_adam with its moments stored by the codec `moments` (see the module).

  This is the reference form: decode, update and encode as written here. For fp8,
  train/fp8_adam.py's scale_by_adam_fp8 runs the same ops in one pass per tensor, bit for
  bit the same on the CPU, with the same state.
  """
  codec = get_codec(moments)
  init_fn = init_of(codec)

  def update_fn(updates, state, params=None):
    del params
    updates = jax.tree.map(lambda g: g.astype(jnp.float32), updates)
    mu = optax.tree.update_moment(updates, _decode_tree(codec, state.mu, updates), b1, 1)
    nu = optax.tree.update_moment_per_elem_norm(
        updates, _decode_tree(codec, state.nu, updates), b2, 2)
    count_inc = optax.safe_increment(state.count)
    mu_hat = optax.tree.bias_correction(mu, b1, count_inc)
    nu_hat = optax.tree.bias_correction(nu, b2, count_inc)
    updates = jax.tree.map(lambda m, v: m / (jnp.sqrt(v + eps_root) + eps), mu_hat, nu_hat)
    return updates, StoredAdamState(count_inc, _encode_tree(codec, mu),
                                    _encode_tree(codec, nu))

  return optax.GradientTransformation(init_fn, update_fn)
