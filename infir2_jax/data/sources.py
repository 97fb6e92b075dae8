"""Source files: resolve names/globs, read records, split train/validation by document."""

import bz2
import dataclasses
import glob
import gzip
import hashlib
import json
import logging
import lzma
import os
import pathlib
import re
from typing import Any
import zlib

from infir2_jax.data import corpus
from infir2_jax.data.config import DataConfig
from infir2_jax.errors import ConfigError, DataError, NotFound

TEXT_EXTS = (".txt", ".md", ".py")
RECORD_EXTS = (".jsonl", ".parquet")
COMPRESSIONS = {".gz": gzip.decompress, ".xz": lzma.decompress, ".bz2": bz2.decompress}
DECOMPRESS_ERRORS = (OSError, EOFError, lzma.LZMAError, zlib.error)
# C0 control characters other than \t \n \v \f \r and ESC: rare in text, common in binary.
_CONTROLS = re.compile("[\x00-\x08\x0e-\x1a\x1c-\x1f\x7f]")
PRETRAIN_BUILTINS = ("shakespeare", "stdlib")
CHAT_BUILTINS = ("champ", "champ_heldout", "humaneval")


@dataclasses.dataclass(frozen=True)
class Record:
  key: str      # stable id: content hash of the file + index; orders the validation split
  where: str    # file:line, for messages
  value: Any    # a document's text (pretrain) or a JSON record (chat)


@dataclasses.dataclass(frozen=True)
class FileRecords:
  path: pathlib.Path
  sha256: str                    # of the file's bytes (keys the token cache)
  records: list[Record]
  bad: list[tuple[str, str]]     # (where, reason) of records that could not be read


def kind(path: pathlib.Path) -> str | None:
  """"text", "jsonl", "parquet", or None for an unsupported file."""
  suffixes = [s.lower() for s in path.suffixes[-2:]]
  if suffixes and suffixes[-1] in COMPRESSIONS:
    suffixes = suffixes[:-1]
  ext = suffixes[-1] if suffixes else ""
  if ext in TEXT_EXTS:
    return "text"
  if ext == ".jsonl":
    return "jsonl"
  if ext == ".parquet" and path.suffix.lower() == ".parquet":
    return "parquet"
  return None


def resolve_sources(spec: str, fmt: str, cache_dir: str = "") -> list[pathlib.Path]:
  """Files named by `spec`: comma-separated built-in names, files, directories or globs."""
  builtins = PRETRAIN_BUILTINS if fmt == "pretrain" else CHAT_BUILTINS
  files: list[pathlib.Path] = []
  for item in (s.strip() for s in spec.split(",")):
    if not item:
      continue
    if item in PRETRAIN_BUILTINS + CHAT_BUILTINS:
      if item not in builtins:
        raise ConfigError(f"built-in source {item!r} is not {fmt} data; {fmt} built-ins: "
                          f"{builtins}")
      files.extend(_builtin(item, cache_dir))
      continue
    files.extend(_expand(item))
  seen, unique = set(), []
  for f in files:
    if f not in seen:
      seen.add(f)
      unique.append(f)
  if not unique:
    raise DataError(f"data source {spec!r} names no files")
  return unique


def _builtin(name: str, cache_dir: str) -> list[pathlib.Path]:
  if name == "shakespeare":
    return corpus.shakespeare_files()
  if name == "stdlib":
    return corpus.stdlib_files()
  from infir2_jax.data import sft_sources  # pylint: disable=g-import-not-at-top
  return [sft_sources.builtin_chat_file(name, cache_dir)]


