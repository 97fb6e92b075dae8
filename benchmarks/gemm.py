"""Block-scaled FP8 GEMM benchmark on one Hopper GPU: ours vs XLA bf16 / FP8 / dequant.

  PYTHONPATH=. python3 benchmarks/gemm.py --out benchmarks/results/gemm_h200.json [--sweep]

Shapes: 8192^3 and every linear of Qwen2.5-1.5B / 7B at 16384 tokens in its fprop
(M=T, N=out, K=in), dgrad (M=T, N=in, K=out) and wgrad (M=in, N=out, K=T)
shapes. For each: TFLOP/s of our kernel, of XLA bf16 jnp.dot, of XLA FP8 with
per-tensor scales (K-major B), of XLA dequantize-then-bf16 and (--cublas_blockwise,
through PyTorch) of cuBLAS's own 1x128 / 128x128 block-scaled GEMM, all in the same
run; ratios to XLA bf16; ||out - ref|| / ||ref|| of ours against a float64
reference on sampled rows, on fresh random inputs quantized by the reference
quantizer. Results are written after every shape.

Ours is timed twice: `ours` through block_scaled_matmul (canonical scales, so XLA's layout
ops for them are included) and `ours_kernel_layout` through matmul_kernel_scales with the
scales built beforehand, as cuBLAS's are and as a train step feeds the kernel (its quantizers
write that layout; benchmarks/linear_kernels.py). `ours_kernels` (--breakdown) lists the
kernels of one `ours` call. All times are CUPTI kernel sums; cuBLAS's come from
torch.profiler in a last pass, since its CUPTI subscription blocks the Mosaic GPU profiler.

--rotate N (default 3) times every GEMM over N operand sets in one jitted call (each set read
once, time / N), so operands are not L2-resident from the previous call, as in a train step;
--rotate 1 reruns one set (session 3's numbers: the bf16 rates then matched the train step's
GEMM time, ours came out 22% faster than in the step, see NOTES_e2e.md).
"""
import argparse
import ast
import dataclasses
import json
import math
import sys
import time

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from infir2_jax.precision import kernels
from infir2_jax.bench import tools as benchtools

import cublas_blockwise  # benchmarks/, next to this script

TOKENS = 16384
MODELS = {  # linear name -> (in, out); duplicates (k=v, gate=up, q=o) measured once
    "1p5b": {"q_proj": (1536, 1536), "k_proj": (1536, 256), "v_proj": (1536, 256),
             "o_proj": (1536, 1536), "gate_proj": (1536, 8960), "up_proj": (1536, 8960),
             "down_proj": (8960, 1536), "qkv_proj": (1536, 2048)},   # q|k|v fused
    "7b": {"q_proj": (3584, 3584), "k_proj": (3584, 512), "v_proj": (3584, 512),
           "o_proj": (3584, 3584), "gate_proj": (3584, 18944), "up_proj": (3584, 18944),
           "down_proj": (18944, 3584), "qkv_proj": (3584, 4608)},
}
SWEEP = [
    kernels.TuningConfig(max_concurrent_steps=5),
    kernels.TuningConfig(max_concurrent_steps=6, epi_n=64),
    kernels.TuningConfig(tile_n=192, max_concurrent_steps=4),
]
NT = (((1,), (1,)), ((), ()))


def gemm_shapes(model):
  """[(label, M, N, K, b_scale kind, count)] with duplicate linears counted."""
  seen = {}
  for name, (din, dout) in MODELS[model].items():
    for gemm_name, (m, n, k, kind) in {"fprop": (TOKENS, dout, din, "block"),
                                       "dgrad": (TOKENS, din, dout, "block"),
                                       "wgrad": (din, dout, TOKENS, "row")}.items():
      key = (m, n, k, kind)
      if key in seen:
        seen[key][1].append(f"{name}.{gemm_name}")
      else:
        seen[key] = (f"{model}.{name}.{gemm_name}", [f"{name}.{gemm_name}"])
  return [(label, *key, names) for key, (label, names) in seen.items()]


def make_operands(m, n, k, kind, seed):
  """bf16 X [M,K], W [N,K] ~ N(0,1) and their reference quantization."""
  kx, kw = jax.random.split(jax.random.key(seed))

  @jax.jit
  def gen(kx, kw):
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = jax.random.normal(kw, (n, k), jnp.bfloat16)
    a_q, a_s = kernels.quantize_tiles_reference(x)
    b_q, b_s = (kernels.quantize_tiles_reference(w) if kind == "row"
                else kernels.quantize_blocks_reference(w))
    return x, w.T, a_q, a_s, b_q, b_s
  return gen(kx, kw)


