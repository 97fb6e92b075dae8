"""Input files read as a stream of chunks, and one chunk tokenized (prepare.py's two halves).

The reading half runs in the preparing process and only cuts bytes: a chunk is whole
.jsonl lines (about `chunk_bytes` of them), whole documents of a text file, or rows of a
parquet file. Positions count lines, documents or rows from the file's start, so a
preparation that stopped after a part resumes at the line where that part ended. The
encoding half runs in worker processes: it parses, checks and tokenizes a chunk with the
same rules as the in-memory pipeline (sources.py), and splits it into training and
validation documents by a hash of each document's text (a duplicate document can never
land on both sides).
"""

import bz2
import collections
import dataclasses
import gzip
import hashlib
import lzma
import os
import pathlib
from typing import Any, Iterator

import numpy as np
import tokenizers

from infir2_jax.data import sources
from infir2_jax.data import tokenizer as tokenizer_lib
from infir2_jax.errors import DataError

OPENERS = {".gz": lambda f: gzip.GzipFile(fileobj=f), ".xz": lzma.LZMAFile, ".bz2": bz2.BZ2File}
BLOCK = 1 << 20
MAX_EXAMPLES = 5  # bad-record locations kept per chunk (all are counted)


@dataclasses.dataclass
class Chunk:
  """A run of items of one input file, in file order."""
  file_index: int
  kind: str          # "jsonl" (items: one bytes blob of whole lines) | "text" | "parquet"
  where: str         # the file, for messages
  start: int         # position of the first item (line, document or row)
  end: int           # position after the last item
  items: list
  raw_pos: int       # bytes of the file on disk consumed so far (progress)
  first: bool = False
  last: bool = False
  part: int = 0      # with `first`: the part this file's output resumes at


@dataclasses.dataclass
class Encoded:
  """A chunk's documents as token ids (each followed by <|endoftext|>), per split."""
  tokens: dict           # split -> ids in the shard dtype
  lengths: dict          # split -> int64 [docs] tokens per document (EOS included)
  records: int           # good documents
  chars: int
  bad: collections.Counter          # reason (before its first ':') -> count
  bad_examples: list[tuple[str, str]]


def _open(path: pathlib.Path):
  raw = open(path, "rb")  # pylint: disable=consider-using-with
  opener = OPENERS.get(path.suffix.lower())
  return raw, (opener(raw) if opener else raw)


def read_chunks(path: pathlib.Path, file_index: int, start: int, part: int,
                cfg: dict) -> Iterator[Chunk]:
  """Chunks of `path` from position `start`; the first is marked `first` (resuming at
  `part`), the last `last` (possibly empty, so that every file ends with one)."""
  kind = sources.kind(path)
  try:
    if kind == "jsonl":
      items = _jsonl_blobs(path, start, cfg["chunk_bytes"])
    elif kind == "text":
      items = _text_docs(path, start, cfg["doc_separator"], cfg["chunk_bytes"])
    elif kind == "parquet":
      items = _parquet_values(path, start, cfg["text_key"], cfg["chunk_bytes"])
    else:
      raise ValueError(f"unsupported file type: {path}")
    pending, pos = None, start
    for batch, count, raw_pos in items:
      if pending is not None:
        yield pending
      pending = Chunk(file_index, kind, str(path), pos, pos + count, batch, raw_pos,
                      first=pos == start, part=part)
      pos += count
    if pending is None:
      pending = Chunk(file_index, kind, str(path), pos, pos, [], os.path.getsize(path),
                      first=True, part=part)
    pending.last = True
    yield pending
  except sources.DECOMPRESS_ERRORS as e:
    raise sources.not_compressed_error(path, e) from e


def _jsonl_blobs(path, start, chunk_bytes):
  """(one blob of whole lines, line count, raw bytes read), lines before `start` skipped."""
  raw, f = _open(path)
  with raw, f:
    rest, skip = b"", start
    while True:
      block = f.read(chunk_bytes)
      data = rest + block
      if not block:
        lines = data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)
        if data and skip < lines:
          yield [_drop_lines(data, skip)], lines - skip, raw.tell()
        return
      cut = data.rfind(b"\n") + 1
      data, rest = data[:cut], data[cut:]
      lines = data.count(b"\n")
      if skip >= lines:
        skip -= lines
        continue
      yield [_drop_lines(data, skip)], lines - skip, raw.tell()
      skip = 0


def _drop_lines(data: bytes, n: int) -> bytes:
  at = 0
  for _ in range(n):
    at = data.index(b"\n", at) + 1
  return data[at:]


def _text_docs(path, start, separator, chunk_bytes):
  """(documents as bytes, count, raw bytes read): the file split at `separator`."""
  raw, f = _open(path)
  sep = separator.encode("utf-8")
  with raw, f:
    if not sep:  # the whole file is one document
      if start == 0:
        yield [f.read()], 1, raw.tell()
      return
    pos, docs, size, rest = 0, [], 0, b""
    while True:
      block = f.read(BLOCK)
      parts = (rest + block).split(sep)
      rest = parts.pop() if block else None
      for doc in parts:
        if pos >= start:
          docs.append(doc)
          size += len(doc)
        pos += 1
      if docs and (size >= chunk_bytes or not block):
        yield docs, len(docs), raw.tell()
        docs, size = [], 0
      if not block:
        return