def _expand(item: str) -> list[pathlib.Path]:
  pattern = os.path.expanduser(item)
  supported = "/".join(TEXT_EXTS + RECORD_EXTS) + " (text and .jsonl may end in .gz/.xz/.bz2)"
  if glob.has_magic(pattern):
    matches = [pathlib.Path(p) for p in sorted(glob.glob(pattern, recursive=True))]
    if not matches:
      raise DataError(f"data source glob {item!r} matched no files")
  else:
    path = pathlib.Path(pattern)
    if not path.exists():
      raise NotFound(f"data source {item!r} does not exist (and is not a built-in "
                     f"name: {PRETRAIN_BUILTINS + CHAT_BUILTINS})")
    matches = sorted(p for p in path.rglob("*")) if path.is_dir() else [path]
    if not path.is_dir() and kind(path) is None:
      raise DataError(f"data source {item!r} has an unsupported type; supported: {supported}")
  files = [p for p in matches if p.is_file() and kind(p) is not None]
  skipped = [p for p in matches if p.is_file() and kind(p) is None]
  if skipped:
    logging.warning("data source %r: skipping %d unsupported files, e.g. %s", item,
                    len(skipped), skipped[0])
  if not files:
    raise DataError(f"data source {item!r} has no supported files; supported: {supported}")
  return files


def _read_bytes(path: pathlib.Path) -> tuple[bytes, str]:
  raw = path.read_bytes()
  digest = hashlib.sha256(raw).hexdigest()
  decompress = COMPRESSIONS.get(path.suffix.lower())
  if not decompress:
    return raw, digest
  try:
    return decompress(raw), digest
  except DECOMPRESS_ERRORS as e:
    raise not_compressed_error(path, e) from e


def not_compressed_error(path: os.PathLike, e: Exception) -> ValueError:
  """The error for a file whose name says compressed but whose bytes are not (or are cut)."""
  ext = pathlib.Path(path).suffix
  return ValueError(f"{path}: not a valid {ext} file ({type(e).__name__}: {e}); its name "
                    f"ends in {ext} but its bytes are not {ext[1:]}-compressed (or are cut "
                    "short): fix the file or its name")


def decode_document(raw: bytes) -> tuple[str, str]:
  """(text, "") for UTF-8 text, ("", reason) for bytes that are not text.

  Strict: a replacement character per bad byte would train on U+FFFD (and random bytes
  would train as a document; `document_text` also rejects binary data that is valid UTF-8).
  """
  try:
    return raw.decode("utf-8"), ""
  except UnicodeDecodeError as e:
    return "", f"not UTF-8: byte {e.start} is {raw[e.start:e.start + 1]!r}"


def binary_reason(text: str) -> str:
  """"" for text, else why `text` looks like binary data (NUL or many control characters)."""
  if "\x00" in text:
    return "binary data: NUL characters"
  controls = len(_CONTROLS.findall(text))
  if controls > max(8, 0.01 * len(text)):
    return f"binary data: {controls} control characters in {len(text)}"
  return ""


def read_records(path: pathlib.Path, cfg: DataConfig) -> FileRecords:
  """Reads one file: documents (text) for pretraining, JSON records for chat.

  A text file is one document, or several split at `cfg.doc_separator`. A .jsonl line or
  a parquet row is one record; for pretraining its `cfg.text_key` field is the document.
  Unreadable records (bad JSON, missing or empty text) are returned in `bad`.
  """
  data, digest = _read_bytes(path)
  k = kind(path)
  values: list[tuple[str, Any]] = []   # (where, value)
  bad: list[tuple[str, str]] = []
  if k == "text":
    if cfg.format == "chat":
      raise DataError(f"{path}: chat data must be .jsonl or .parquet records, not text")
    sep = cfg.doc_separator.encode("utf-8")
    for i, part in enumerate(data.split(sep) if sep else [data]):
      text, reason = decode_document(part)
      if reason:
        bad.append((f"{path}#doc{i}", reason))
      else:
        values.append((f"{path}#doc{i}", text))
  elif k == "jsonl":
    # Bytes split only at \n, \r\n and \r, which JSON strings cannot hold raw (str's
    # splitlines would also cut at U+2028 and friends inside strings).
    for i, line in enumerate(data.splitlines()):
      if not line.strip():
        continue
      where = f"{path}:{i + 1}"
      value, reason = parse_json_line(line)
      if reason:
        bad.append((where, reason))
      else:
        values.append((where, value))
  elif k == "parquet":
    column = cfg.text_key if cfg.format == "pretrain" else cfg.messages_key
    values = [(f"{path}#row{i}", {column: v}) for i, v in enumerate(_parquet(path, data, column))]
  else:
    raise ValueError(f"unsupported file type: {path}")

  records = []
  for i, (where, value) in enumerate(values):
    if cfg.format == "pretrain":
      value, reason = document_text(value, cfg.text_key)
      if reason:
        bad.append((where, reason))
        continue
    records.append(Record(key=f"{digest[:16]}:{i}", where=where, value=value))
  return FileRecords(path=path, sha256=digest, records=records, bad=bad)