def rel_err_f64(out, a_q, a_s, b_q, b_s, rows):
  """||out - ref|| / ||ref|| over the sampled rows, ref in float64 on the host."""
  k = a_q.shape[1]
  col = np.arange(k) // 128
  a = np.asarray(a_q[rows].astype(jnp.float32), np.float64) * np.asarray(a_s[rows], np.float64)[:, col]
  b = np.asarray(b_q.astype(jnp.float32), np.float64)
  bs = np.asarray(b_s, np.float64)
  if bs.shape[0] != b.shape[0]:
    bs = bs[np.arange(b.shape[0]) // 128]
  ref = a @ (b * bs[:, col]).T
  got = np.asarray(out[rows].astype(jnp.float32), np.float64)
  return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def xla_fp8_tensorwise(a8, b8, sa, sb):
  """Per-tensor scaled FP8 GEMM, QDQ pattern XLA rewrites into a cuBLASLt f8 call."""
  a = a8.astype(jnp.bfloat16) * sa.astype(jnp.bfloat16)
  b = b8.astype(jnp.bfloat16) * sb.astype(jnp.bfloat16)
  return lax.dot_general(a, b, NT, preferred_element_type=jnp.bfloat16)


def xla_fp8_direct(a8, b8, s):
  """Per-tensor scaled FP8 GEMM written as a direct f8 x f8 dot_general (K-major B)."""
  return (lax.dot_general(a8, b8, NT, preferred_element_type=jnp.float32) * s).astype(jnp.bfloat16)


def xla_dequant_bf16(a_q, a_s, b_q, b_s):
  """Dequantize both operands (block scales) to bf16, then one bf16 GEMM."""
  k = a_q.shape[1]
  sa = jnp.repeat(a_s, 128, axis=1)[:, :k]
  sb = b_s if b_s.shape[0] == b_q.shape[0] else jnp.repeat(b_s, 128, axis=0)[:b_q.shape[0]]
  sb = jnp.repeat(sb, 128, axis=1)[:, :k]
  a = (a_q.astype(jnp.float32) * sa).astype(jnp.bfloat16)
  b = (b_q.astype(jnp.float32) * sb).astype(jnp.bfloat16)
  return lax.dot_general(a, b, NT, preferred_element_type=jnp.bfloat16)


def has_f8_gemm(fn, *args):
  text = jax.jit(fn).lower(*args).compile().as_text()
  return "f8" in text and ("cublas$lt$matmul$f8" in text or "__triton_gemm" in text)


def rotating_ms(fn, arg_sets, iters):
  """Device ms of one fn call, timed over all arg sets in one jitted call (set i read once)."""
  if len(arg_sets) == 1:
    return benchtools.device_ms(fn, arg_sets[0], iters)
  over_sets = jax.jit(lambda sets: [fn(*args) for args in sets])
  return benchtools.device_ms(over_sets, (arg_sets,), iters) / len(arg_sets)


def parse_variant(text):
  """'cross_tile=False;epi_n=64' -> {'cross_tile': False, 'epi_n': 64} (TuningConfig fields);
  'k_proj.wgrad@split_k=4' times the override on the shapes whose label ends so only."""
  fields = {f.name for f in dataclasses.fields(kernels.TuningConfig)}
  out = {}
  if "@" in text:
    out["only"], text = text.split("@", 1)
  for item in filter(None, text.split(";")):
    key, _, value = item.partition("=")
    if key not in fields:
      raise ValueError(f"--variants: {key!r} is not a TuningConfig field ({sorted(fields)})")
    out[key] = ast.literal_eval(value)
  return out


def config_for(cfg, m, n, k, kind):
  """None (the library's default_config), a TuningConfig, or overrides of default_config."""
  if isinstance(cfg, dict):
    overrides = {key: v for key, v in cfg.items() if key != "only"}
    return dataclasses.replace(kernels.default_config(m, n, k, b_scale=kind), **overrides)
  return cfg


def applies(cfg, label):
  return not isinstance(cfg, dict) or label.endswith(cfg.get("only", ""))


def config_label(cfg):
  if isinstance(cfg, dict):
    return "default+" + ";".join(f"{k}={v}" for k, v in cfg.items())
  return str(cfg)


def bench_shape(label, m, n, k, kind, configs, iters, seed, with_baselines=True, rotate=1,
                breakdown=False):
  flops = 2.0 * m * n * k
  x, w_t, a_q, a_s, b_q, b_s = make_operands(m, n, k, kind, seed)
  # more operand sets for the timings only (the error check uses the first)
  extra = [make_operands(m, n, k, kind, seed + 1000 * i) for i in range(1, rotate)]
  all_sets = [(x, w_t, a_q, a_s, b_q, b_s), *extra]
  sets = lambda pick: [pick(*operands) for operands in all_sets]
  fp8_sets = sets(lambda x, w_t, a_q, a_s, b_q, b_s: (a_q, a_s, b_q, b_s))
  row = {"label": label, "M": m, "N": n, "K": k, "b_scale": kind}
  tflops = lambda ms: flops / (ms * 1e-3) / 1e12
  ours = {}
  for cfg in filter(lambda c: applies(c, label), configs):
    name = config_label(cfg)
    print(f"compiling ours {label} {name}", flush=True)
    c = config_for(cfg, m, n, k, kind)
    f = jax.jit(lambda *a, c=c: kernels.block_scaled_matmul(*a, config=c))
    try:
      ms = rotating_ms(f, fp8_sets, iters)
      ours[name] = {"ms": ms, "tflops": tflops(ms)}
    except Exception as e:  # noqa: BLE001 - record and continue with the next config
      ours[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
      print(f"  {label} {name}: {ours[name]['error']}", flush=True)
  timed = {c: v for c, v in ours.items() if "ms" in v}
  row["ours_by_config"] = ours
  if timed:
    best_cfg = min(timed, key=lambda c: timed[c]["ms"])
    row["best_of_configs"] = dict(timed[best_cfg], config=best_cfg)
    # "ours" is what the library runs (default_config) whenever that was timed.
    ours_cfg = "None" if "None" in timed else best_cfg
    row["ours"] = dict(timed[ours_cfg], config=ours_cfg)
    cfg = config_for(next(c for c in configs if config_label(c) == ours_cfg), m, n, k, kind)
    out = jax.jit(lambda *a: kernels.block_scaled_matmul(*a, config=cfg))(a_q, a_s, b_q, b_s)
    rows = np.unique(np.concatenate([np.random.default_rng(seed).integers(0, m, 32), [0, m - 1]]))
    row["rel_err_vs_f64"] = rel_err_f64(out, a_q, a_s, b_q, b_s, rows)
    row["rel_err_rows_sampled"] = int(len(rows))
    row["nan_in_output"] = bool(jnp.any(jnp.isnan(out)))
    # The kernel fed scales in its own layout (KernelScales, built outside the timing, as
    # cuBLAS's are below): what a quantizer writing that layout would get, without XLA's
    # transpose / broadcast of the scales.
    native_sets = [(a, b, kernels.kernel_scales(a, sa, b, sb)) for a, sa, b, sb in fp8_sets]
    f = jax.jit(lambda a, b, s: kernels.matmul_kernel_scales(a, b, s, config=cfg))
    ms = rotating_ms(f, native_sets, iters)
    row["ours_kernel_layout"] = {"ms": ms, "tflops": tflops(ms), "config": row["ours"]["config"]}
    if breakdown:  # which kernels "ours" is made of: the GEMM and XLA's layout ops around it
      f = jax.jit(lambda *a: kernels.block_scaled_matmul(*a, config=cfg))
      row["ours_kernels"] = benchtools.kernel_breakdown(f, fp8_sets[0], iters)
  if with_baselines:
    ms = rotating_ms(jax.jit(jnp.dot), sets(lambda x, w_t, *_: (x, w_t)), iters)
    row["xla_bf16"] = {"ms": ms, "tflops": tflops(ms)}
    one = jnp.float32(1.0)
    variants = {}
    for name, fn, fargs in (("qdq", xla_fp8_tensorwise, (a_q, b_q, one, one)),
                            ("direct", xla_fp8_direct, (a_q, b_q, one))):
      arg_sets = sets(lambda x, w_t, a_q, a_s, b_q, b_s, tail=fargs[2:]: (a_q, b_q, *tail))
      ms = rotating_ms(jax.jit(fn), arg_sets, iters)
      variants[name] = {"ms": ms, "tflops": tflops(ms), "f8_gemm_in_hlo": has_f8_gemm(fn, *fargs)}
    fp8 = [v for v in variants.values() if v["f8_gemm_in_hlo"]] or list(variants.values())
    row["xla_fp8_tensorwise"] = dict(min(fp8, key=lambda v: v["ms"]), variants=variants)
    ms = rotating_ms(jax.jit(xla_dequant_bf16), fp8_sets, iters)
    row["xla_dequant_bf16"] = {"ms": ms, "tflops": tflops(ms)}
    if "ours" in row:
      base = row["xla_bf16"]["ms"]
      row["speedup_vs_xla_bf16"] = base / row["ours"]["ms"]
      row["speedup_vs_xla_bf16_by_config"] = {c: base / v["ms"] for c, v in timed.items()}
      row["xla_fp8_tensorwise_vs_xla_bf16"] = base / row["xla_fp8_tensorwise"]["ms"]
      row["ours_kernel_layout_vs_xla_bf16"] = base / row["ours_kernel_layout"]["ms"]
  row["operand_sets_rotated"] = rotate
  return row


def add_cublas_blockwise(row, configs, iters, seed):
  """Times cuBLAS's block-scaled GEMM on the row's operand sets (rebuilt from the same
  seeds) and adds it with its ratios. Runs after every CUPTI timing of ours and XLA's: once
  torch.profiler has subscribed to CUPTI, the Mosaic GPU profiler cannot (session 9's first
  try fell back to host timing for every later shape)."""
  if "ours" not in row or "xla_bf16" not in row:
    return
  m, n, k, kind = row["M"], row["N"], row["K"], row["b_scale"]
  fp8_sets = [make_operands(m, n, k, kind, seed + 1000 * i)[2:]
              for i in range(row["operand_sets_rotated"])]
  cfg = config_for(next(c for c in configs if config_label(c) == row["ours"]["config"]),
                   m, n, k, kind)
  out = jax.jit(lambda *a: kernels.block_scaled_matmul(*a, config=cfg))(*fp8_sets[0])
  vendor = cublas_blockwise.time_cublas_blockwise(fp8_sets, kind, out, iters)
  if "ms" in vendor:
    vendor["tflops"] = 2.0 * m * n * k / (vendor["ms"] * 1e-3) / 1e12
    row["cublas_blockwise_vs_xla_bf16"] = row["xla_bf16"]["ms"] / vendor["ms"]
    row["ours_vs_cublas_blockwise"] = vendor["ms"] / row["ours"]["ms"]
    row["ours_kernel_layout_vs_cublas_blockwise"] = (
        vendor["ms"] / row["ours_kernel_layout"]["ms"])
  row["cublas_blockwise"] = vendor


def geomean(xs):
  return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def summarize(rows, shapes_by_model):
  summary = {}
  for model, shapes in shapes_by_model.items():
    ratios = []
    for label, *_, names in shapes:
      r = next((r for r in rows if r["label"] == label and "speedup_vs_xla_bf16" in r), None)
      if r is not None:
        ratios += [r["speedup_vs_xla_bf16"]] * len(names)  # each linear of the layer counts
    summary[f"{model}_geomean_speedup_vs_xla_bf16"] = geomean(ratios)
    summary[f"{model}_gemms_measured"] = len(ratios)
    by_config = {}
    for label, *_, names in shapes:
      r = next((r for r in rows if r["label"] == label), None)
      for c, x in (r or {}).get("speedup_vs_xla_bf16_by_config", {}).items():
        by_config.setdefault(c, []).extend([x] * len(names))
    if len(by_config) > 1:
      summary[f"{model}_geomean_by_config"] = {c: geomean(xs) for c, xs in by_config.items()}
    for key in ("ours_kernel_layout_vs_xla_bf16", "cublas_blockwise_vs_xla_bf16",
                "ours_vs_cublas_blockwise", "ours_kernel_layout_vs_cublas_blockwise"):
      xs = []
      for label, *_, names in shapes:
        r = next((r for r in rows if r["label"] == label and key in r), None)
        xs += [r[key]] * len(names) if r else []
      if xs:
        summary[f"{model}_geomean_{key}"] = geomean(xs)
        summary[f"{model}_gemms_with_{key}"] = len(xs)
  r = next((r for r in rows if r["label"] == "square8192" and "speedup_vs_xla_bf16" in r), None)
  summary["square8192_speedup_vs_xla_bf16"] = r and r["speedup_vs_xla_bf16"]
  for key in ("cublas_blockwise_vs_xla_bf16", "ours_kernel_layout_vs_xla_bf16"):
    if r is not None and key in r:
      summary[f"square8192_{key}"] = r[key]
  return summary


def main(argv):
  p = argparse.ArgumentParser()
  p.add_argument("--out", required=True)
  p.add_argument("--models", default="1p5b,7b")
  p.add_argument("--sweep", action="store_true", help="time SWEEP configs at 8192^3 first")
  p.add_argument("--top", type=int, default=2, help="configs per shape after the sweep")
  p.add_argument("--iters", type=int, default=20)
  p.add_argument("--rotate", type=int, default=3,
                 help="operand sets per timed call (L2-cold operands, as in a train step)")
  p.add_argument("--variants", default="",
                 help="comma-separated overrides of default_config timed beside it on every"
                      " shape, e.g. 'cross_tile=False,cross_tile=False;epi_n=None'")
  p.add_argument("--deadline", type=float, default=1e9, help="seconds; skip shapes after")
  p.add_argument("--baselines", type=int, default=1,
                 help="0: time only our configs (variants compared among themselves)")
  p.add_argument("--shapes", default="",
                 help="comma-separated substrings: only shapes whose label contains one")
  p.add_argument("--cublas_blockwise", type=int, default=1,
                 help="1: also time cuBLAS's block-scaled FP8 GEMM through PyTorch (vendor"
                      " baseline, benchmarks/cublas_blockwise.py); needs PyTorch with CUDA")
  p.add_argument("--breakdown", type=int, default=1,
                 help="1: also record the device ms of each kernel in one call of ours"
                      " (the GEMM and the XLA ops around it), as rows' ours_kernels")
  args = p.parse_args(argv)
  t0 = time.time()
  result = {"info": benchtools.run_info(["benchmarks/gemm.py", *argv]), "rows": []}

  def save():
    result["info"]["timing_method"] = benchtools.timing_method()
    result["info"]["elapsed_s"] = time.time() - t0
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)

  configs = [None]  # the library's own choice (kernels.default_config)
  configs += [parse_variant(v) for v in args.variants.split(",") if v]
  if args.sweep:
    row = bench_shape("sweep8192", 8192, 8192, 8192, "block", SWEEP, args.iters, 0,
                      with_baselines=False, rotate=args.rotate)
    result["sweep"] = row
    save()
    timed = [(v["ms"], c) for c in SWEEP if "ms" in (v := row["ours_by_config"][str(c)])]
    configs = [c for _, c in sorted(timed, key=lambda t: t[0])[:args.top]] + configs
    print("sweep:", {str(c): round(v["tflops"], 1) for c, v in
                     zip(SWEEP, row["ours_by_config"].values()) if "tflops" in v}, flush=True)
  result["configs_per_shape"] = [config_label(c) for c in configs]  # "None": default_config
  shapes_by_model = {m: gemm_shapes(m) for m in args.models.split(",") if m}
  todo = [("square8192", 8192, 8192, 8192, "block", ["square"])]
  for shapes in shapes_by_model.values():
    todo += shapes
  skipped = []
  for i, (label, m, n, k, kind, names) in enumerate(todo):
    if args.shapes and not any(part in label for part in args.shapes.split(",")):
      continue
    if time.time() - t0 > args.deadline:
      skipped.append(label)
      continue
    row = bench_shape(label, m, n, k, kind, configs, args.iters, seed=i + 1,
                      with_baselines=bool(args.baselines), rotate=args.rotate,
                      breakdown=bool(args.breakdown))
    row["linears"] = names
    row["seed"] = i + 1
    result["rows"].append(row)
    print(label, {c: round(v.get("tflops", 0), 1) for c, v in row["ours_by_config"].items()},
          flush=True)
    if not args.baselines:
      save()
      continue
    print(f"{label:28s} M={m:6d} N={n:6d} K={k:6d} ours={row.get('ours', {}).get('tflops', 0):7.1f}"
          f" bf16={row['xla_bf16']['tflops']:7.1f} fp8t={row['xla_fp8_tensorwise']['tflops']:7.1f}"
          f" deq={row['xla_dequant_bf16']['tflops']:7.1f}"
          f" kernel_layout={row.get('ours_kernel_layout', {}).get('tflops', 0):7.1f}"
          f" x{row.get('speedup_vs_xla_bf16', 0):.3f} err={row.get('rel_err_vs_f64', -1):.2e}",
          flush=True)
    result["summary"] = summarize(result["rows"], shapes_by_model)
    result["skipped"] = skipped
    save()
  if args.cublas_blockwise and args.baselines:
    for row in result["rows"]:
      add_cublas_blockwise(row, configs, args.iters, row["seed"])
      print(f"{row['label']:28s} cublas_blk="
            f"{row.get('cublas_blockwise', {}).get('tflops', 0):7.1f}", flush=True)
      save()
  result["skipped"] = skipped
  result["summary"] = summarize(result["rows"], shapes_by_model)
  save()
  print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
  main(sys.argv[1:])
