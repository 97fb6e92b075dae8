"""Several named sources mixed by weight: `data.mixture="web:0.7,math:0.2,code:0.1"` with
`data.source="web=/prep/web,math=/prep/math,code=/data/code/*.py"`.

Each source keeps its own rows, shuffled by its own seed (derived from the run's seed and
its name, so adding a source reorders no other) and repeated forever, each epoch in a new
order. grain's `MapDataset.mix` interleaves them in the weights' exact proportions, the same
pattern for every seed; global batch k is elements [k*G, (k+1)*G) of that interleave. The
realized proportions are a function of the weights alone and are counted from the same
interleave (`realized`). Validation is per source; the mixed validation set interleaves the
sources' validation rows the same way, until the first of them runs out.
"""

import dataclasses
import functools
import hashlib
import re

import grain
import numpy as np

from infir2_jax.data import packing
from infir2_jax.errors import ConfigError

_NAME = re.compile(r"^([A-Za-z_][A-Za-z0-9_.-]*)=(.+)$")


@dataclasses.dataclass(frozen=True)
class SourceSpec:
  name: str        # "" for the single unnamed source of a run without a mixture
  spec: str        # what data.source takes: globs, directories, prepared dirs, built-ins
  val_spec: str    # its validation source ("" = held out of `spec`)
  weight: float    # share of the training rows (1 without a mixture)


def parse(source: str, val_source: str, mixture: str) -> list[SourceSpec]:
  """The named sources of a mixture, or the one source of a run without one."""
  if not mixture.strip():
    return [SourceSpec("", source, val_source, 1.0)]
  weights = {}
  for item in (s.strip() for s in mixture.split(",") if s.strip()):
    name, _, w = item.rpartition(":")
    try:
      weight = float(w)
    except ValueError:
      weight = -1.0
    if not name or weight <= 0 or name in weights:
      raise ConfigError(f"data.mixture item {item!r} is not NAME:WEIGHT with a new name and a "
                        "weight > 0, e.g. data.mixture='web:0.7,math:0.3'")
    weights[name] = weight
  train, val = _named(source, "data.source", weights), _named(val_source, "data.val_source",
                                                              weights)
  missing = [n for n in weights if n not in train]
  if missing:
    raise ConfigError(f"data.mixture names {missing} but data.source has no NAME=... items for "
                      f"them; e.g. data.source='{missing[0]}=/path/to/{missing[0]}'")
  total = sum(weights.values())
  return [SourceSpec(n, train[n], val.get(n, ""), w / total) for n, w in weights.items()]


def _named(spec: str, key: str, weights: dict) -> dict[str, str]:
  """{name: comma-joined items} of `NAME=item,NAME=item,...`."""
  out: dict[str, list[str]] = {}
  for item in (s.strip() for s in spec.split(",") if s.strip()):
    m = _NAME.match(item)
    if not m or m.group(1) not in weights:
      raise ConfigError(f"{key} item {item!r} names no source of data.mixture "
                        f"({', '.join(weights)}): with a mixture every item is NAME=PATH")
    out.setdefault(m.group(1), []).append(m.group(2))
  return {n: ",".join(items) for n, items in out.items()}


def source_seed(seed: int, name: str) -> int:
  return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:4], "little")


def _tag(source: int, row) -> tuple[int, int]:
  return source, row


def train_rows(lengths: list[int], weights: list[float], seeds: list[int]) -> grain.MapDataset:
  """Infinite (source, row) pairs: each source shuffled per epoch, mixed by weight."""
  parents = [grain.MapDataset.range(n).shuffle(seed=s).repeat().map(functools.partial(_tag, i))
             for i, (n, s) in enumerate(zip(lengths, seeds))]
  return grain.MapDataset.mix(parents, weights)


def _labels(weights: list[float]) -> grain.MapDataset:
  """The source index of each training row of the interleave (the same for every seed)."""
  return grain.MapDataset.mix(
      [grain.MapDataset.range(1).repeat().map(functools.partial(_tag, i))
       for i in range(len(weights))], weights)


