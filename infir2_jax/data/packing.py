"""Packing token sequences into fixed-length rows with segment ids, positions and loss masks.

Every row has L input slots. `segment_ids` number the documents (or chat samples) inside a
row from 1; 0 marks padding. `positions` restart at 0 with every segment (so RoPE positions
stay < L). `loss_mask[j]` is 1 iff `targets[j]` is a valid prediction from `inputs[j]`:
pre-training never predicts across a document boundary (the <|endoftext|> that ends a
document is a target of its own document, the next document's first token is not); chat
rows train only on assistant tokens. Segment ids let the model mask attention so packed
documents never see each other.

Legend: B rows, L = seq_len, N tokens in a stream.
"""

import bisect

import numpy as np

KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")


def empty_rows(batch: int, seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
  """All-padding rows (segment 0, loss mask 0)."""
  out = {k: np.zeros((batch, seq_len), np.int32) for k in KEYS}
  out["inputs"][:] = pad_id
  out["targets"][:] = pad_id
  out["loss_mask"] = out["loss_mask"].astype(np.float32)
  return out


def positions_in_segment(seg_BxL: np.ndarray) -> np.ndarray:
  """0, 1, 2, ... restarting wherever the segment id changes (0 on padding)."""
  B, L = seg_BxL.shape
  j_BxL = np.broadcast_to(np.arange(L), (B, L))
  is_start = np.ones((B, L), bool)
  is_start[:, 1:] = seg_BxL[:, 1:] != seg_BxL[:, :-1]
  start_BxL = np.maximum.accumulate(np.where(is_start, j_BxL, 0), axis=1)
  return np.where(seg_BxL > 0, j_BxL - start_BxL, 0).astype(np.int32)


class StreamRows:
  """Pre-training rows cut from one stream of documents, each followed by <|endoftext|>.

  Row r holds inputs tokens[r*L : r*L+L] and targets one further; consecutive rows share
  one token, so every token except the first is a target exactly once. A document that
  crosses a row boundary continues in the next row (its positions restart at 0 there).
  """

  def __init__(self, tokens: np.ndarray, doc_ends: np.ndarray, seq_len: int, pad_id: int):
    """tokens: [N] ids with each document's <|endoftext|> included; doc_ends: [D] ends."""
    self.tokens = np.asarray(tokens, np.int32)
    self.doc_ends = np.asarray(doc_ends, np.int64)
    self.seq_len = seq_len
    self.pad_id = pad_id
    n = len(self.tokens)
    self.num_rows = -(-(n - 1) // seq_len) if n > 1 else 0
    self.num_records, self.num_tokens = len(self.doc_ends), n

  def __len__(self) -> int:
    return self.num_rows

  def rows(self, row_ids: np.ndarray) -> dict[str, np.ndarray]:
    L, n = self.seq_len, len(self.tokens)
    start_B = np.asarray(row_ids, np.int64) * L
    idx_BxL1 = start_B[:, None] + np.arange(L + 1)
    valid_BxL = idx_BxL1[:, 1:] <= n - 1           # a target exists
    idx_BxL1 = np.minimum(idx_BxL1, n - 1)
    doc_BxL1 = np.searchsorted(self.doc_ends, idx_BxL1, side="right")
    seg_BxL = np.where(valid_BxL, doc_BxL1[:, :-1] - doc_BxL1[:, :1] + 1, 0)
    same_doc_BxL = doc_BxL1[:, :-1] == doc_BxL1[:, 1:]
    return {
        "inputs": np.where(valid_BxL, self.tokens[idx_BxL1[:, :-1]], self.pad_id),
        "targets": np.where(valid_BxL, self.tokens[idx_BxL1[:, 1:]], self.pad_id),
        "segment_ids": seg_BxL.astype(np.int32),
        "positions": positions_in_segment(seg_BxL),
        "loss_mask": (valid_BxL & same_doc_BxL).astype(np.float32),
    }


def pack_lengths(lengths: np.ndarray, capacity: int, order: np.ndarray) -> list[list[int]]:
  """Best-fit packing: each item (in `order`) goes to the fullest row it still fits in.

  Returns rows as lists of item indices. Items are never split, so a chat sample keeps its
  whole context; items longer than `capacity` must be filtered out before.
  """
  caps: list[int] = []     # remaining capacity of the open rows, ascending
  owners: list[int] = []   # row index for each entry of caps
  rows: list[list[int]] = []
  for i in order:
    need = int(lengths[i])
    if need > capacity:
      raise ValueError(f"item {i} has {need} tokens > row capacity {capacity}")
    k = bisect.bisect_left(caps, need)
    if k == len(caps):
      rows.append([int(i)])
      row, left = len(rows) - 1, capacity - need
    else:
      row, left = owners.pop(k), caps.pop(k) - need
      rows[row].append(int(i))
    if left > 0:
      k = bisect.bisect_left(caps, left)
      caps.insert(k, left)
      owners.insert(k, row)
  return rows


class SampleRows:
  """Chat rows: whole samples packed side by side, each its own segment.

  A sample of n tokens takes n-1 slots (inputs ids[:-1], targets ids[1:]); its loss mask
  is the assistant mask of the targets.
  """

  def __init__(self, tokens: np.ndarray, mask: np.ndarray, offsets: np.ndarray,
               packed: list[list[int]], seq_len: int, pad_id: int):
    """tokens/mask: [N] all samples concatenated; offsets: [S+1]; packed: rows of samples."""
    self.tokens = np.asarray(tokens, np.int32)
    self.mask = np.asarray(mask, np.float32)
    self.offsets = np.asarray(offsets, np.int64)
    self.packed = packed
    self.seq_len = seq_len
    self.pad_id = pad_id
    self.num_rows = len(packed)
    self.num_records = sum(len(r) for r in packed)
    self.num_tokens = int(sum(self.offsets[s + 1] - self.offsets[s] for r in packed for s in r))

  def __len__(self) -> int:
    return self.num_rows

  def rows(self, row_ids: np.ndarray) -> dict[str, np.ndarray]:
    out = empty_rows(len(row_ids), self.seq_len, self.pad_id)
    for b, r in enumerate(row_ids):
      j = 0
      for k, s in enumerate(self.packed[int(r)]):
        lo, hi = self.offsets[s], self.offsets[s + 1]
        n = hi - lo - 1
        out["inputs"][b, j:j + n] = self.tokens[lo:hi - 1]
        out["targets"][b, j:j + n] = self.tokens[lo + 1:hi]
        out["loss_mask"][b, j:j + n] = self.mask[lo + 1:hi]
        out["segment_ids"][b, j:j + n] = k + 1
        out["positions"][b, j:j + n] = np.arange(n)
        j += n
    return out
