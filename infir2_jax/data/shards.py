"""Prepared corpora: token shards on disk with a JSON index, read a row at a time.

A prepared directory (written by `python -m infir2_jax.data.prepare`, see prepare.py):

  OUT/prepared.json               the index: settings, every shard in order, totals
  OUT/settings.json               what every preparing worker must agree on
  OUT/files/F.json                input file F (its index in the sorted input list) is done
  OUT/shards/F-P.json             part P of input file F is done (counts, input range)
  OUT/shards/F-P.train.tok        token ids (raw little-endian, dtype in the index); every
  OUT/shards/F-P.val.tok          document is followed by <|endoftext|>
  OUT/shards/F-P.train.ends       int64 end offset of each document in its .tok file
  OUT/shards/F-P.val.ends

Why flat token files rather than ArrayRecord: a training row is L+1 consecutive tokens of
the packed stream and crosses document boundaries, so reading a row is one read of one
byte range (no decoding, no index lookup, the OS page cache shared by every process of a
host); a record per document would mean reading and joining every record a row touches.
Rows are read with pread rather than through memory maps, which would count every cached
page a process ever touched as its resident memory. Nothing is loaded at start-up except
the index (a few hundred bytes per shard): host memory and start-up time do not grow with
the number of tokens. Rows find their documents from the <|endoftext|> tokens themselves;
the .ends files (each document's end) are there for tools that want whole documents.
"""

import collections
import dataclasses
import json
import os
import pathlib
import threading

import numpy as np

from infir2_jax.data import packing
from infir2_jax.errors import DataError, read_json_file

INDEX = "prepared.json"
SETTINGS = "settings.json"
FORMAT = "infir2_jax.prepared"
VERSION = 1
SPLITS = ("train", "val")
ENDS_DTYPE = np.dtype("<i8")
MAX_OPEN = 64   # shard files kept open per reading thread


def token_dtype(vocab_size: int) -> np.dtype:
  """The smallest little-endian unsigned dtype that holds every id."""
  return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def part_name(file_index: int, part: int) -> str:
  return f"{file_index:06d}-{part:05d}"


def part_paths(root: pathlib.Path, name: str, split: str) -> tuple[pathlib.Path, pathlib.Path]:
  """(tokens, ends) files of one split of one part."""
  base = root / "shards" / f"{name}.{split}"
  return base.with_name(base.name + ".tok"), base.with_name(base.name + ".ends")


def is_prepared(path: str) -> bool:
  """Whether `path` is a prepared directory (finished or not)."""
  p = pathlib.Path(os.path.expanduser(path))
  return p.is_dir() and ((p / INDEX).exists() or (p / SETTINGS).exists())


@dataclasses.dataclass(frozen=True)
class Part:
  """One split of one shard: `tokens` ids in `docs` documents."""
  tok: str
  ends: str
  tokens: int
  docs: int


@dataclasses.dataclass(frozen=True)
class Prepared:
  """A finished prepared directory, opened (nothing read but its index)."""
  root: str
  settings: dict
  dtype: np.dtype
  parts: dict              # split -> [Part] in stream order
  totals: dict             # records, tokens, bad records by reason, ...

  def tokens(self, split: str) -> int:
    return sum(p.tokens for p in self.parts[split])

  def docs(self, split: str) -> int:
    return sum(p.docs for p in self.parts[split])


def open_prepared(path: str) -> Prepared:
  """Reads OUT/prepared.json and checks that every shard file is there, whole."""
  root = pathlib.Path(os.path.expanduser(path)).resolve()
  index = root / INDEX
  if not index.exists():
    done = len(list((root / "files").glob("*.json"))) if (root / "files").is_dir() else 0
    raise DataError(f"{root} is an unfinished preparation ({done} input files done, no "
                    f"{INDEX}): run the same `python -m infir2_jax.data.prepare` command "
                    "again to finish it (or `--finalize` once every worker is done)")
  meta = read_json_file(str(index), "prepare the data again (the same `python -m "
                        "infir2_jax.data.prepare` command, into a new --out)")
  if meta.get("format") != FORMAT or meta.get("version") != VERSION:
    raise DataError(f"{index} is not a version-{VERSION} {FORMAT} index (got "
                    f"{meta.get('format')!r} v{meta.get('version')}); prepare it again")
  dtype = np.dtype(meta["dtype"])
  parts = {s: [] for s in SPLITS}
  for shard in meta["shards"]:
    for split in SPLITS:
      n, docs = shard[f"{split}_tokens"], shard[f"{split}_docs"]
      if not n:
        continue
      tok, ends = part_paths(root, shard["name"], split)
      for f, size in ((tok, n * dtype.itemsize), (ends, docs * ENDS_DTYPE.itemsize)):
        got = f.stat().st_size if f.exists() else None
        if got != size:
          raise DataError(f"prepared shard {f} is {'missing' if got is None else f'{got} bytes'}"
                          f", the index says {size} bytes: the directory {root} is damaged; "
                          "prepare it again into a new directory")
      parts[split].append(Part(str(tok), str(ends), n, docs))
  return Prepared(str(root), meta["settings"], dtype, parts, meta["totals"])


