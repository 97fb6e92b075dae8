"""make_data: files -> tokens (cached) -> packed rows -> a grain pipeline of batches.

Batches are dicts of numpy arrays, each [B_local, L] (B_local = global batch / processes):
  inputs int32, targets int32 (inputs shifted by one), segment_ids int32 (1-based per
  document/sample in the row, 0 = padding), positions int32 (restart per segment),
  loss_mask float32 (1 where the target counts; the loss divides by its sum).

The training stream is infinite and reshuffled every epoch (grain's shuffle reseeds per
epoch). Global batch k is rows [k*G, (k+1)*G) of that stream and process p gets its
slice [p*B_local, (p+1)*B_local), so the union over processes does not depend on the
process count. `iter(data.train)` is a grain DatasetIterator: its get_state()/set_state()
(or grain.checkpoint.CheckpointSave/CheckpointRestore in orbax) resume it exactly.
"""

import collections
import dataclasses
import functools
import logging

from absl import flags
import grain
import numpy as np
import tokenizers

from infir2_jax.data import encoded as encoded_lib
from infir2_jax.data import packing
from infir2_jax.data import sources
from infir2_jax.data import tokenizer as tokenizer_lib
from infir2_jax.data import workers
from infir2_jax.data.config import DataConfig


@dataclasses.dataclass
class Split:
  records: int
  tokens: int
  rows: int


