"""Checksums of a checkpoint's files: written with the checkpoint, verified before a restore.

A step directory gets checksums.json = {relative path: [bytes, sha256]} of its files, written
before orbax commits the directory (so every committed checkpoint of this code has one); the
step metadata orbax rewrites at the commit is checked to parse instead. A checkpoint without
checksums (older code, or a synchronous save killed between commit and checksums) is checked
for what can be checked without them: finite state, shapes, Adam's moments within the bounds
Adam's update gives them, and the arrays' fingerprint written with the checkpoint (in its
`run` item, where it has one).
"""

import concurrent.futures
import functools
import hashlib
import json
import math
import os

import jax
import jax.numpy as jnp

from infir2_jax.train import rundir

MANIFEST = "checksums.json"
# orbax rewrites the step metadata when it commits (after our checksums): checked as JSON.
_UNCHECKSUMMED = (MANIFEST, rundir.ORBAX_STEP_METADATA)


class DamagedCheckpoint(Exception):
  """A checkpoint that cannot be trusted; the message says why in one line."""


def _files(directory: str) -> list[str]:
  out = []
  for root, _, names in os.walk(directory):
    for name in names:
      rel = os.path.relpath(os.path.join(root, name), directory)
      if rel not in _UNCHECKSUMMED:
        out.append(rel)
  return sorted(out)


def _sha256(path: str) -> str:
  with open(path, "rb") as f:
    return hashlib.file_digest(f, "sha256").hexdigest()  # releases the GIL while hashing


def _digests(directory: str, names: list[str]) -> list[str]:
  paths = [os.path.join(directory, n) for n in names]
  with concurrent.futures.ThreadPoolExecutor(min(8, len(paths) or 1)) as pool:
    return list(pool.map(_sha256, paths))


def write_manifest(directory: str) -> None:
  """Writes DIRECTORY/checksums.json of every file below it (atomically)."""
  names = _files(directory)
  manifest = {n: [os.path.getsize(os.path.join(directory, n)), d]
              for n, d in zip(names, _digests(directory, names))}
  tmp = os.path.join(directory, MANIFEST + ".tmp")
  with open(tmp, "w") as f:
    json.dump({"sha256": manifest}, f, indent=1, sort_keys=True)
  os.replace(tmp, os.path.join(directory, MANIFEST))


def has_manifest(directory: str) -> bool:
  return os.path.isfile(os.path.join(directory, MANIFEST))


def verify(directory: str) -> bool:
  """True when every file matches checksums.json, False when there is none to check.

  Raises:
    DamagedCheckpoint: a file is missing, has another size or other bytes, or checksums.json
      or orbax's step metadata is unreadable.
  """
  try:
    with open(os.path.join(directory, rundir.ORBAX_STEP_METADATA)) as f:
      json.load(f)
  except (OSError, ValueError) as e:
    raise DamagedCheckpoint(f"{rundir.ORBAX_STEP_METADATA} is unreadable "
                            f"({type(e).__name__})") from None
  path = os.path.join(directory, MANIFEST)
  if not os.path.exists(path):
    return False
  try:
    with open(path) as f:
      manifest = json.load(f)["sha256"]
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise DamagedCheckpoint(f"{MANIFEST} is unreadable ({type(e).__name__})") from None
  names = sorted(manifest)
  for name in names:
    file = os.path.join(directory, name)
    if not os.path.isfile(file):
      raise DamagedCheckpoint(f"{name} is missing")
    size = os.path.getsize(file)
    if size != manifest[name][0]:
      raise DamagedCheckpoint(f"{name} has {size} bytes, {manifest[name][0]} were written")
  for name, digest in zip(names, _digests(directory, names)):
    if digest != manifest[name][1]:
      raise DamagedCheckpoint(f"{name} differs from the checksum written with it")
  return True


# Checks for a checkpoint without checksums (written by older code, or a synchronous save
# killed between its commit and its checksums): what can be verified without them.

_PRIMES = (1_000_003, 998_244_353, 2_654_435_761, 40_503, 65_537, 97)


