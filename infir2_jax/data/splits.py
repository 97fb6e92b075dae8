"""One source -> its training and validation rows: tokenized in memory, or prepared shards.

Raw files (globs, directories, built-ins) are tokenized into memory (cached on disk per
file) and split by document (sources.split_documents). A prepared directory (prepare.py)
is read through memory maps: its documents were split when it was prepared, and nothing
but its index is loaded here.
"""

import collections
import dataclasses
import logging
import os

import numpy as np
import tokenizers

from infir2_jax.data import encoded as encoded_lib
from infir2_jax.data import packing
from infir2_jax.data import shards
from infir2_jax.data import sources
from infir2_jax.data import tokenizer as tokenizer_lib
from infir2_jax.data.config import DataConfig
from infir2_jax.errors import DataError

RAW_WARN_BYTES = 2 << 30  # raw input above this is better prepared once than loaded per run


@dataclasses.dataclass
class SourceRows:
  """A source's rows; `bad` are (where, reason) of in-memory records, `bad_counts` all."""
  train: object                 # packing.StreamRows / SampleRows / shards.ShardedStreamRows
  val: object | None            # None: no validation split
  bad: list[tuple[str, str]]
  bad_counts: collections.Counter
  prepared: bool


def bad_note(bad: list[tuple[str, str]]) -> str:
  """" (N bad records skipped: {...}, e.g. ...)" or "" (for errors about what is left)."""
  if not bad:
    return ""
  counts = collections.Counter(reason.split(":")[0] for _, reason in bad)
  return (f" ({len(bad)} bad records were skipped: {dict(counts)}, e.g. "
          f"{bad[0][0]}: {bad[0][1]})")


def build(cfg: DataConfig, spec: str, val_spec: str, tok: tokenizers.Tokenizer,
          special: tokenizer_lib.SpecialIds, seq_len: int, seed: int) -> SourceRows:
  """The rows of `spec` (validation from `val_spec`, else held out of `spec`)."""
  if _prepared_items(spec):
    return _prepared(cfg, spec, val_spec, tok, special, seq_len)
  train, val, bad = encoded_splits(cfg, spec, val_spec, tok, special)
  if cfg.format == "chat":
    train_rows, too_long = chat_rows(train, seq_len, special, seed)
    val_rows, val_too_long = chat_rows(val, seq_len, special, None)
    bad += too_long + val_too_long
  else:
    train_rows, val_rows = (stream_rows(e, seq_len, special) for e in (train, val))
  counts = collections.Counter(reason.split(":")[0] for _, reason in bad)
  has_val = cfg.val_fraction > 0 or bool(val_spec)
  return SourceRows(train_rows, val_rows if has_val else None, bad, counts, prepared=False)


def _prepared_items(spec: str) -> list[str]:
  items = [s.strip() for s in spec.split(",") if s.strip()]
  prepared = [i for i in items if shards.is_prepared(i)]
  if prepared and len(prepared) != len(items):
    raise DataError(f"data source {spec!r} mixes prepared directories ({prepared[0]}) and raw "
                    "files: prepare the raw files too, or give each its own name in "
                    "data.source and weight them with data.mixture")
  return prepared


def _open_checked(path: str, cfg: DataConfig, tok) -> shards.Prepared:
  prep = shards.open_prepared(path)
  if cfg.format != "pretrain":
    raise DataError(f"{path} is prepared pre-training data; data.format={cfg.format!r} "
                    "needs raw .jsonl/.parquet records")
  fp = tokenizer_lib.fingerprint(tok)
  if prep.settings["tokenizer_fingerprint"] != fp:
    raise DataError(f"{path} was prepared with tokenizer {prep.settings['tokenizer']!r} "
                    f"(fingerprint {prep.settings['tokenizer_fingerprint']}), but "
                    f"data.tokenizer={cfg.tokenizer!r} is {fp}: set data.tokenizer to the "
                    "one it was prepared with, or prepare it again")
  return prep


def _prepared(cfg, spec, val_spec, tok, special, seq_len) -> SourceRows:
  preps = [_open_checked(p, cfg, tok) for p in _prepared_items(spec)]
  dtype = preps[0].dtype
  if any(p.dtype != dtype for p in preps):
    raise DataError(f"the prepared directories of {spec!r} store different token dtypes")
  counts = collections.Counter()
  for p in preps:
    counts.update(p.totals["bad"])
  rows = lambda parts: shards.ShardedStreamRows(parts, dtype, seq_len, special.pad, special.eos)
  train = rows([x for p in preps for x in p.parts["train"]])
  val, bad = None, []
  if val_spec:
    if _prepared_items(val_spec):
      vals = [_open_checked(p, cfg, tok) for p in _prepared_items(val_spec)]
      # Every document of a validation source validates.
      val = rows([x for p in vals for s in shards.SPLITS for x in p.parts[s]])
    else:
      enc = encoded_lib.encode_files(sources.resolve_sources(val_spec, cfg.format,
                                                             cfg.cache_dir), cfg, tok, special)
      val, bad = stream_rows(enc, seq_len, special), list(enc.bad)
      counts.update(reason.split(":")[0] for _, reason in bad)
  elif cfg.val_fraction > 0:
    if not any(p.parts["val"] for p in preps):
      raise DataError(f"{spec!r} has no validation documents: {_how_prepared(preps)}; set "
                      "data.val_fraction=0 (train without validation), or data.val_source, or "
                      "prepare it again with a larger --val_fraction")
    val = rows([x for p in preps for x in p.parts["val"]])
  return SourceRows(train, val, bad, counts, prepared=True)


