"""make_data: sources -> packed rows -> a grain pipeline of batches.

Raw files are tokenized into memory (cached on disk); prepared directories (prepare.py)
are read row by row through memory maps (shards.py); several named sources are mixed by
weight (mixture.py). splits.py turns one source into its training and validation rows.

Batches are dicts of numpy arrays, each [B_local, L] (B_local = global batch / processes):
  inputs int32, targets int32 (inputs shifted by one), segment_ids int32 (1-based per
  document/sample in the row, 0 = padding), positions int32 (restart per segment),
  loss_mask float32 (1 where the target counts; the loss divides by its sum).

The training stream is infinite and reshuffled every epoch (grain's shuffle reseeds per
epoch). Global batch k is rows [k*G, (k+1)*G) of that stream and process p gets its
slice [p*B_local, (p+1)*B_local), so the union over processes does not depend on the
process count, and each process reads only the rows of its own slice. `iter(data.train)`
is a grain DatasetIterator: its get_state()/set_state() (or grain.checkpoint.CheckpointSave/
CheckpointRestore in orbax) resume it exactly; its state is the same in every process, so
checkpoint.py's IteratorSave/IteratorRestore also resume it under another process count.
"""

import collections
import dataclasses
import functools
import logging

from absl import flags
import grain
import numpy as np
import tokenizers