@dataclasses.dataclass
class Data:
  """The data of a run. `train` yields local batches forever; `eval_batches` is fixed."""
  cfg: DataConfig
  train: grain.IterDataset
  tokenizer: tokenizers.Tokenizer
  special: tokenizer_lib.SpecialIds
  vocab_size: int                   # tokens in the tokenizer (the model may pad beyond)
  seq_len: int
  global_batch_size: int
  local_batch_size: int
  process_index: int
  steps_per_epoch: int              # global batches per pass over the training rows
  stats: dict                       # train/val Split, bad record counts, sources
  _val_rows: object = dataclasses.field(repr=False, default=None)

  def num_eval_batches(self) -> int:
    if self._val_rows is None:
      return 0
    return -(-len(self._val_rows) // self.global_batch_size)

  def eval_batches(self, num_batches: int | None = None) -> list[dict[str, np.ndarray]]:
    """The first `num_batches` validation batches (all if None/0), same on every call.

    Validation rows come in a fixed order; the last batch is padded with empty rows
    (loss_mask 0), so every validation token counts exactly once.
    """
    available = self.num_eval_batches()
    if available == 0:
      raise ValueError("there is no validation split: set data.val_fraction > 0 or "
                       "data.val_source")
    n = available if not num_batches or num_batches <= 0 else num_batches
    if n > available:
      raise ValueError(f"asked for {n} validation batches but the validation split has "
                       f"{available} of {self.global_batch_size}x{self.seq_len} tokens "
                       f"({self.stats['val'].tokens} tokens); ask for fewer (0 = all) or "
                       "raise data.val_fraction")
    return [_local_batch(_val_ids(len(self._val_rows), self.global_batch_size, k),
                         rows=self._val_rows, lo=self.process_index * self.local_batch_size,
                         hi=(self.process_index + 1) * self.local_batch_size)
            for k in range(n)]

  def summary(self) -> str:
    tr, va = self.stats["train"], self.stats["val"]
    bad = sum(self.stats["bad_records"].values())
    return (f"data {self.stats['source']!r} ({self.cfg.format}, tokenizer "
            f"{self.cfg.tokenizer!r}, vocab {self.vocab_size}): train {tr.records} records "
            f"{tr.tokens:,} tokens {tr.rows} rows ({self.steps_per_epoch} steps/epoch), "
            f"val {va.records} records {va.tokens:,} tokens {va.rows} rows "
            f"({self.num_eval_batches()} batches), {bad} bad records skipped")


def _val_ids(num_rows: int, batch: int, k: int) -> np.ndarray:
  ids = np.arange(k * batch, (k + 1) * batch)
  return np.where(ids < num_rows, ids, -1)


def _local_batch(global_ids: np.ndarray, *, rows, lo: int, hi: int) -> dict[str, np.ndarray]:
  """Builds this process's rows of a global batch; id -1 is an empty (padding) row."""
  ids = np.asarray(global_ids)[lo:hi]
  out = packing.empty_rows(len(ids), rows.seq_len, rows.pad_id)
  real = ids >= 0
  if real.any():
    built = rows.rows(ids[real])
    for key in out:
      out[key][real] = built[key]
  return out


def default_sources(cfg: DataConfig) -> tuple[str, str]:
  """(source, val_source) with "default" resolved for the format."""
  if cfg.source.strip() != "default":
    return cfg.source, cfg.val_source
  if cfg.format == "pretrain":
    return "shakespeare", cfg.val_source
  return "champ", cfg.val_source or "champ_heldout"


def make_data(cfg: DataConfig, *, seq_len: int, global_batch_size: int, seed: int,
              process_index: int = 0, process_count: int = 1) -> Data:
  """Builds the training pipeline and validation rows.

  Args:
    cfg: data settings.
    seq_len: tokens per row (L).
    global_batch_size: rows per step over all processes (G); divisible by process_count.
    seed: the run's seed; orders the data unless cfg.shuffle_seed >= 0.
    process_index: this process (jax.process_index()).
    process_count: number of processes (jax.process_count()).
  """
  if seq_len < 2 or global_batch_size < 1:
    raise ValueError(f"need seq_len >= 2 and global_batch_size >= 1, got {seq_len}, "
                     f"{global_batch_size}")
  if process_count < 1 or not 0 <= process_index < process_count:
    raise ValueError(f"process_index={process_index} is not in [0, {process_count})")
  if global_batch_size % process_count:
    raise ValueError(f"global_batch_size={global_batch_size} is not divisible by "
                     f"process_count={process_count}")
  tok = tokenizer_lib.load_tokenizer(cfg.tokenizer, cache_dir=cfg.cache_dir)
  special = tokenizer_lib.special_ids(tok)
  source, val_source = default_sources(cfg)
  train, val, bad = _encoded_splits(cfg, source, val_source, tok, special)
  shuffle_seed = (cfg.shuffle_seed if cfg.shuffle_seed >= 0 else seed) % 2**32
  if cfg.format == "chat":
    train_rows, too_long = _chat_rows(train, seq_len, special, shuffle_seed)
    val_rows, val_too_long = _chat_rows(val, seq_len, special, None)
    bad += too_long + val_too_long
  else:
    train_rows, val_rows = (_stream_rows(e, seq_len, special) for e in (train, val))
  _check_bad(bad, cfg, source)

  if len(train_rows) < global_batch_size:
    raise ValueError(f"the training split of {source!r} has {len(train_rows)} rows of "
                     f"{seq_len} tokens ({int(train.lengths.sum())} tokens in "
                     f"{len(train.keys)} records), fewer than one global batch of "
                     f"{global_batch_size}")
  if (cfg.val_fraction > 0 or val_source) and not len(val_rows):
    raise ValueError(f"the validation split of {val_source or source!r} is empty "
                     f"({len(val.keys)} records, none fits in seq_len={seq_len}); raise "
                     "data.val_fraction, give data.val_source, or set data.val_fraction=0")
  if 0 < len(val_rows) < global_batch_size:
    logging.warning("the validation split has %d rows, fewer than one global batch of %d: "
                    "its only eval batch is padded with empty rows", len(val_rows),
                    global_batch_size)

  local = global_batch_size // process_count
  train_ds = _train_dataset(train_rows, cfg, global_batch_size, shuffle_seed,
                            lo=process_index * local, hi=(process_index + 1) * local)
  counts = collections.Counter(reason.split(":")[0] for _, reason in bad)
  stats = {"source": source, "val_source": val_source or f"{cfg.val_fraction:g} of source",
           "train": Split(train_rows.num_records, train_rows.num_tokens, len(train_rows)),
           "val": Split(val_rows.num_records, val_rows.num_tokens, len(val_rows)),
           "bad_records": dict(counts)}
  data = Data(cfg=cfg, train=train_ds, tokenizer=tok, special=special,
              vocab_size=tok.get_vocab_size(), seq_len=seq_len,
              global_batch_size=global_batch_size, local_batch_size=local,
              process_index=process_index,
              steps_per_epoch=len(train_rows) // global_batch_size, stats=stats,
              _val_rows=val_rows if len(val_rows) else None)
  logging.info("%s", data.summary())
  return data


def _encoded_splits(cfg, source, val_source, tok, special):
  """(train, val, bad records): val from `val_source`, else whole documents of `source`."""
  enc = encoded_lib.encode_files(sources.resolve_sources(source, cfg.format, cfg.cache_dir),
                                 cfg, tok, special)
  if val_source:
    val = encoded_lib.encode_files(
        sources.resolve_sources(val_source, cfg.format, cfg.cache_dir), cfg, tok, special)
    return enc, val, enc.bad + val.bad
  if not enc.keys:
    _check_bad(enc.bad, cfg, source)
    raise ValueError(f"no usable records in {source!r} ({len(enc.bad)} bad)")
  train_idx, val_idx = sources.split_documents(enc.keys, enc.sizes.tolist(), cfg.val_fraction)
  return enc.select(train_idx), enc.select(val_idx), list(enc.bad)


def _train_dataset(rows, cfg: DataConfig, global_batch_size: int, seed: int, *, lo: int,
                   hi: int) -> grain.IterDataset:
  """Infinite batches of rows[lo:hi] of each global batch, reshuffled every epoch."""
  ds = (grain.MapDataset.range(len(rows))
        .shuffle(seed=seed)
        .repeat()                                       # infinite; a new order every epoch
        .batch(global_batch_size, drop_remainder=True)  # global row ids [G]
        .map(functools.partial(_local_batch, rows=rows, lo=lo, hi=hi)))
  ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=min(cfg.prefetch, 4),
                                            prefetch_buffer_size=cfg.prefetch))
  if cfg.num_workers > 0:
    # grain's worker processes read an absl flag; outside an absl app nothing parsed them.
    if not flags.FLAGS.is_parsed():
      flags.FLAGS.mark_as_parsed()
    ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=cfg.num_workers),
                        worker_init_fn=workers.exit_with_parent)
  return ds


def _stream_rows(enc: encoded_lib.Encoded, seq_len: int,
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


def _chat_rows(enc: encoded_lib.Encoded, seq_len: int, special: tokenizer_lib.SpecialIds,
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


def _check_bad(bad: list[tuple[str, str]], cfg: DataConfig, source: str) -> None:
  if not bad:
    return
  counts = collections.Counter(reason.split(":")[0] for _, reason in bad)
  examples = "; ".join(f"{w}: {r}" for w, r in bad[:3])
  msg = (f"{len(bad)} bad records in {source!r} ({dict(counts)}), e.g. {examples}")
  if cfg.bad_records == "raise":
    raise ValueError(msg + " (data.bad_records='raise'; 'skip' drops them)")
  logging.warning("%s; skipped (data.bad_records='skip')", msg)