def _leaf_fingerprint(x):
  """A uint32 of the array's bits, exact in any reduction order (integer sums wrap mod 2**32)
  and so the same however the array is sharded: every element's bits times an odd weight of
  its position, summed. Any one flipped bit changes it."""
  if x.dtype == jnp.bool_:
    bits = x.astype(jnp.uint32)
  elif x.dtype.itemsize == 8:
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)   # a trailing axis of 2
  else:
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
    bits = jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
  weight = jnp.zeros(bits.shape, jnp.uint32)
  for axis in range(bits.ndim):
    weight = weight + jax.lax.broadcasted_iota(jnp.uint32, bits.shape, axis) * jnp.uint32(
        _PRIMES[axis % len(_PRIMES)])
  return jnp.sum(bits * (weight * jnp.uint32(2) + jnp.uint32(1)), dtype=jnp.uint32)


_fingerprints = jax.jit(lambda tree: jax.tree.map(_leaf_fingerprint, tree))


def leaf_name(path) -> str:
  """'opt_state/1/0/mu/embed/kernel': a key path as orbax's metadata and the live state both
  spell it (orbax stores a NamedTuple's fields as dict keys)."""
  parts = []
  for key in path:
    for attr in ("key", "name", "idx"):
      if hasattr(key, attr):
        parts.append(str(getattr(key, attr)))
        break
    else:
      parts.append(str(key))
  return "/".join(parts)


def state_fingerprint(state) -> dict[str, str]:
  """{leaf name: 8 hex digits} of every array of `state` (one jitted pass on the device)."""
  values = jax.device_get(_fingerprints(state))
  leaves, _ = jax.tree_util.tree_flatten_with_path(values)
  return {leaf_name(p): f"{int(v):08x}" for p, v in leaves}


def check_fingerprint(state, written: dict[str, str]) -> None:
  """DamagedCheckpoint when an array's fingerprint differs from the one written with it."""
  now = state_fingerprint(state)
  differ = sorted(k for k in written if k in now and now[k] != written[k])
  if differ:
    raise DamagedCheckpoint(f"{len(differ)} arrays differ from the fingerprint written with "
                            f"them ({', '.join(differ[:3])}{', ...' if len(differ) > 3 else ''})")


def _is_adam(x) -> bool:
  return hasattr(x, "mu") and hasattr(x, "nu") and hasattr(x, "_fields")


@functools.partial(jax.jit, static_argnums=2)
def _moment_violations(mu, nu, ratio):
  """(elements out of bounds, the largest |mu|, the smallest nu) of one moment pair."""
  mu, nu = mu.astype(jnp.float32), nu.astype(jnp.float32)
  limit = 4.0 * jnp.sqrt(ratio * jnp.maximum(nu, 0.0)) + 1e-12
  bad = (nu < 0) | (jnp.abs(mu) > limit)
  return jnp.sum(bad), jnp.max(jnp.abs(mu)), jnp.min(nu)


def check_adam_moments(opt_state, b1: float, b2: float) -> None:
  """DamagedCheckpoint when Adam's moments break what Adam's update guarantees of them.

  optax keeps mu = (1-b1) sum b1^k g_k and nu = (1-b2) sum b2^k g_k^2 (no bias correction);
  by Cauchy-Schwarz mu^2 <= (1-b1)^2 / ((1-b2)(1 - b1^2/b2)) nu whenever b1^2 < b2, and
  nu >= 0 always. Checked with 4x slack (bf16 storage, a b2 changed on resume); a flipped
  exponent bit is off by orders of magnitude (issue 36: a moment of -1.6e36). FP8-stored
  moments (q, a, k parts) are left to the finiteness check.
  """
  ratio = (1 - b1) ** 2 / ((1 - b2) * (1 - b1 * b1 / b2)) if b1 * b1 < b2 else float("inf")
  if math.isinf(ratio):
    return
  states, _ = jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=_is_adam)
  for where, adam in [(p, x) for p, x in states if _is_adam(x)]:
    mu, nu = adam.mu, adam.nu
    if isinstance(mu, tuple) and not hasattr(mu, "_fields"):
      if len(mu) != 1:
        continue
      mu, nu = mu[0], nu[0]
    mus, _ = jax.tree_util.tree_flatten_with_path(mu)
    for (path, m), n in zip(mus, jax.tree.leaves(nu)):
      count, largest, smallest = (float(v) for v in _moment_violations(m, n, ratio))
      if count:
        raise DamagedCheckpoint(
            f"its Adam moments of opt_state/{leaf_name(where)}/mu/{leaf_name(path)} are "
            f"impossible for Adam ({int(count)} values; |mu| up to {largest:.3g}, nu down "
            f"to {smallest:.3g})")
