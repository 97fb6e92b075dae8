"""Train-step benchmark: BF16 vs FP8 recipes on one GPU, measured side by side in one run.

  python benchmarks/train_step.py --config=configs/1p5b.py \
      --recipes=bf16,fp8_tensorwise,infir2 --seq_lens=4096,8192 --tokens_per_step=16384 \
      --out=benchmarks/results/train_step_h200.json

Each (recipe, seq_len) runs in a fresh subprocess (so peak memory is its own) on synthetic
token ids (no tokenizer or data download); the parent measures the XLA bf16 GEMM rate in the
same run, for MFU against what this card actually delivers. Reports median step time,
tokens/s, MFU (vs 989 TFLOP/s and vs the measured GEMM rate), peak device memory, and the
FP8 GEMMs found in the compiled HLO. `--profile_dir` also traces one step per variant and
summarises where the time went (GEMMs, attention, our Pallas kernels, the rest).
"""

import argparse
import gzip
import json
import os
import platform
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PEAK_BF16 = 989e12


def _parse():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--config", default="configs/1p5b.py")
  p.add_argument("--recipes", default="bf16,fp8_tensorwise,infir2")
  p.add_argument("--seq_lens", default="4096")
  p.add_argument("--tokens_per_step", type=int, default=16384)
  p.add_argument("--steps", type=int, default=8, help="timed steps (after 2 warm-up steps)")
  p.add_argument("--override", action="append", default=[],
                 help="extra config overrides a.b=v (repeatable), e.g. model.remat=full")
  p.add_argument("--out", default="")
  p.add_argument("--profile_dir", default="")
  p.add_argument("--child", default="", help=argparse.SUPPRESS)  # "recipe:seq_len"
  return p.parse_args()


