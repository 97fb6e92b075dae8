"""Checksums of a checkpoint's files: written with the checkpoint, verified before a restore.

A step directory gets checksums.json = {relative path: [bytes, sha256]} of its files, written
before orbax commits the directory (so every committed checkpoint of this code has one); the
step metadata orbax rewrites at the commit is checked to parse instead. A checkpoint without
checksums (older code, or a synchronous save killed between commit and checksums) is restored
unverified: orbax's own errors and the finiteness check still catch much of the damage.
"""

import concurrent.futures
import hashlib
import json
import os

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
