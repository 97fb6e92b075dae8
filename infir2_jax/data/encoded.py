"""Tokenized records of source files, cached on disk by content hash + tokenizer."""

import dataclasses
import hashlib
import io
import json
import logging
import pathlib

import numpy as np
import tokenizers

from infir2_jax.data import chat
from infir2_jax.data import fetch
from infir2_jax.data import sources
from infir2_jax.data import tokenizer as tokenizer_lib
from infir2_jax.data.config import DataConfig

CACHE_VERSION = 3  # 3: strict UTF-8, binary documents dropped


@dataclasses.dataclass
class Encoded:
  """Token ids of many records, concatenated. Chat records also carry an assistant mask."""
  tokens: np.ndarray           # uint32 [N]
  lengths: np.ndarray          # int64 [R] tokens per record
  keys: list[str]              # [R] stable record ids (order the validation split)
  sizes: np.ndarray            # int64 [R] characters per record (sizes the split)
  wheres: list[str]            # [R] file:line
  mask: np.ndarray | None      # uint8 [N] chat only: 1 on assistant tokens
  bad: list[tuple[str, str]]   # (where, reason) of records dropped before tokenizing

  @property
  def offsets(self) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)

  def select(self, idx: list[int]) -> "Encoded":
    """The records `idx` (strictly increasing); `bad` is kept as is."""
    if any(a >= b for a, b in zip(idx, idx[1:])):
      raise ValueError("select() needs strictly increasing indices")
    keep = np.zeros(len(self.lengths), bool)
    keep[idx] = True
    flat = np.repeat(keep, self.lengths)  # token-level selection, order preserved
    return Encoded(tokens=self.tokens[flat], lengths=self.lengths[idx],
                   keys=[self.keys[i] for i in idx], sizes=self.sizes[idx],
                   wheres=[self.wheres[i] for i in idx],
                   mask=None if self.mask is None else self.mask[flat], bad=self.bad)


def concat(parts: list[Encoded]) -> Encoded:
  chat_data = bool(parts) and parts[0].mask is not None
  cat = lambda xs, dtype: np.concatenate(xs).astype(dtype) if xs else np.zeros(0, dtype)
  return Encoded(
      tokens=cat([p.tokens for p in parts], np.uint32),
      lengths=cat([p.lengths for p in parts], np.int64),
      keys=[k for p in parts for k in p.keys], sizes=cat([p.sizes for p in parts], np.int64),
      wheres=[w for p in parts for w in p.wheres],
      mask=cat([p.mask for p in parts], np.uint8) if chat_data else None,
      bad=[b for p in parts for b in p.bad])


def encode_files(files: list[pathlib.Path], cfg: DataConfig, tok: tokenizers.Tokenizer,
                 special: tokenizer_lib.SpecialIds) -> Encoded:
  """Tokenizes every record of `files` (cached per file), in file order."""
  fp = tokenizer_lib.fingerprint(tok)
  cache = fetch.cache_root(cfg.cache_dir) / "tokens"
  paths = {}
  for f in files:
    # How the bytes are read is part of the key: the same bytes as .txt and as .jsonl are
    # different documents.
    key = {"v": CACHE_VERSION, "file": fetch.sha256_file(f), "tokenizer": fp,
           "format": cfg.format, "kind": sources.kind(f),
           "compression": f.suffix.lower() if f.suffix.lower() in sources.COMPRESSIONS else ""}
    if cfg.format == "pretrain":
      key.update(text_key=cfg.text_key, doc_separator=cfg.doc_separator)
    else:
      key.update(messages_key=cfg.messages_key, system_prompt=cfg.system_prompt)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    paths[f] = cache / f"{digest}.npz"
  loaded = {f: _load(p, str(f)) for f, p in paths.items()}
  missing = [f for f, enc in loaded.items() if enc is None]
  if missing:
    logging.info("tokenizing %d files (cached afterwards under %s)", len(missing), cache)
    literal = tokenizer_lib.literal_copy(tok)
    for f, enc in zip(missing, _encode_uncached(missing, cfg, literal, special)):
      _save(paths[f], enc, str(f))
      loaded[f] = enc
  return concat([loaded[f] for f in files])


def _encode_uncached(files, cfg, tok, special) -> list[Encoded]:
  read = [sources.read_records(f, cfg) for f in files]
  good, per_file_bad = [], []
  for fr in read:
    kept, bad = [], list(fr.bad)
    for rec in fr.records:
      if cfg.format == "chat":
        messages, reason = chat.validate(rec.value, cfg.messages_key)
        if messages is None:
          bad.append((rec.where, reason))
          continue
        kept.append((rec, messages))
      else:
        kept.append((rec, rec.value))
    good.append(kept)
    per_file_bad.append(bad)

  flat = [v for kept in good for _, v in kept]
  if cfg.format == "chat":
    encoded = chat.encode(tok, special, flat, cfg.system_prompt)
  else:
    encoded = [(np.asarray(e.ids, np.uint32), None)
               for e in tok.encode_batch_fast(flat, add_special_tokens=False)]
  out, k = [], 0
  for kept, bad in zip(good, per_file_bad):
    mine = encoded[k:k + len(kept)]
    k += len(kept)
    sizes = [len(v) if isinstance(v, str) else sum(len(m["content"]) for m in v)
             for _, v in kept]
    out.append(Encoded(
        tokens=np.concatenate([ids for ids, _ in mine]).astype(np.uint32) if mine
        else np.zeros(0, np.uint32),
        lengths=np.asarray([len(ids) for ids, _ in mine], np.int64),
        keys=[r.key for r, _ in kept], sizes=np.asarray(sizes, np.int64),
        wheres=[r.where for r, _ in kept],
        mask=(np.concatenate([m for _, m in mine]).astype(np.uint8) if mine
              else np.zeros(0, np.uint8)) if cfg.format == "chat" else None,
        bad=bad))
  return out


def _save(path: pathlib.Path, enc: Encoded, source: str) -> None:
  # Locations are stored without the file name: another file with the same bytes shares
  # this cache entry.
  rel = lambda wheres: np.asarray([w[len(source):] for w in wheres], dtype=str)
  arrays = dict(tokens=enc.tokens, lengths=enc.lengths, sizes=enc.sizes,
                keys=np.asarray(enc.keys, dtype=str), wheres=rel(enc.wheres),
                bad_where=rel([w for w, _ in enc.bad]),
                bad_reason=np.asarray([r for _, r in enc.bad], dtype=str))
  if enc.mask is not None:
    arrays["mask"] = enc.mask
  buf = io.BytesIO()
  np.savez(buf, **arrays)
  fetch.atomic_write(path, buf.getvalue())


def _load(path: pathlib.Path, source: str) -> Encoded | None:
  if not path.exists():
    return None
  try:
    with np.load(path, allow_pickle=False) as z:
      return Encoded(tokens=z["tokens"], lengths=z["lengths"], sizes=z["sizes"],
                     keys=z["keys"].tolist(), wheres=[source + w for w in z["wheres"].tolist()],
                     mask=z["mask"] if "mask" in z.files else None,
                     bad=[(source + w, r) for w, r in zip(z["bad_where"].tolist(),
                                                          z["bad_reason"].tolist())])
  except Exception as e:  # a truncated or foreign file: rebuild it
    logging.warning("ignoring unreadable token cache %s: %s", path, e)
    return None