def run_one(args, recipe: str, seq_len: int) -> dict:
  """Compiles and times one train step variant in this process."""
  import jax
  import numpy as np
  from infir2_jax import sharding as sharding_lib
  from infir2_jax.config import load_config
  from infir2_jax.optim import make_optimizer, make_schedule
  from infir2_jax.precision import hlo_fp8_gemm_count
  from infir2_jax.train_step import make_train_step
  from infir2_jax.trainer import build_model, init_params_fn

  batch_size = max(args.tokens_per_step // seq_len, 1)
  overrides = [f"precision.recipe={recipe}", f"seq_len={seq_len}", f"batch_size={batch_size}",
               "mesh.data=1", *args.override]
  cfg = load_config(args.config, overrides)
  device = jax.devices()[0]
  mesh = sharding_lib.make_mesh(cfg.mesh, [device])
  rules = sharding_lib.logical_rules(cfg.mesh)
  model = build_model(cfg)
  optimizer = make_optimizer(cfg.opt, cfg.steps)
  t0 = time.perf_counter()
  state, shardings = sharding_lib.sharded_init(init_params_fn(model, cfg), optimizer, mesh,
                                               rules, jax.random.key(0))
  jax.block_until_ready(state)
  init_s = time.perf_counter() - t0
  rng = np.random.default_rng(0)
  shape = (batch_size, seq_len)
  batch = {"inputs": rng.integers(0, cfg.model.vocab_size, shape, dtype=np.int32),
           "targets": rng.integers(0, cfg.model.vocab_size, shape, dtype=np.int32),
           "segment_ids": np.ones(shape, np.int32),
           "positions": np.broadcast_to(np.arange(seq_len, dtype=np.int32), shape).copy(),
           "loss_mask": np.ones(shape, np.float32)}
  batch = jax.device_put(batch, sharding_lib.batch_sharding(mesh))
  import flax.linen as nn
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    step = jax.jit(make_train_step(model, optimizer, make_schedule(cfg.opt, cfg.steps),
                                   cfg.grad_accum_steps), donate_argnums=0)
    t0 = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
  hlo_counts = hlo_fp8_gemm_count(compiled.as_text())
  memory = compiled.memory_analysis()
  losses, times = [], []
  for i in range(2 + args.steps):
    t0 = time.perf_counter()
    state, metrics = compiled(state, batch)
    loss = float(metrics["loss"])  # blocks: one step's wall time
    if i >= 2:
      times.append(time.perf_counter() - t0)
    losses.append(loss)
  if args.profile_dir:
    trace_dir = os.path.join(args.profile_dir, f"{recipe}_{seq_len}")
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
      state, metrics = compiled(state, batch)
      float(metrics["loss"])
  stats = device.memory_stats() or {}
  step_s = float(np.median(times))
  tokens = batch_size * seq_len
  flops = cfg.model.flops_per_token(seq_len) * tokens
  result = {
      "recipe": recipe, "seq_len": seq_len, "batch_size": batch_size, "tokens_per_step": tokens,
      "median_step_s": step_s, "min_step_s": float(np.min(times)),
      "max_step_s": float(np.max(times)), "tokens_per_s": tokens / step_s,
      "model_tflops_per_s": flops / step_s / 1e12, "mfu_vs_989": flops / step_s / PEAK_BF16,
      "peak_memory_gib": stats.get("peak_bytes_in_use", 0) / 2**30,
      "compiled_temp_gib": getattr(memory, "temp_size_in_bytes", 0) / 2**30,
      "compile_s": compile_s, "init_s": init_s, "losses": losses,
      "hlo_fp8_gemms": hlo_counts, "remat": cfg.model.remat, "attention": cfg.model.attention,
      "backend": cfg.precision.backend,
  }
  if args.profile_dir:
    result["profile"] = summarize_trace(trace_dir)
  return result


def summarize_trace(trace_dir: str) -> dict:
  """Milliseconds of GPU kernels by kind, from the perfetto trace of one step."""
  paths = [os.path.join(r, f) for r, _, fs in os.walk(trace_dir) for f in fs
           if f.endswith(".json.gz")]
  if not paths:
    return {"error": "no perfetto trace written"}
  with gzip.open(paths[0], "rt") as f:
    trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  kinds = {"gemm": 0.0, "attention": 0.0, "pallas_fp8": 0.0, "other": 0.0}
  for e in events:
    if e.get("ph") != "X" or "dur" not in e:
      continue
    name = str(e.get("name", "")).lower()
    if not any(s in name for s in ("fusion", "gemm", "kernel", "cublas", "cutlass", "xmma",
                                   "fmha", "flash", "convert", "reduce", "mosaic", "triton",
                                   "sm90", "cudnn", "copy", "transpose")):
      continue  # host-side events
    if any(s in name for s in ("fmha", "flash", "cudnn", "attention")):
      kinds["attention"] += e["dur"]
    elif any(s in name for s in ("block_scaled", "fp8_gemm", "quantize", "mosaic")):
      kinds["pallas_fp8"] += e["dur"]
    elif any(s in name for s in ("gemm", "cublas", "cutlass", "xmma", "sm90", "matmul")):
      kinds["gemm"] += e["dur"]
    else:
      kinds["other"] += e["dur"]
  return {k: v / 1e3 for k, v in kinds.items()}  # us -> ms


def xla_bf16_gemm_tflops(n: int = 8192, reps: int = 20) -> float:
  import jax
  import jax.numpy as jnp
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
  b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
  f = jax.jit(lambda a, b: a @ b)
  f(a, b).block_until_ready()
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    f(a, b).block_until_ready()
    times.append(time.perf_counter() - t0)
  times.sort()
  return 2 * n**3 / times[len(times) // 2] / 1e12


def main():
  args = _parse()
  if args.child:
    recipe, seq_len = args.child.split(":")
    print("RESULT " + json.dumps(run_one(args, recipe, int(seq_len))), flush=True)
    return
  import jax
  from infir2_jax import benchtools
  results = {**benchtools.run_info(sys.argv), "python": platform.python_version(),
             "variants": []}
  if jax.default_backend() == "gpu":
    results["xla_bf16_gemm_tflops_8192"] = xla_bf16_gemm_tflops()
  rows = []
  for seq_len in (int(s) for s in args.seq_lens.split(",")):
    for recipe in args.recipes.split(","):
      cmd = [sys.executable, __file__, "--child", f"{recipe}:{seq_len}"] + [
          a for a in sys.argv[1:] if not a.startswith("--out")]
      proc = subprocess.run(cmd, capture_output=True, text=True)
      lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
      if proc.returncode or not lines:
        err = (proc.stderr or proc.stdout)[-3000:]
        print(f"{recipe} @ {seq_len} FAILED:\n{err}", file=sys.stderr)
        results["variants"].append({"recipe": recipe, "seq_len": seq_len, "error": err[-800:]})
        continue
      r = json.loads(lines[-1][len("RESULT "):])
      gemm = results.get("xla_bf16_gemm_tflops_8192")
      if gemm:
        r["mfu_vs_measured_bf16_gemm"] = r["model_tflops_per_s"] / gemm
      results["variants"].append(r)
      rows.append(r)
  _ratios(rows)
  _table(results)
  if args.out:
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
      json.dump(results, f, indent=1)


def _ratios(rows):
  base = {r["seq_len"]: r for r in rows if r["recipe"] == "bf16"}
  for r in rows:
    b = base.get(r["seq_len"])
    if b:
      r["step_time_vs_bf16"] = r["median_step_s"] / b["median_step_s"]
      if b["peak_memory_gib"]:
        r["peak_memory_vs_bf16"] = r["peak_memory_gib"] / b["peak_memory_gib"]


def _table(results):
  print(f"device {results['device']}, jax {results['jax_version']}, commit "
        f"{results['git_commit'][:10]}{' (dirty)' if results['git_dirty'] else ''}; "
        "XLA bf16 GEMM 8192^3: "
        f"{results.get('xla_bf16_gemm_tflops_8192', float('nan')):.0f} TFLOP/s")
  print(f"{'recipe':16} {'seq':>5} {'ms/step':>8} {'x bf16':>7} {'tok/s':>8} {'MFU':>6} "
        f"{'peak GiB':>8} {'x bf16':>7} {'fp8 gemms':>10} {'compile s':>9}")
  for r in results["variants"]:
    if "error" in r:
      print(f"{r['recipe']:16} {r['seq_len']:>5} FAILED")
      continue
    print(f"{r['recipe']:16} {r['seq_len']:>5} {1e3 * r['median_step_s']:8.1f} "
          f"{r.get('step_time_vs_bf16', float('nan')):7.3f} {r['tokens_per_s']:8.0f} "
          f"{100 * r['mfu_vs_989']:5.1f}% {r['peak_memory_gib']:8.1f} "
          f"{r.get('peak_memory_vs_bf16', float('nan')):7.3f} "
          f"{sum(r['hlo_fp8_gemms'].values()) if isinstance(r['hlo_fp8_gemms'], dict) else r['hlo_fp8_gemms']:>10} "
          f"{r['compile_s']:9.1f}")



if __name__ == "__main__":
  main()