class _Files:
  """Shard files open for reading, per thread (so no thread closes another's), at most
  MAX_OPEN per thread, least recently used closed first."""

  def __init__(self):
    self._local = threading.local()

  def read(self, path: str, dtype: np.dtype, lo: int, hi: int) -> np.ndarray:
    """Elements [lo, hi) of the file of `dtype` elements at `path`."""
    files = self._local.__dict__.setdefault("files", collections.OrderedDict())
    f = files.get(path)
    if f is None:
      f = open(path, "rb", buffering=0)  # pylint: disable=consider-using-with
      # Rows are read at random: read-ahead would read ~100x what a row needs.
      os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
      files[path] = f
      while len(files) > MAX_OPEN:
        files.popitem(last=False)[1].close()
    files.move_to_end(path)
    size = dtype.itemsize
    data = os.pread(f.fileno(), (hi - lo) * size, lo * size)
    if len(data) != (hi - lo) * size:
      raise DataError(f"{path} is shorter than its index says: prepare it again")
    return np.frombuffer(data, dtype)


class ShardedStreamRows:
  """packing.StreamRows over the concatenation of parts on disk, read row by row.

  Row r is stream tokens [r*L, r*L + L] (one token shared with the next row), exactly as
  StreamRows cuts an in-memory stream; every part ends with a whole document. Reading a
  row reads those L+1 tokens and nothing else: a document ends at each <|endoftext|>,
  which prepared text never contains otherwise (special tokens in text are encoded as
  text), so the segments come from the tokens and the .ends files are not consulted.
  """

  def __init__(self, parts: list[Part], dtype: np.dtype, seq_len: int, pad_id: int, eos: int):
    self.parts = list(parts)
    self.dtype = np.dtype(dtype)
    self.seq_len, self.pad_id, self.eos = seq_len, pad_id, eos
    self.starts = np.cumsum([0] + [p.tokens for p in self.parts]).astype(np.int64)
    n = int(self.starts[-1])
    self.num_tokens, self.num_records = n, sum(p.docs for p in self.parts)
    self.num_rows = -(-(n - 1) // seq_len) if n > 1 else 0
    self._files = _Files()

  def __len__(self) -> int:
    return self.num_rows

  def __getstate__(self):  # grain worker processes open their own files
    state = dict(self.__dict__)
    del state["_files"]
    return state

  def __setstate__(self, state):
    self.__dict__.update(state)
    self._files = _Files()

  def _tokens(self, lo: int, hi: int) -> np.ndarray:
    """Stream tokens [lo, hi), across parts."""
    out = []
    k = int(np.searchsorted(self.starts, lo, side="right")) - 1
    while lo < hi:
      base, end = int(self.starts[k]), int(self.starts[k + 1])
      out.append(self._files.read(self.parts[k].tok, self.dtype, lo - base, min(hi, end) - base))
      lo, k = min(hi, end), k + 1
    return np.concatenate(out).astype(np.int32)

  def rows(self, row_ids: np.ndarray) -> dict[str, np.ndarray]:
    L, n = self.seq_len, self.num_tokens
    row_ids = np.asarray(row_ids, np.int64)
    tok_BxL1 = np.empty((len(row_ids), L + 1), np.int32)
    for b, r in enumerate(row_ids):
      lo = int(r) * L
      hi = min(lo + L + 1, n)
      tok_BxL1[b, :hi - lo] = self._tokens(lo, hi)
      tok_BxL1[b, hi - lo:] = tok_BxL1[b, hi - lo - 1]  # as StreamRows: masked out below
    valid_BxL = (row_ids[:, None] * L + np.arange(1, L + 1)) <= n - 1  # a target exists
    ends_doc_BxL = tok_BxL1[:, :-1] == self.eos   # the next position starts a new document
    doc_BxL = np.cumsum(ends_doc_BxL, axis=1) - ends_doc_BxL   # documents ended before j
    seg_BxL = np.where(valid_BxL, doc_BxL + 1, 0)
    return {
        "inputs": np.where(valid_BxL, tok_BxL1[:, :-1], self.pad_id),
        "targets": np.where(valid_BxL, tok_BxL1[:, 1:], self.pad_id),
        "segment_ids": seg_BxL.astype(np.int32),
        "positions": packing.positions_in_segment(seg_BxL),
        "loss_mask": (valid_BxL & ~ends_doc_BxL).astype(np.float32),
    }
