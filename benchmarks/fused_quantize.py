"""Quantization fused into SwiGLU and its backward, against the separate passes it replaces.

  PYTHONPATH=. python3 benchmarks/fused_quantize.py --out benchmarks/results/fused_quantize_h200.json

For each MLP shape (tokens x F of the 1.5B and 7B at 16k tokens per step), side by side in
one process, device time (CUPTI) of:
  fwd   separate: XLA's SwiGLU writes h (bf16), then kernels.quantize_tiles(h, with_transpose)
        fused:    kernels.swiglu_quantize(gu)
  bwd   separate: XLA's SwiGLU backward writes dgate and dup (bf16), then quantize_tiles of
                  each with_transpose (the path before the fused MLP)
        fused:    kernels.swiglu_bwd_quantize(dh, gu)
GB/s counts the fewest bytes of the fused op (inputs read once, fp8 outputs and scales
written once); "of copy" is against an XLA bf16 x -> -x pass timed the same way. Outputs of
both paths are compared (fraction of fp8 entries that differ: the two SwiGLUs may round a
value differently in its last bit). Every kernels.fused_quantize.FusedConfig is timed too
(`configs`), the default one as "fused".
"""
import argparse
import json
import sys

import itertools

import jax
import jax.numpy as jnp
import numpy as np

from infir2_jax.bench import tools as benchtools
from infir2_jax.precision import kernels
from infir2_jax.precision.kernels import fused_quantize as fq

SHAPES = [(16384, 8960), (16384, 18944)]
CONFIGS = [fq.FusedConfig(cols, alias) for cols, alias in itertools.product((64, 128),
                                                                           (True, False))]
# the persistent, pipelined kernel (session 21): one and two programs per H200 SM
CONFIGS += [fq.FusedConfig(64, False, programs=n) for n in (132, 264)]


def _inputs(m, f, n_sets):
  keys = jax.random.split(jax.random.key(m + f), 2 * n_sets)
  gus = [jax.random.normal(k, (m, 2 * f), jnp.bfloat16) * 2 for k in keys[:n_sets]]
  dhs = [jax.random.normal(k, (m, f), jnp.bfloat16) * 1e-2 for k in keys[n_sets:]]
  return gus, dhs


def _rotating(fn):
  """fn over several input sets in one jit, so each timed call reads every set once (no L2)."""
  return jax.jit(lambda sets: [fn(*s) for s in sets])


def _separate_fwd(gu):
  return kernels.quantize_tiles(fq.swiglu_reference(gu), with_transpose=True)


def _separate_bwd(dh, gu):
  dgu = fq.swiglu_bwd_reference(dh, gu)
  f = dh.shape[1]
  return (kernels.quantize_tiles(dgu[:, :f], with_transpose=True),
          kernels.quantize_tiles(dgu[:, f:], with_transpose=True))


def _nbytes(arrays):
  return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(arrays))


def _differ(a, b):
  a = np.asarray(jnp.asarray(a, jnp.float32))
  b = np.asarray(jnp.asarray(b, jnp.float32))
  return float(np.mean((a != b) & ~(np.isnan(a) & np.isnan(b))))


def bench(m, f, n_sets, iters):
  gus, dhs = _inputs(m, f, n_sets)
  row = {"shape": [m, f]}
  cases = {
      "fwd": ((lambda gu: kernels.swiglu_quantize(gu)), _separate_fwd, [(g,) for g in gus]),
      "bwd": ((lambda dh, gu: kernels.swiglu_bwd_quantize(dh, gu)), _separate_bwd,
              list(zip(dhs, gus))),
  }
  for name, (fused, separate, sets) in cases.items():
    out_f = jax.jit(fused)(*sets[0])
    out_s = jax.jit(separate)(*sets[0])
    if name == "bwd":  # the separate path's two quantizations, side by side as the fused one
      (q1, s1, t1, u1), (q2, s2, t2, u2) = out_s
      out_s = (jnp.concatenate([q1, q2], 1), jnp.concatenate([s1, s2], 1),
               jnp.concatenate([t1, t2], 0), jnp.concatenate([u1, u2], 0))
    nbytes = _nbytes(sets[0]) + _nbytes(out_f)
    entry = {"bytes": nbytes, "q_entries_differ": _differ(out_f[0], out_s[0]),
             "qT_entries_differ": _differ(out_f[2], out_s[2]),
             "scales_differ": _differ(out_f[1], out_s[1])}
    for path, fn in (("fused", fused), ("separate", separate)):
      ms = benchtools.device_ms(_rotating(fn), (sets,), iters) / n_sets
      entry[path] = {"us": ms * 1e3, "gbps": nbytes / (ms * 1e-3) / 1e9}
    entry["fused_vs_separate"] = entry["fused"]["us"] / entry["separate"]["us"]
    entry["configs"] = {}
    for config in CONFIGS:
      kernel = kernels.swiglu_quantize if name == "fwd" else kernels.swiglu_bwd_quantize
      fn = lambda *a, config=config, kernel=kernel: kernel(*a, config=config)
      ms = benchtools.device_ms(_rotating(fn), (sets,), iters) / n_sets
      label = f"cols{config.producer_cols}_alias{int(config.alias_outputs)}"
      label += f"_programs{config.programs}" if config.programs else ""
      entry["configs"][label] = {
          "us": ms * 1e3, "gbps": nbytes / (ms * 1e-3) / 1e9}
    entry["separate_kernels"] = benchtools.kernel_breakdown(jax.jit(separate), sets[0])
    row[name] = entry
  x = gus[0]
  copy_ms = benchtools.device_ms(_rotating(lambda x: -x), ([(g,) for g in gus],), iters) / n_sets
  row["copy_gbps"] = 2 * x.size * 2 / (copy_ms * 1e-3) / 1e9
  for name in cases:
    row[name]["fused_fraction_of_copy_bw"] = row[name]["fused"]["gbps"] / row["copy_gbps"]
  return row


def main(argv):
  p = argparse.ArgumentParser()
  p.add_argument("--out", required=True)
  p.add_argument("--iters", type=int, default=10)
  p.add_argument("--sets", type=int, default=2)
  args = p.parse_args(argv)
  result = {"info": benchtools.run_info(["benchmarks/fused_quantize.py", *argv]), "rows": []}
  for m, f in SHAPES:
    try:
      row = bench(m, f, args.sets, args.iters)
    except Exception as e:  # noqa: BLE001 - record and go on
      row = {"shape": [m, f], "error": f"{type(e).__name__}: {str(e)[:600]}"}
      print(f"{m}x{f} ERROR {row['error']}", flush=True)
    else:
      for name in ("fwd", "bwd"):
        e = row[name]
        print(f"{name} {m}x{f}: fused {e['fused']['us']:7.1f} us ({e['fused']['gbps']:5.0f} GB/s, "
              f"{e['fused_fraction_of_copy_bw']:.0%} of copy), separate {e['separate']['us']:7.1f}"
              f" us: {e['fused_vs_separate']:.3f}x; q differs in {e['q_entries_differ']:.1e}; "
              + ", ".join(f"{k} {v['us']:.0f}" for k, v in e["configs"].items()), flush=True)
    result["rows"].append(row)
    result["info"]["timing_method"] = benchtools.timing_method()
    with open(args.out, "w") as fh:
      json.dump(result, fh, indent=1)


if __name__ == "__main__":
  main(sys.argv[1:])
