"""Fused FP8 quantization benchmark: GB/s of our kernels and of XLA vs device copy bandwidth.

  PYTHONPATH=. python3 benchmarks/quantize.py --out benchmarks/results/quantize_h200.json

GB/s counts the fewest bytes: the bf16 input read once plus every output written
once (q, scales, and qT, sT for the wgrad layout). Copy bandwidth is a bf16
x -> -x pass (read + write), timed the same way. Several input copies rotate so
repeated calls do not run out of L2. Every output is checked bit for bit against
the XLA reference (NaN == NaN) on the same input.
"""
import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp

from infir2_jax.precision import kernels
from infir2_jax.bench import tools as benchtools

ACTIVATIONS = [(16384, 1536), (16384, 8960), (32768, 8192), (16384, 3584)]
WEIGHTS = [(1536, 8960), (8960, 1536), (3584, 18944)]
COPY_D2D_GBPS = 4300.0  # device-to-device copy measured on this card (KINDS.md), read + write


def _rotating(fn, n_sets):
  """fn over n_sets inputs inside one jit, so the timed call reads each set once."""
  return jax.jit(lambda xs: [fn(x) for x in xs])


def _bytes(x, outs):
  return x.size * x.dtype.itemsize + sum(o.size * o.dtype.itemsize for o in outs)


def _bit_equal(a, b):
  a = jnp.asarray(a, jnp.float32)
  b = jnp.asarray(b, jnp.float32)
  return bool(jnp.all((a == b) | (jnp.isnan(a) & jnp.isnan(b))))


def _xla_precision(kind):
  """The XLA path the recipe would run otherwise (infir2_jax.precision, else our reference)."""
  try:
    from infir2_jax.precision import quantize as pq  # the function
    if kind == "tiles":
      return lambda x: pq(x, (1, 128)), "infir2_jax.precision.quantize"
    if kind == "tilesT":
      return lambda x: (*pq(x, (1, 128)), *pq(x.T, (1, 128))), "infir2_jax.precision.quantize"
    return lambda x: pq(x, (128, 128)), "infir2_jax.precision.quantize"
  except ImportError:
    ref = {"tiles": lambda x: kernels.quantize_tiles_reference(x),
           "tilesT": lambda x: kernels.quantize_tiles_reference(x, with_transpose=True),
           "blocks": lambda x: kernels.quantize_blocks_reference(x)}[kind]
    return ref, "infir2_jax.precision.kernels.quantize_*_reference"


def bench(kind, shape, n_sets, iters, seed):
  keys = jax.random.split(jax.random.key(seed), n_sets)
  xs = [jax.random.normal(k, shape, jnp.bfloat16) * 3 for k in keys]
  ours = {"tiles": lambda x: kernels.quantize_tiles(x),
          "tilesT": lambda x: kernels.quantize_tiles(x, with_transpose=True),
          "blocks": lambda x: kernels.quantize_blocks(x)}[kind]
  xla, xla_name = _xla_precision(kind)
  row = {"kind": kind, "shape": list(shape), "xla_impl": xla_name}
  outs = jax.jit(ours)(xs[0])
  nbytes = _bytes(xs[0], outs)
  row["bytes"] = nbytes
  refs = jax.jit(xla)(xs[0])
  row["bit_identical_to_xla"] = all(_bit_equal(o, r) for o, r in zip(outs, refs))
  for name, fn in (("ours", ours), ("xla", xla), ("copy", lambda x: -x)):
    ms = benchtools.device_ms(_rotating(fn, n_sets), (xs,), iters) / n_sets
    b = nbytes if name != "copy" else 2 * xs[0].size * 2
    row[name] = {"us": ms * 1e3, "gbps": b / (ms * 1e-3) / 1e9}
  row["ours_fraction_of_copy_bw"] = row["ours"]["gbps"] / row["copy"]["gbps"]
  row["ours_fraction_of_4p3_TBps"] = row["ours"]["gbps"] / COPY_D2D_GBPS
  row["xla_fraction_of_copy_bw"] = row["xla"]["gbps"] / row["copy"]["gbps"]
  return row


def main(argv):
  p = argparse.ArgumentParser()
  p.add_argument("--out", required=True)
  p.add_argument("--iters", type=int, default=10)
  p.add_argument("--sets", type=int, default=2)
  p.add_argument("--deadline", type=float, default=1e9)
  args = p.parse_args(argv)
  t0 = time.time()
  result = {"info": benchtools.run_info(["benchmarks/quantize.py", *argv]), "rows": [],
            "skipped": []}
  todo = [(kind, shape) for shape, blocks in zip(ACTIVATIONS, WEIGHTS + [None])
          for kind, shape in (("tiles", shape), ("tilesT", shape), ("blocks", blocks))
          if shape is not None]
  for i, (kind, shape) in enumerate(todo):
    if time.time() - t0 > args.deadline:
      result["skipped"].append([kind, list(shape)])
      continue
    try:
      row = bench(kind, shape, args.sets, args.iters, seed=i)
    except Exception as e:  # noqa: BLE001 - record and go on
      row = {"kind": kind, "shape": list(shape), "error": f"{type(e).__name__}: {str(e)[:400]}"}
    result["rows"].append(row)
    if "error" in row:
      print(f"{kind:7s} {str(shape):16s} ERROR {row['error']}", flush=True)
    else:
      print(f"{kind:7s} {str(shape):16s} ours {row['ours']['us']:8.1f} us {row['ours']['gbps']:7.0f} GB/s"
            f" ({row['ours_fraction_of_copy_bw']:.0%} of copy {row['copy']['gbps']:.0f})"
            f" xla {row['xla']['us']:8.1f} us ({row['xla_fraction_of_copy_bw']:.0%})"
            f" bit-identical={row['bit_identical_to_xla']}", flush=True)
    result["info"]["timing_method"] = benchtools.timing_method()
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)
  fr = [r["ours_fraction_of_copy_bw"] for r in result["rows"] if "ours" in r]
  result["summary"] = {"min_fraction_of_copy_bw": min(fr) if fr else None,
                       "max_fraction_of_copy_bw": max(fr) if fr else None}
  with open(args.out, "w") as f:
    json.dump(result, f, indent=1)
  print(json.dumps(result["summary"]))


if __name__ == "__main__":
  main(sys.argv[1:])