def parse_json_line(line: bytes) -> tuple[Any, str]:
  """(record, "") or (None, reason) for one .jsonl line (strict UTF-8, then JSON)."""
  try:
    text = line.decode("utf-8")
  except UnicodeDecodeError as e:
    return None, f"not UTF-8: byte {e.start} is {line[e.start:e.start + 1]!r}"
  try:
    return json.loads(text), ""
  except json.JSONDecodeError as e:
    return None, f"invalid JSON: {e.msg}"


def document_text(value: Any, text_key: str) -> tuple[str, str]:
  """(text, "") of a pre-training record (a str or a dict with `text_key`), or ("", reason)."""
  if isinstance(value, dict):
    if text_key not in value:
      return "", f"missing text field: no {text_key!r} (fields: {sorted(value)[:8]})"
    value = value[text_key]
  if not isinstance(value, str):
    return "", f"text not a string: {text_key!r} is {type(value).__name__}"
  if not value.strip():
    return "", "empty text"
  try:
    value.encode("utf-8")
  except UnicodeEncodeError as e:  # a lone surrogate from a JSON escape: no tokenizer takes it
    return "", f"not UTF-8: character {e.start} is a lone surrogate"
  return value, binary_reason(value)


def _parquet(path: pathlib.Path, data: bytes, column: str) -> list[Any]:
  try:
    import pyarrow as pa  # pylint: disable=g-import-not-at-top
    import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise DataError(f"reading {path} needs pyarrow, which is not installed: "
                    "`pip install pyarrow`") from None
  table = pq.read_table(pa.BufferReader(data))
  if column not in table.column_names:
    raise DataError(f"{path} has no column {column!r}; columns: {table.column_names}")
  return table.column(column).to_pylist()


def split_documents(keys: list[str], sizes: list[int],
                    val_fraction: float) -> tuple[list[int], list[int]]:
  """Splits records into (train, validation) indices, whole documents only.

  Documents are ranked by a hash of their key (content hash + index), so the split does
  not depend on the seed, the tokenizer or the file names; validation takes documents in
  that order until it holds `val_fraction` of the total size. A document that would take
  validation past twice that share stays in training (one huge document must not become
  the whole validation split); if every document is that large, the smallest is held out.
  """
  if val_fraction <= 0:
    return list(range(len(keys))), []
  if len(keys) < 2:
    raise DataError(f"a validation split by document needs >= 2 documents, got {len(keys)}; "
                    "set data.val_fraction=0, data.doc_separator, or data.val_source")
  order = sorted(range(len(keys)), key=lambda i: hashlib.sha256(keys[i].encode()).digest())
  total = sum(sizes)
  target = val_fraction * total
  val, held = [], 0
  for i in order[:-1]:  # always leave one training document
    if held >= target:
      break
    if held + sizes[i] > 2 * target:
      continue
    val.append(i)
    held += sizes[i]
  if not val:
    val = [min(order, key=lambda i: sizes[i])]
    held = sizes[val[0]]
  if held > 2 * target:
    logging.warning("the validation split holds %.1f%% of the text (data.val_fraction=%g): "
                    "%d documents are too few or too large to hold out less; consider "
                    "data.val_source", 100 * held / max(total, 1), val_fraction, len(keys))
  val_set = set(val)
  return [i for i in range(len(keys)) if i not in val_set], sorted(val)