from infir2_jax.data import mixture
from infir2_jax.data import packing
from infir2_jax.data import splits
from infir2_jax.data import tokenizer as tokenizer_lib
from infir2_jax.data import workers
from infir2_jax.data.config import DataConfig
from infir2_jax.errors import ConfigError, DataError


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
  _val_sources: dict = dataclasses.field(repr=False, default_factory=dict)
  _counter: object = dataclasses.field(repr=False, default=None)

  def source_tokens(self, steps: int) -> dict[str, int]:
    """Training tokens (rows x seq_len) each mixture source gave the first `steps` global
    batches, exact ({} without a mixture). Cheap when `steps` grows call by call."""
    mix = self.stats.get("mixture")
    if not mix:
      return {}
    if self._counter is None:
      self._counter = mixture.SourceCounter([m["weight"] for m in mix.values()])
    rows = self._counter.rows(steps * self.global_batch_size)
    return {name: int(r) * self.seq_len for name, r in zip(mix, rows)}

  @property
  def eval_sources(self) -> list[str]:
    """Names of a mixture's sources with a validation split ([] without a mixture)."""
    return list(self._val_sources)

  def _eval_rows(self, source: str | None):
    if source is None:
      return self._val_rows
    if source not in self._val_sources:
      raise ConfigError(f"no validation split of source {source!r}; sources with one: "
                        f"{self.eval_sources}")
    return self._val_sources[source]

  def num_eval_batches(self, source: str | None = None) -> int:
    rows = self._eval_rows(source)
    return 0 if rows is None else -(-len(rows) // self.global_batch_size)

  def eval_batches(self, num_batches: int | None = None,
                   source: str | None = None) -> list[dict[str, np.ndarray]]:
    """The first `num_batches` validation batches (all if None/0), same on every call.

    Validation rows come in a fixed order; the last batch is padded with empty rows
    (loss_mask 0), so every validation token counts exactly once. With a mixture,
    `source=None` is the mixed validation set (mixture.py), `source=NAME` one source's.
    """
    rows = self._eval_rows(source)
    available = self.num_eval_batches(source)
    if available == 0:
      raise DataError("there is no validation split: set data.val_fraction > 0 or "
                      "data.val_source")
    n = available if not num_batches or num_batches <= 0 else num_batches
    if n > available:
      raise DataError(f"asked for {n} validation batches but the validation split has "
                      f"{available} of {self.global_batch_size}x{self.seq_len} tokens "
                      f"({rows.num_tokens} tokens); ask for fewer (0 = all) or "
                      "raise data.val_fraction")
    return [_local_batch(_val_ids(len(rows), self.global_batch_size, k),
                         rows=rows, lo=self.process_index * self.local_batch_size,
                         hi=(self.process_index + 1) * self.local_batch_size)
            for k in range(n)]

  def summary(self) -> str:
    tr, va = self.stats["train"], self.stats["val"]
    bad = sum(self.stats["bad_records"].values())
    text = (f"data {self.stats['source']!r} ({self.cfg.format}, tokenizer "
            f"{self.cfg.tokenizer!r}, vocab {self.vocab_size}): train {tr.records} records "
            f"{tr.tokens:,} tokens {tr.rows} rows ({self.steps_per_epoch} steps/epoch), "
            f"val {va.records} records {va.tokens:,} tokens {va.rows} rows "
            f"({self.num_eval_batches()} batches), {bad} bad records skipped")
    for name, m in self.stats.get("mixture", {}).items():
      text += (f"; {name}: weight {m['weight']:.3f}, realized {m['realized']:.3f} of the first "
               f"{m['realized_over_rows']} rows, train {m['train'].tokens:,} tokens")
    return text


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
  shuffle_seed = (cfg.shuffle_seed if cfg.shuffle_seed >= 0 else seed) % 2**32
  specs = mixture.parse(source, val_source, cfg.mixture)
  seeds = [shuffle_seed if not s.name else mixture.source_seed(shuffle_seed, s.name)
           for s in specs]
  built = [splits.build(cfg, s.spec, s.val_spec, tok, special, seq_len, seed_)
           for s, seed_ in zip(specs, seeds)]
  splits.check_bad([b for x in built for b in x.bad], cfg, source)
  for s, x in zip(specs, built):
    _check_rows(s, x, seq_len, global_batch_size, mixed=len(specs) > 1)

  local = global_batch_size // process_count
  lo, hi = process_index * local, (process_index + 1) * local
  if len(specs) == 1:
    train_ds = _train_dataset(built[0].train, cfg, global_batch_size, shuffle_seed, lo=lo,
                              hi=hi)
    val_rows = built[0].val
  else:
    train_ds = _mixed_train_dataset(built, specs, seeds, cfg, global_batch_size, lo, hi)
    val_rows = _mixed_val_rows(built, specs)
  counts = collections.Counter()
  for x in built:
    counts.update(x.bad_counts)
  held_out = ("held out when prepared" if all(x.prepared for x in built)
              else f"{cfg.val_fraction:g} of source")
  stats = {"source": source, "val_source": val_source or held_out,
           "train": _split(*[x.train for x in built]),
           "val": _split(*[x.val for x in built if x.val is not None]),
           "bad_records": dict(counts), "prepared": all(x.prepared for x in built)}
  if len(specs) > 1:
    rows = min(1000 * global_batch_size, 1 << 17)
    shares = mixture.realized([s.weight for s in specs], rows)
    stats["mixture"] = {s.name: {"weight": s.weight, "realized": r, "realized_over_rows": rows,
                                 "train": _split(x.train),
                                 "val": _split(x.val) if x.val is not None else None}
                        for s, x, r in zip(specs, built, shares)}
  num_train_rows = sum(len(x.train) for x in built)
  data = Data(cfg=cfg, train=train_ds, tokenizer=tok, special=special,
              vocab_size=tok.get_vocab_size(), seq_len=seq_len,
              global_batch_size=global_batch_size, local_batch_size=local,
              process_index=process_index,
              steps_per_epoch=num_train_rows // global_batch_size, stats=stats,
              _val_rows=val_rows if val_rows is not None and len(val_rows) else None,
              _val_sources={s.name: x.val for s, x in zip(specs, built)
                            if len(specs) > 1 and x.val is not None and len(x.val)})
  logging.info("%s", data.summary())
  return data


def _split(*rows) -> Split:
  return Split(sum(r.num_records for r in rows), sum(r.num_tokens for r in rows),
               sum(len(r) for r in rows))


def _check_rows(spec, built, seq_len: int, global_batch_size: int, mixed: bool) -> None:
  what = f"{spec.spec!r}" + (f" (source {spec.name!r})" if spec.name else "")
  train, val = built.train, built.val
  need = 1 if mixed else global_batch_size  # a mixture's batch takes rows of every source
  if len(train) < need:
    raise DataError(f"the training split of {what} has {len(train)} rows of {seq_len} tokens "
                    f"({train.num_tokens} tokens in {train.num_records} records), fewer than "
                    f"one global batch of {global_batch_size}{splits.bad_note(built.bad)}")
  if val is not None and not len(val):
    raise DataError(f"the validation split of {spec.val_spec or what} is empty "
                    f"({val.num_records} records, none fits in seq_len={seq_len}); raise "
                    "data.val_fraction, give data.val_source, or set data.val_fraction=0")
  if val is not None and len(val) < global_batch_size:
    logging.warning("the validation split of %s has %d rows, fewer than one global batch of %d:"
                    " its only eval batch is padded with empty rows", what, len(val),
                    global_batch_size)


def _train_dataset(rows, cfg: DataConfig, global_batch_size: int, seed: int, *, lo: int,
                   hi: int) -> grain.IterDataset:
  """Infinite batches of rows[lo:hi] of each global batch, reshuffled every epoch."""
  ds = (grain.MapDataset.range(len(rows))
        .shuffle(seed=seed)
        .repeat()                                       # infinite; a new order every epoch
        .batch(global_batch_size, drop_remainder=True)  # global row ids [G]
        .map(functools.partial(_local_batch, rows=rows, lo=lo, hi=hi)))
  return _iter(ds, cfg)


def _mixed_train_dataset(built, specs, seeds, cfg, global_batch_size, lo, hi):
  """Infinite batches of the sources' rows mixed by weight (mixture.py)."""
  ds = (mixture.train_rows([len(x.train) for x in built], [s.weight for s in specs], seeds)
        .batch(global_batch_size, drop_remainder=True)  # (source ids [G], row ids [G])
        .map(functools.partial(_local_mixed_batch, parts=[x.train for x in built], lo=lo,
                               hi=hi)))
  return _iter(ds, cfg)


def _local_mixed_batch(pairs, *, parts, lo: int, hi: int) -> dict[str, np.ndarray]:
  source_ids, row_ids = pairs
  return mixture.gather(parts, np.asarray(source_ids)[lo:hi], np.asarray(row_ids)[lo:hi])


def _mixed_val_rows(built, specs):
  with_val = [(s, x) for s, x in zip(specs, built) if x.val is not None and len(x.val)]
  if not with_val:
    return None
  index = mixture.val_index([len(x.val) for _, x in with_val], [s.weight for s, _ in with_val])
  return mixture.MixedRows([x.val for _, x in with_val], index)


def _iter(ds: grain.MapDataset, cfg: DataConfig) -> grain.IterDataset:
  ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=min(cfg.prefetch, 4),
                                            prefetch_buffer_size=cfg.prefetch))
  if cfg.num_workers > 0:
    # grain's worker processes read an absl flag; outside an absl app nothing parsed them.
    if not flags.FLAGS.is_parsed():
      flags.FLAGS.mark_as_parsed()
    ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=cfg.num_workers),
                        worker_init_fn=workers.exit_with_parent)
  return ds