def _how_prepared(preps: list[shards.Prepared]) -> str:
  """"it was prepared with --val_fraction=F, which held out none of its N documents"."""
  parts = []
  for p in preps:
    fraction, docs = p.settings["val_fraction"], p.totals["train_docs"] + p.totals["val_docs"]
    held = (f", which held out none of its {docs:,} documents" if fraction > 0 else
            " (no validation split)")
    parts.append(f"{p.root} was prepared with --val_fraction={fraction:g}{held}")
  return "; ".join(parts)


def encoded_splits(cfg, source, val_source, tok, special):
  """(train, val, bad records): val from `val_source`, else whole documents of `source`."""
  files = sources.resolve_sources(source, cfg.format, cfg.cache_dir)
  size = sum(os.path.getsize(f) for f in files)
  if size > RAW_WARN_BYTES:
    logging.warning("data source %r is %.1f GB of raw files, tokenized into memory by every "
                    "process: prepare it once (python -m infir2_jax.data.prepare) and train "
                    "on the prepared directory", source, size / 1e9)
  enc = encoded_lib.encode_files(files, cfg, tok, special)
  if val_source:
    val = encoded_lib.encode_files(
        sources.resolve_sources(val_source, cfg.format, cfg.cache_dir), cfg, tok, special)
    return enc, val, enc.bad + val.bad
  if not enc.keys:
    check_bad(enc.bad, cfg, source)
    raise DataError(f"no usable records in {source!r}{bad_note(enc.bad)}")
  if cfg.val_fraction > 0 and len(enc.keys) < 2:
    check_bad(enc.bad, cfg, source)
    raise DataError(f"a validation split by document needs >= 2 documents, but {source!r} "
                    f"has {len(enc.keys)} usable record{bad_note(enc.bad)}; set "
                    "--config.data.val_fraction=0 (train without validation: evaluation is "
                    "then off), or data.doc_separator to split it into documents, or "
                    "data.val_source")
  train_idx, val_idx = sources.split_documents(enc.keys, enc.sizes.tolist(), cfg.val_fraction)
  return enc.select(train_idx), enc.select(val_idx), list(enc.bad)


def stream_rows(enc: encoded_lib.Encoded, seq_len: int,
                special: tokenizer_lib.SpecialIds) -> packing.StreamRows:
  """Documents joined into one stream, each followed by <|endoftext|>."""
  off = enc.offsets
  n_docs = len(enc.lengths)
  # Each document shifts right by the EOS tokens inserted before it.
  tokens = np.full(len(enc.tokens) + n_docs, special.eos, np.int32)
  dest = np.arange(len(enc.tokens)) + np.repeat(np.arange(n_docs), enc.lengths)
  tokens[dest] = enc.tokens
  doc_ends = off[1:] + np.arange(1, n_docs + 1)
  return packing.StreamRows(tokens, doc_ends, seq_len, special.pad)


def chat_rows(enc: encoded_lib.Encoded, seq_len: int, special: tokenizer_lib.SpecialIds,
              seed: int | None) -> tuple[packing.SampleRows, list[tuple[str, str]]]:
  """Samples that fit (n - 1 <= L slots), best-fit packed in a seeded (or file) order."""
  slots = enc.lengths - 1
  fits = np.nonzero(slots <= seq_len)[0]
  too_long = [(enc.wheres[i], f"longer than seq_len: {slots[i]} > {seq_len} tokens")
              for i in np.nonzero(slots > seq_len)[0]]
  order = fits if seed is None else np.random.default_rng(seed).permutation(fits)
  packed = packing.pack_lengths(slots, seq_len, order)
  rows = packing.SampleRows(enc.tokens, enc.mask, enc.offsets, packed, seq_len, special.pad)
  return rows, too_long


def check_bad(bad: list[tuple[str, str]], cfg: DataConfig, source: str) -> None:
  """Raises on bad records with data.bad_records='raise'; else logs them."""
  if not bad:
    return
  counts = collections.Counter(reason.split(":")[0] for _, reason in bad)
  examples = "; ".join(f"{w}: {r}" for w, r in bad[:3])
  msg = (f"{len(bad)} bad records in {source!r} ({dict(counts)}), e.g. {examples}")
  if cfg.bad_records == "raise":
    raise DataError(msg + " (data.bad_records='raise'; 'skip' drops them)")
  logging.warning("%s; skipped (data.bad_records='skip')", msg)