def _parquet_values(path, start, column, chunk_bytes):
  """(values of `column`, count, raw bytes read) in row order."""
  try:
    import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise DataError(f"reading {path} needs pyarrow, which is not installed: "
                    "`pip install pyarrow`") from None
  pf = pq.ParquetFile(path)
  if column not in pf.schema_arrow.names:
    raise DataError(f"{path} has no column {column!r}; columns: {pf.schema_arrow.names}")
  pos, values, size = 0, [], 0
  total_rows = max(pf.metadata.num_rows, 1)
  for batch in pf.iter_batches(batch_size=1024, columns=[column]):
    got = batch.column(0).to_pylist()
    lo = max(0, start - pos)
    pos += len(got)
    values += got[lo:]
    size += sum(len(v) for v in got[lo:] if isinstance(v, str))
    if values and size >= chunk_bytes:
      yield values, len(values), os.path.getsize(path) * pos // total_rows
      values, size = [], 0
  if values:
    yield values, len(values), os.path.getsize(path)


_WORKER: dict[str, Any] = {}


def init_worker(cfg: dict) -> None:
  """Loads the tokenizer once per worker process (and checks it is the preparation's)."""
  os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
  tok = tokenizer_lib.load_tokenizer(cfg["tokenizer"], cache_dir=cfg.get("cache_dir", ""))
  if tokenizer_lib.fingerprint(tok) != cfg["tokenizer_fingerprint"]:
    raise ValueError(f"tokenizer {cfg['tokenizer']!r} changed while preparing")
  _WORKER.update(cfg=cfg, tok=tokenizer_lib.literal_copy(tok))


def is_val(text: str, val_fraction: float) -> bool:
  """Whether a document is held out: a hash of its text, uniform in [0, 1), < fraction."""
  h = hashlib.sha256(text.encode("utf-8")).digest()
  return int.from_bytes(h[:8], "little") < val_fraction * 2.0**64


def _documents(chunk: Chunk, text_key: str):
  """(where, text, reason) of each record of a chunk, by the in-memory pipeline's rules."""
  if chunk.kind == "jsonl":
    blob = chunk.items[0] if chunk.items else b""
    lines = blob.split(b"\n")
    if lines and not lines[-1]:
      lines.pop()
    for i, line in enumerate(lines):
      for sub in line.splitlines() or [line]:  # \r alone also ends a line (bytes.splitlines)
        if not sub.strip():
          continue
        value, reason = sources.parse_json_line(sub)
        if not reason:
          value, reason = sources.document_text(value, text_key)
        yield f"{chunk.where}:{chunk.start + i + 1}", value, reason
  elif chunk.kind == "text":
    for i, raw in enumerate(chunk.items):
      text, reason = sources.decode_document(raw)
      if not reason:
        text, reason = sources.document_text(text, text_key)
      yield f"{chunk.where}#doc{chunk.start + i}", text, reason
  else:
    for i, value in enumerate(chunk.items):
      text, reason = sources.document_text({text_key: value}, text_key)
      yield f"{chunk.where}#row{chunk.start + i}", text, reason


def encode_chunk(chunk: Chunk) -> Encoded:
  """Tokenizes a chunk in a worker (init_worker ran there)."""
  cfg, tok = _WORKER["cfg"], _WORKER["tok"]
  return encode_documents(chunk, tok, cfg)


def encode_documents(chunk: Chunk, tok: tokenizers.Tokenizer, cfg: dict) -> Encoded:
  dtype = np.dtype(cfg["dtype"])
  bad, examples, texts = collections.Counter(), [], []
  for where, text, reason in _documents(chunk, cfg["text_key"]):
    if reason:
      bad[reason.split(":")[0]] += 1
      if len(examples) < MAX_EXAMPLES:
        examples.append((where, reason))
    else:
      texts.append(text)
  ids = [e.ids for e in tok.encode_batch_fast(texts, add_special_tokens=False)] if texts else []
  out: dict = {s: ([], []) for s in ("train", "val")}
  for text, doc in zip(texts, ids):
    split = "val" if is_val(text, cfg["val_fraction"]) else "train"
    doc.append(cfg["eos"])
    out[split][0].append(np.asarray(doc, dtype))
    out[split][1].append(len(doc))
  cat = lambda xs, t: np.concatenate(xs).astype(t, copy=False) if xs else np.zeros(0, t)
  tokens = {s: cat(out[s][0], dtype) for s in out}
  for s, ids_s in tokens.items():  # readers take every <|endoftext|> for a document's end
    if int(np.count_nonzero(ids_s == cfg["eos"])) != len(out[s][1]):
      raise DataError(f"{chunk.where}: the tokenizer made <|endoftext|> (id {cfg['eos']}) "
                      "out of document text; prepared data needs it only between documents")
  return Encoded(tokens=tokens,
                 lengths={s: np.asarray(out[s][1], np.int64) for s in out},
                 records=len(texts), chars=sum(len(t) for t in texts), bad=bad,
                 bad_examples=examples)