def realized(weights: list[float], rows: int) -> list[float]:
  """Each source's share of the first `rows` training rows (the interleave is seed-free)."""
  return (SourceCounter(weights).rows(rows) / max(rows, 1)).tolist()


class SourceCounter:
  """Rows of each source among the first n training rows, in O(1) per call.

  grain mixes by integer proportions (the weights scaled so the smallest is 100), which
  repeats its interleave every sum(proportions) rows: one period is counted once, at the
  first call, and n rows are whole periods plus a prefix of one. Where that period would be
  too long to count (extreme weight ratios) the rows are counted on from the last call.
  """

  _MAX_PERIOD = 1 << 20

  def __init__(self, weights: list[float]):
    self._labels, self._weights = _labels(weights), weights
    self._cum = None  # [period + 1, sources]: counts in the first j rows of a period
    self._n, self._counts = 0, np.zeros(len(weights), np.int64)

  def rows(self, n: int) -> np.ndarray:
    if self._cum is None:
      period = _interleave_period(self._weights)
      if period <= self._MAX_PERIOD:
        labels = np.fromiter((self._labels[j][0] for j in range(period)), np.int64, period)
        onehot = np.eye(len(self._weights), dtype=np.int64)[labels]
        self._cum = np.concatenate([np.zeros((1, len(self._weights)), np.int64),
                                    np.cumsum(onehot, axis=0)])
      else:
        self._cum = False
    if self._cum is not False:
      whole, rest = divmod(n, len(self._cum) - 1)
      return whole * self._cum[-1] + self._cum[rest]
    if n < self._n:  # asked for an earlier point (a resumed run): count again from 0
      self._n, self._counts[:] = 0, 0
    for j in range(self._n, n):
      self._counts[self._labels[j][0]] += 1
    self._n = n
    return self._counts.copy()


def _interleave_period(weights: list[float]) -> int:
  """Rows after which grain's weighted interleave repeats (sum of its integer proportions)."""
  try:
    from grain._src.python.dataset.transformations.mix import _float_to_int_proportions  # pylint: disable=g-import-not-at-top
  except ImportError:  # another grain: count row by row
    return SourceCounter._MAX_PERIOD + 1
  return sum(_float_to_int_proportions(weights))


class MixedRows:
  """Rows of several sources behind one `rows(ids)`: id j is element j of an interleave.

  With `index` a finite grain dataset of (source, row) pairs (the mixed validation set).
  """

  def __init__(self, parts: list, index: grain.MapDataset):
    self.parts, self.index = parts, index
    self.seq_len, self.pad_id = parts[0].seq_len, parts[0].pad_id
    self.num_rows = len(index)
    self.num_records = sum(p.num_records for p in parts)
    self.num_tokens = sum(p.num_tokens for p in parts)

  def __len__(self) -> int:
    return self.num_rows

  def pairs(self, ids) -> tuple[np.ndarray, np.ndarray]:
    got = [self.index[int(j)] for j in ids]
    return (np.asarray([s for s, _ in got], np.int64), np.asarray([r for _, r in got], np.int64))

  def rows(self, ids) -> dict[str, np.ndarray]:
    return gather(self.parts, *self.pairs(ids))


def val_index(lengths: list[int], weights: list[float]) -> grain.MapDataset:
  """Finite (source, row) pairs of the sources' validation rows, in the mixture's pattern."""
  parents = [grain.MapDataset.range(n).map(functools.partial(_tag, i))
             for i, n in enumerate(lengths)]
  return grain.MapDataset.mix(parents, weights)


def gather(parts: list, source_ids: np.ndarray, row_ids: np.ndarray) -> dict[str, np.ndarray]:
  """Rows (source_ids[b], row_ids[b]) of `parts`; a negative row id is an empty row."""
  out = packing.empty_rows(len(row_ids), parts[0].seq_len, parts[0].pad_id)
  for s in np.unique(source_ids[row_ids >= 0]):
    sel = np.flatnonzero((source_ids == s) & (row_ids >= 0))
    built = parts[int(s)].rows(row_ids[sel])
    for key in out:
      out[key][sel] = built[key]
  return out
