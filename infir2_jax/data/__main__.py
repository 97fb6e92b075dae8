"""Inspect a data configuration: `python -m infir2_jax.data --format=chat --seq_len=512`.

Prints the split summary and the first training row, segment by segment, with the tokens
that carry loss (targets whose loss_mask is 1) shown between ⟦ and ⟧.
"""

import argparse
import dataclasses
import logging

import numpy as np

from infir2_jax.data.config import DataConfig
from infir2_jax.data.pipeline import make_data


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  for f in dataclasses.fields(DataConfig):
    parser.add_argument(f"--{f.name}", type=type(f.default), default=f.default)
  parser.add_argument("--seq_len", type=int, default=256)
  parser.add_argument("--batch_size", type=int, default=16)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--row", type=int, default=0, help="which row of the first batch")
  args = vars(parser.parse_args())
  logging.basicConfig(level=logging.INFO, format="%(message)s")
  seq_len, batch_size, seed, row = (args.pop(k) for k in ("seq_len", "batch_size", "seed",
                                                          "row"))
  data = make_data(DataConfig(**args), seq_len=seq_len, global_batch_size=batch_size,
                   seed=seed)
  print(data.summary())
  batch = next(iter(data.train))
  seg, tgt, mask = (batch[k][row] for k in ("segment_ids", "targets", "loss_mask"))
  for s in range(1, int(seg.max()) + 1):
    sel = np.flatnonzero(seg == s)
    print(f"\n--- segment {s}: {len(sel)} tokens, {int(mask[sel].sum())} with loss ---")
    first_input = data.tokenizer.decode([int(batch["inputs"][row][sel[0]])],
                                        skip_special_tokens=False)
    # Decode runs of equal mask together so multi-byte characters stay whole.
    edges = [0] + [i for i in range(1, len(sel)) if mask[sel[i]] != mask[sel[i - 1]]]
    text = first_input
    for lo, hi in zip(edges, edges[1:] + [len(sel)]):
      run = data.tokenizer.decode(tgt[sel[lo:hi]].tolist(), skip_special_tokens=False)
      text += f"⟦{run}⟧" if mask[sel[lo]] else run
    print(text)
  print(f"\n--- padding: {int((seg == 0).sum())} slots ---")


if __name__ == "__main__":
  main()
