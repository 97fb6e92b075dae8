"""Prepared corpora: token shards on disk with a JSON index, read through memory maps.

A prepared directory (written by `python -m infir2_jax.data.prepare`, see prepare.py):

  OUT/prepared.json               the index: settings, every shard in order, totals
  OUT/settings.json               what every preparing worker must agree on
  OUT/files/F.json                input file F (its index in the sorted input list) is done
  OUT/shards/F-P.json             part P of input file F is done (counts, input range)
  OUT/shards/F-P.train.tok        token ids (raw little-endian, dtype in the index); every
  OUT/shards/F-P.val.tok          document is followed by <|endoftext|>
  OUT/shards/F-P.train.ends       int64 end offset of each document in its .tok file
  OUT/shards/F-P.val.ends

Why flat token files and memory maps rather than ArrayRecord: a training row is L+1
consecutive tokens of the packed stream and crosses document boundaries, so reading a row
is one slice of a flat array (no decoding, no copy beyond the row, pages shared through the
OS cache); a record per document would mean reading and joining every record a row
touches. Nothing is loaded at start-up except the index (a few hundred bytes per shard):
host memory and start-up time do not grow with the number of tokens. The .ends files
(document boundaries) are what the index's counts are checked against; rows find their
documents from the <|endoftext|> tokens themselves.
"""

import collections
import dataclasses
import json
import mmap
import os
import pathlib
import threading

import numpy as np

from infir2_jax.data import packing

INDEX = "prepared.json"
SETTINGS = "settings.json"
FORMAT = "infir2_jax.prepared"
VERSION = 1
SPLITS = ("train", "val")
ENDS_DTYPE = np.dtype("<i8")
MAX_OPEN = 128  # memory maps kept open (each holds a file descriptor)


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
    raise ValueError(f"{root} is an unfinished preparation ({done} input files done, no "
                     f"{INDEX}): run the same `python -m infir2_jax.data.prepare` command "
                     "again to finish it (or `--finalize` once every worker is done)")
  meta = json.loads(index.read_text())
  if meta.get("format") != FORMAT or meta.get("version") != VERSION:
    raise ValueError(f"{index} is not a version-{VERSION} {FORMAT} index (got "
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
          raise ValueError(f"prepared shard {f} is {'missing' if got is None else f'{got} bytes'}"
                           f", the index says {size} bytes: the directory {root} is damaged; "
                           "prepare it again into a new directory")
      parts[split].append(Part(str(tok), str(ends), n, docs))
  return Prepared(str(root), meta["settings"], dtype, parts, meta["totals"])


class _Maps:
  """Read-only maps of shard files, at most MAX_OPEN open (least recently used dropped)."""

  def __init__(self):
    self._open: collections.OrderedDict = collections.OrderedDict()
    self._lock = threading.Lock()

  def get(self, path: str, dtype: np.dtype) -> np.ndarray:
    with self._lock:
      arr = self._open.get(path)
      if arr is not None:
        self._open.move_to_end(path)
        return arr
    with open(path, "rb") as f:
      mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    # Rows are read at random: the kernel's read-ahead would read ~100x what a row needs.
    mm.madvise(mmap.MADV_RANDOM)
    arr = np.frombuffer(mm, dtype=dtype)  # holds the map until the last slice is gone
    with self._lock:
      self._open[path] = arr
      while len(self._open) > MAX_OPEN:
        self._open.popitem(last=False)
    return arr


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
    self._maps = _Maps()

  def __len__(self) -> int:
    return self.num_rows

  def __getstate__(self):  # grain worker processes open their own maps
    state = dict(self.__dict__)
    del state["_maps"]
    return state

  def __setstate__(self, state):
    self.__dict__.update(state)
    self._maps = _Maps()

  def _tokens(self, lo: int, hi: int) -> np.ndarray:
    """Stream tokens [lo, hi), across parts."""
    out = []
    k = int(np.searchsorted(self.starts, lo, side="right")) - 1
    while lo < hi:
      base, end = int(self.starts[k]), int(self.starts[k + 1])
      out.append(self._maps.get(self.parts[k].tok, self.dtype)[lo - base:min(hi, end) - base])
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
