"""One train step's GPU kernel time from a jax.profiler trace: by kind, by kernel, and the
in-step TFLOP/s of each of our FP8 GEMM shapes (their kernel names carry the problem)."""

import collections
import gzip
import json
import os

from infir2_jax.precision.kernels.gemm import KERNEL_NAME as GEMM_KERNEL, parse_gemm_kernel_name
from infir2_jax.precision.kernels.fused_quantize import FUSED_KERNEL_NAME
from infir2_jax.precision.kernels.quantize import KERNEL_NAME as QUANTIZE_KERNEL

GEMM_KEYS = ("gemm", "cublas", "cutlass", "xmma", "sm90", "nvjet", "matmul", "dot")
ATTENTION_KEYS = ("fmha", "flash", "cudnn", "attention", "sdpa")
PALLAS_KEYS = ("block_scaled", "fp8_gemm", "quantize", "mosaic", "pallas")


def kernel_kind(name: str) -> str:
  """attention | pallas_fp8_gemm | pallas_quantize | pallas_fused_quantize (quantization
  fused into its producer, e.g. SwiGLU) | pallas_fp8 | gemm | other."""
  name = name.lower()
  if any(s in name for s in ATTENTION_KEYS):
    return "attention"
  if GEMM_KERNEL in name:  # our kernels' names (kernels/gemm.py, quantize.py, fused_quantize.py)
    return "pallas_fp8_gemm"
  if QUANTIZE_KERNEL in name:
    return "pallas_quantize"
  if FUSED_KERNEL_NAME in name:
    return "pallas_fused_quantize"
  if any(s in name for s in PALLAS_KEYS):
    return "pallas_fp8"
  if any(s in name for s in GEMM_KEYS):
    return "gemm"
  return "other"


def fp8_gemm_rates(per_kernel_us: dict, calls: dict) -> list[dict]:
  """Our GEMM kernels in the step, one row per problem: calls, ms and achieved TFLOP/s
  (padded M x N x K, split-K partial sums not included), slowest total first."""
  rows = []
  for name, us in per_kernel_us.items():
    problem = parse_gemm_kernel_name(name)
    if problem is None or not us:
      continue
    flops = 2.0 * problem["m"] * problem["n"] * problem["k"] * calls[name]
    rows.append({**problem, "kernel": name, "calls": calls[name], "ms": us / 1e3,
                 "tflops": flops / (us * 1e-6) / 1e12})
  return sorted(rows, key=lambda r: -r["ms"])


def concurrency(intervals) -> dict:
  """How much GPU kernels ran at the same time: [(start_us, end_us, kind)] ->
  busy_ms (the union), summed_ms, and per kind the ms during which another kernel ran too.

  A kernel that shares the SMs with another (XLA runs some copies and fusions on other
  streams) takes longer than alone, and a persistent kernel sized for every SM (ours) waits
  for SMs that another kernel holds."""
  edges = sorted([(iv[0], 1, i) for i, iv in enumerate(intervals)] +
                 [(iv[1], -1, i) for i, iv in enumerate(intervals)])
  active, last, busy = set(), None, 0.0
  overlapped = collections.Counter()
  for t, delta, i in edges:
    if last is not None and active:
      busy += t - last
      if len(active) > 1:
        for j in active:
          overlapped[intervals[j][2]] += t - last
    (active.add if delta > 0 else active.discard)(i)
    last = t
  return {"busy_ms": busy / 1e3, "summed_ms": sum(iv[1] - iv[0] for iv in intervals) / 1e3,
          "overlapped_ms_by_kind": {k: v / 1e3 for k, v in overlapped.items()}}


def idle_gaps(intervals, top: int = 12, threshold_us: float = 10.0) -> dict:
  """Where the GPU waits inside one traced call: [(start_us, end_us, kind, name)] ->
  span_ms (first kernel's start to last kernel's end), idle_ms (span minus the union of
  kernels), the gaps between kernels by size, and the largest with the kernels around them.

  A gap is time no kernel runs: the host had not launched the next one yet (launch-bound
  stretches of short kernels), a host-side step between kernels, or a synchronization."""
  if not intervals:
    return {}
  ordered = sorted(intervals, key=lambda iv: iv[0])
  gaps, end, before = [], ordered[0][1], ordered[0]
  for iv in ordered[1:]:
    if iv[0] > end:
      gaps.append((iv[0] - end, before, iv))
    if iv[1] >= end:
      end, before = iv[1], iv
  span = end - ordered[0][0]
  idle = sum(g for g, _, _ in gaps)
  sizes = [g for g, _, _ in gaps]
  buckets = {"<2us": (0, 2), "2-10us": (2, 10), "10-100us": (10, 100), "0.1-1ms": (100, 1e3),
             ">=1ms": (1e3, float("inf"))}
  by_size = {k: {"count": sum(lo <= g < hi for g in sizes),
                 "ms": sum(g for g in sizes if lo <= g < hi) / 1e3}
             for k, (lo, hi) in buckets.items()}
  largest = sorted(gaps, key=lambda g: -g[0])[:top]
  return {"span_ms": span / 1e3, "idle_ms": idle / 1e3, "kernels": len(intervals),
          "gaps_over_threshold": sum(g >= threshold_us for g in sizes),
          "threshold_us": threshold_us, "gaps_by_size": by_size,
          "largest_gaps": [{"us": g, "after": str(a[3])[:100], "before": str(b[3])[:100]}
                           for g, a, b in largest]}


def summarize_trace(trace_dir: str, top: int = 25) -> dict:
  """Milliseconds of GPU kernels by kind, the top kernels, and our GEMMs' in-step rates."""
  paths = sorted(os.path.join(r, f) for r, _, fs in os.walk(trace_dir) for f in fs
                 if f.endswith(".json.gz"))
  if not paths:
    return {"error": f"no trace (*.json.gz) under {trace_dir}"}
  with gzip.open(paths[0], "rt") as f:
    trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  names = {e.get("pid"): str(e.get("args", {}).get("name", "")) for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  gpu_pids = {pid for pid, n in names.items() if "gpu" in n.lower() or "/device:" in n.lower()}
  gpu_pids = {pid for pid in gpu_pids if "cpu" not in names[pid].lower()}
  kinds = collections.Counter()
  per_kernel = collections.Counter()
  calls = collections.Counter()
  intervals = []
  for e in events:
    if e.get("ph") != "X" or "dur" not in e or e.get("pid") not in gpu_pids:
      continue
    name = str(e.get("name", ""))
    kind = kernel_kind(name)
    kinds[kind] += e["dur"]
    per_kernel[name] += e["dur"]
    calls[name] += 1
    if "ts" in e:
      intervals.append((float(e["ts"]), float(e["ts"]) + float(e["dur"]), kind, name))
  return {"ms_by_kind": {k: v / 1e3 for k, v in kinds.items()},
          "device_ms_total": sum(kinds.values()) / 1e3,
          "gpu_processes": sorted(names[p] for p in gpu_pids),
          "all_processes": sorted(set(names.values()))[:20], "trace_file": paths[0],
          "top_kernels_ms": [[n[:160], kernel_kind(n), d / 1e3, calls[n]]
                             for n, d in per_kernel.most_common(top)],
          # every kernel: {name: [ms, calls]}, for attributing "other" op by op
          "kernels_ms": {n[:200]: [d / 1e3, calls[n]] for n, d in per_kernel.items()},
          "fp8_gemm_by_problem": fp8_gemm_rates(per_kernel, calls),
          "concurrency": concurrency(intervals), "idle": idle_gaps(intervals)}
