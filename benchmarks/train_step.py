"""Train-step benchmark: BF16 vs FP8 recipes on one GPU, measured side by side in one run.

  python benchmarks/train_step.py --config=configs/1p5b.py \
      --recipes=bf16,fp8_tensorwise,infir2 --seq_lens=4096,8192 --tokens_per_step=16384 \
      --data=text --override=data.tokenizer=default --override=steps=50 \
      --override=opt.warmup_steps=10 --steps=48 --out=benchmarks/results/train_step_h200.json

Each (recipe, seq_len) runs in its own subprocess (so peak memory is its own), one after the
other: compile (the GPU compiler autotunes on the device, so concurrent compiles would contend
for its memory and its timings), then train, from the same init (seed 0) on the same batches.
A variant that runs past `--variant_timeout_s` is killed and recorded, and the others still
run. `--data=text` trains on the config's text data (`--override=data.tokenizer=default`:
the committed Shakespeare with our 8k BPE, no download; ids < 8k fit any vocab), so the
losses of the first steps are a real loss curve; `--data=synthetic` uses random ids.
The bf16 run at the longest seq_len is repeated on another data order (`noise_losses`): the
loss difference that data order alone makes, the yardstick for "within noise".
The parent measures the XLA bf16 GEMM rate in the same run, for MFU against what this card
delivers. Reports median step time (2 warm-up steps excluded; `--timing`: pipelined as the
trainer runs steps, the next one queued while one runs, and blocked on a few more steps,
each waited for as sessions up to 18 timed them), tokens/s, MFU (vs 989 TFLOP/s
and vs the measured GEMM rate), peak device memory, XLA's memory analysis and the FP8 GEMMs in
the compiled HLO. `--profile_dir` also traces one step per variant and sums GPU kernel time
by kind (GEMMs, attention, our Pallas kernels, the rest), with the top kernels by time.
Results are written after every variant, so a run cut short keeps what it measured.
"""

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from infir2_jax.bench import labels  # pylint: disable=wrong-import-position

PEAK_BF16 = 989e12
WARMUP_STEPS = 2


def _parse():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--config", default="configs/1p5b.py")
  p.add_argument("--recipes", default="bf16,fp8_tensorwise,infir2",
                 help="variants: a recipe, with ~a.b=v overrides of its own, e.g. "
                      "infir2~precision.backend=xla, or XLA flags for its process, e.g. "
                      "infir2~--xla_gpu_async_copy_min_bytes=1000000000000; @SEQ runs it at "
                      "that seq_len only")
  p.add_argument("--seq_lens", default="4096")
  p.add_argument("--tokens_per_step", type=int, default=16384)
  p.add_argument("--steps", type=int, default=8, help="timed steps (after 2 warm-up steps)")
  p.add_argument("--data", choices=("synthetic", "text"), default="synthetic")
  p.add_argument("--override", action="append", default=[],
                 help="extra config overrides a.b=v (repeatable), e.g. model.remat=full")
  p.add_argument("--noise_run", type=int, default=1,
                 help="repeat bf16 at the longest seq_len on another data order (1/0)")
  p.add_argument("--variant_timeout_s", type=float, default=300,
                 help="kill a variant (compile + run) that takes longer than this")
  p.add_argument("--first_variant_extra_s", type=float, default=150,
                 help="more time for the first variant: on a cold machine it pays ~100 s of "
                      "one-off start-up (CUDA, page cache) that the later ones do not")
  p.add_argument("--deadline_s", type=float, default=0,
                 help="start no variant after this many seconds (0: no limit)")
  p.add_argument("--timing", choices=("pipelined", "blocked"), default="pipelined",
                 help="median_step_s as the trainer runs steps (pipelined: the next step is "
                      "queued while one runs) or each step waited for (blocked: sessions <= 18)")
  p.add_argument("--other_timing_steps", type=int, default=6,
                 help="then this many steps timed the other way (0: none)")
  p.add_argument("--out", default="")
  p.add_argument("--profile_dir", default="")
  p.add_argument("--hlo_dir", default="",
                 help="write each variant's compiled HLO here (gzipped text), to attribute the "
                      "profile's fusions to the ops and bytes they move")
  p.add_argument("--child", default="", help=argparse.SUPPRESS)  # "recipe:seq_len"
  return p.parse_args()


def _batches(cfg, count: int, shuffle_seed: int, data: str):
  """`count` host batches: the config's text pipeline, or random ids."""
  import dataclasses
  if data == "synthetic":
    from infir2_jax.bench.tools import synthetic_batch
    return [synthetic_batch(cfg.batch_size, cfg.seq_len, cfg.model.vocab_size,
                            seed=shuffle_seed * count + i) for i in range(count)]
  from infir2_jax.data import make_data
  data_cfg = dataclasses.replace(cfg.data, shuffle_seed=shuffle_seed, prefetch=0)
  pipeline = make_data(data_cfg, seq_len=cfg.seq_len, global_batch_size=cfg.batch_size,
                       seed=cfg.seed)
  if pipeline.vocab_size > cfg.model.vocab_size:
    raise ValueError(f"tokenizer vocab {pipeline.vocab_size} > model vocab "
                     f"{cfg.model.vocab_size}")
  it = iter(pipeline.train)
  return [next(it) for _ in range(count)]


def split_label(label: str) -> tuple[str, list[str]]:
  """"infir2~precision.backend=xla" -> ("infir2", ["precision.backend=xla"]); XLA flags
  ("infir2~--xla_gpu_async_copy_min_bytes=1000000000000") and environment variables
  ("infir2~INFIR2_KERNEL_QUANTIZE=full") are left out (see xla_flags_of, env_of)."""
  recipe, *overrides = label.split("~")
  return recipe, [o for o in overrides if not o.startswith("--xla") and not labels.is_env_part(o)]


env_of = labels.env_of   # a label's "~INFIR2_NAME=value" parts, its child's environment


def _file_tag(label: str) -> str:
  """A label as a file name part: letters, digits, '.', '_' and '-' only."""
  return "".join(c if c.isalnum() or c in "._-" else "_" for c in label)


def xla_flags_of(label: str) -> list[str]:
  """The XLA flags a label adds to its child's XLA_FLAGS ("~--xla_..." parts)."""
  return [o for o in label.split("~")[1:] if o.startswith("--xla")]


def run_one(args, label: str, seq_len: int) -> dict:
  """Compiles one train step variant from abstract shapes, then times it."""
  import jax
  import numpy as np
  from infir2_jax import parallel
  from infir2_jax.bench.tools import compile_train_step
  from infir2_jax.config import load_config
  from infir2_jax.precision import hlo_fp8_gemm_count

  batch_size = max(args.tokens_per_step // seq_len, 1)
  recipe, label_overrides = split_label(label)
  overrides = [f"precision.recipe={recipe}", f"seq_len={seq_len}", f"batch_size={batch_size}",
               "mesh.data=1", *args.override, *label_overrides]
  cfg = load_config(args.config, overrides)
  device = jax.devices()[0]
  step = compile_train_step(cfg, [device])
  compiled, compile_s = step.compiled, step.lower_s + step.compile_s
  mesh, rules, batch_sharding = step.mesh, step.rules, step.batch_sharding
  init_fn, optimizer = step.init_fn, step.optimizer
  hlo_text = compiled.as_text()
  hlo_counts = hlo_fp8_gemm_count(hlo_text)
  if args.hlo_dir:
    import gzip
    os.makedirs(args.hlo_dir, exist_ok=True)
    with gzip.open(os.path.join(args.hlo_dir, f"hlo_{_file_tag(label)}_{seq_len}.txt.gz"),
                   "wt") as f:
      f.write(hlo_text)
  del hlo_text
  memory = compiled.memory_analysis()
  total_steps = WARMUP_STEPS + args.steps
  host_batches = _batches(cfg, total_steps, 0, args.data)
  noise = (args.noise_run and label == "bf16"
           and seq_len == max(int(s) for s in args.seq_lens.split(",")))
  noise_batches = _batches(cfg, total_steps, 1, args.data) if noise else None
  from infir2_jax.model.attention import check_documents, uses_packed_documents
  from infir2_jax.model.packed_attention import runs_per_row_np
  documents = [int(runs_per_row_np(b["segment_ids"]).max()) for b in host_batches]
  if uses_packed_documents(cfg.model, jax.default_backend()):
    for b in host_batches + (noise_batches or []):  # as the trainer checks every batch
      check_documents(b["segment_ids"], cfg.model)
  print(f"COMPILED in {compile_s:.1f} s", flush=True)
  # The allocator's peak so far is the compile's (autotuning runs candidate kernels on the
  # device); the step's own peak can only be told apart when it is higher.
  compile_peak = (device.memory_stats() or {}).get("peak_bytes_in_use", 0)
  from infir2_jax.bench.tools import GpuTelemetry
  telemetry = GpuTelemetry()  # SM clock and power over the steps (not the idle init compile)

  def train(batches, sampled=contextlib.nullcontext()):
    t0 = time.perf_counter()
    state, _ = parallel.sharded_init(init_fn, optimizer, mesh, rules, jax.random.key(0))
    jax.block_until_ready(state)
    init_s = time.perf_counter() - t0
    device_batches = [jax.device_put(b, batch_sharding) for b in batches]
    with sampled:
      state, losses, times = timed_steps(compiled, state, device_batches, args.timing)
    return state, losses, times, init_s, device_batches

  state, losses, times, init_s, device_batches = train(host_batches, telemetry)
  last_batch = device_batches[-1]
  # the other timing on a few more steps (same batches again): what a step costs when the
  # host waits for each one (blocked) vs when the next is queued while it runs (pipelined)
  other = "blocked" if args.timing == "pipelined" else "pipelined"
  extra = device_batches[-(args.other_timing_steps + WARMUP_STEPS):] if (
      args.other_timing_steps) else []
  other_times = []
  if extra:
    state, _, other_times = timed_steps(compiled, state, extra, other)
  trace_dir = ""
  if args.profile_dir:
    trace_dir = os.path.join(args.profile_dir, f"{label.replace('~', '_')}_{seq_len}")
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
      state, metrics = compiled(state, last_batch)
      float(metrics["loss"])
  stats = device.memory_stats() or {}
  noise_losses = None
  if noise:
    del state
    noise_losses = train(noise_batches)[1]
  step_s = float(np.median(times))
  tokens = batch_size * seq_len
  flops = cfg.model.flops_per_token(seq_len) * tokens
  result = {
      "recipe": recipe, "label": label, "seq_len": seq_len, "batch_size": batch_size,
      "tokens_per_step": tokens,
      "overrides": overrides, "data": args.data,
      "median_step_s": step_s, "min_step_s": float(np.min(times)),
      "max_step_s": float(np.max(times)), "tokens_per_s": tokens / step_s,
      "model_tflops_per_s": flops / step_s / 1e12, "mfu_vs_989": flops / step_s / PEAK_BF16,
      "peak_memory_gib": stats.get("peak_bytes_in_use", 0) / 2**30,
      "peak_memory_after_compile_gib": compile_peak / 2**30,
      "compiled_argument_gib": getattr(memory, "argument_size_in_bytes", 0) / 2**30,
      "compiled_temp_gib": getattr(memory, "temp_size_in_bytes", 0) / 2**30,
      "compile_s": compile_s, "init_s": init_s, "losses": losses, "noise_losses": noise_losses,
      "max_documents_per_row": max(documents),
      "step_times_s": times, "timing_method": args.timing,
      f"{other}_median_step_s": float(np.median(other_times)) if other_times else None,
      f"{other}_step_times_s": other_times,
      "hlo_fp8_gemms": hlo_counts, "remat": cfg.model.remat, "attention": cfg.model.attention,
      "backend": cfg.precision.backend,
      "gpu_telemetry": telemetry.summary if jax.default_backend() == "gpu" else None,
  }
  if trace_dir:
    from infir2_jax.bench.profile import summarize_trace
    result["profile"] = summarize_trace(trace_dir)
  return result


def timed_steps(step, state, batches, timing: str):
  """Runs `step` over `batches`: (state, losses, wall times of the steps after the first
  WARMUP_STEPS).

  pipelined (the trainer's loop, train/trainer.py): step N+1 is dispatched before step N's
  loss is read, and a step's time is the wall time between consecutive loss reads, so the
  host's dispatch of a step overlaps the device's work on the one before.
  blocked: each step's loss is read before the next is dispatched; its time includes the
  dispatch and the read-back the pipelined loop hides.
  """
  losses, times = [], []
  if timing == "blocked":
    for i, batch in enumerate(batches):
      t0 = time.perf_counter()
      state, metrics = step(state, batch)
      losses.append(float(metrics["loss"]))
      if i >= WARMUP_STEPS:
        times.append(time.perf_counter() - t0)
    return state, losses, times
  if timing != "pipelined":
    raise ValueError(f"timing {timing!r}: pipelined or blocked")
  pending, last_read = None, None
  for batch in list(batches) + [None]:
    if batch is not None:
      state, metrics = step(state, batch)
    if pending is not None:
      losses.append(float(pending["loss"]))  # blocks until the previous step is done
      now = time.perf_counter()
      if last_read is not None and len(losses) > WARMUP_STEPS:
        times.append(now - last_read)
      last_read = now
    pending = metrics if batch is not None else None
  return state, losses, times


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
    label, seq_len = args.child.rsplit(":", 1)
    from infir2_jax.parallel import distributed  # variants after the first reuse the init's compile
    # The child allocates as `python -m infir2_jax.train` does: 95% of the card, reserved up
    # front in one region. It inherited the parent's PREALLOCATE=false before, and a
    # growing allocator keeps the autotuner's and the init's regions apart: the likely
    # reason session 29's 7B candidate (67.4 GiB by the autotuned compile's buffer
    # assignment) failed on an 80 GB H100 to allocate its 25.2 GiB temporary (the next GPU
    # window checks it).
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "true"
    distributed.default_memory_fraction()
    distributed.enable_compilation_cache()
    print("RESULT " + json.dumps(run_one(args, label, int(seq_len))), flush=True)
    return
  # before jax starts: the parent must not hold 75% of the GPU while the children run
  os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # (a child preallocates its own)
  import tempfile
  import jax
  from infir2_jax.bench import tools as benchtools
  results = {**benchtools.run_info(sys.argv), "python": platform.python_version(),
             "method": "one subprocess per variant, one at a time (compile, then train); "
                       "the parent XLA_PYTHON_CLIENT_PREALLOCATE=false, each child "
                       "preallocating 95% as the trainer does (since session 29)",
             "timing": f"median host wall time per step, timed {args.timing} (rows: "
                       "timing_method; the other way in <other>_median_step_s); the "
                       "profile's device_ms_total is a CUPTI kernel sum of one traced step",
             "variants": []}
  if jax.default_backend() == "gpu":  # before any child, on an idle GPU
    results["xla_bf16_gemm_tflops_8192"] = xla_bf16_gemm_tflops()
  tags = [f"{label.split('@')[0]}:{seq_len}"
          for seq_len in (int(s) for s in args.seq_lens.split(","))
          for label in args.recipes.split(",")
          if "@" not in label or int(label.split("@")[1]) == seq_len]
  t_start = time.perf_counter()
  rows = []
  for tag in tags:
    label, seq_len = tag.rsplit(":", 1)
    if args.deadline_s and time.perf_counter() - t_start > args.deadline_s:
      results["variants"].append({"recipe": split_label(label)[0], "label": label,
                                  "seq_len": int(seq_len), "error": "skipped: --deadline_s"})
      print(f"{tag}: skipped, past --deadline_s={args.deadline_s:.0f}", flush=True)
      _write(args.out, results)
      continue
    cmd = [sys.executable, __file__, "--child", tag] + [
        a for a in sys.argv[1:] if not a.startswith("--out")]
    with tempfile.TemporaryFile("w+") as log:  # a file (pipes can block), removed on close
      env, flags = {**os.environ, **env_of(label)}, xla_flags_of(label)
      if flags:
        env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", ""), *flags]).strip()
      proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
      t0 = time.perf_counter()
      limit_s = args.variant_timeout_s + (args.first_variant_extra_s if tag == tags[0] else 0)
      try:
        proc.wait(timeout=limit_s)
        timed_out = False
      except subprocess.TimeoutExpired:
        timed_out = True
        proc.kill()
        proc.wait()
      log.seek(0)
      stdout = log.read()
    lines = [l for l in stdout.splitlines() if l.startswith("RESULT ")]
    if timed_out or proc.returncode or not lines:
      phase = "running" if "COMPILED in" in stdout else "compiling"
      err = (f"timed out after {limit_s:.0f} s, {phase}\n" if timed_out
             else "") + stdout[-3000:]
      print(f"{tag} FAILED:\n{err}", file=sys.stderr, flush=True)
      results["variants"].append({"recipe": split_label(label)[0], "label": label,
                                  "seq_len": int(seq_len), "error": err[-800:]})
    else:
      r = json.loads(lines[-1][len("RESULT "):])
      r["wall_s"] = time.perf_counter() - t0
      gemm = results.get("xla_bf16_gemm_tflops_8192")
      if gemm:
        r["mfu_vs_measured_bf16_gemm"] = r["model_tflops_per_s"] / gemm
      results["variants"].append(r)
      rows.append(r)
    _ratios(rows)
    _table(results)
    _write(args.out, results)  # after every variant: a run cut short keeps what it measured


def _write(out: str, results: dict) -> None:
  if out:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
      json.dump(results, f, indent=1)


def baseline_label(label: str, bf16_labels: list[str]) -> str | None:
  """The bf16 row a variant is compared with: the one whose overrides are the largest subset
  of the variant's ("infir2~model.scan_layers=False~model.remat=save_dots_fp8" ->
  "bf16~model.scan_layers=False"), so layout changes are not credited to the recipe."""
  own = set(label.split("~")[1:])
  best = None
  for b in bf16_labels:
    theirs = set(b.split("~")[1:])
    if theirs <= own and (best is None or len(theirs) > len(set(best.split("~")[1:]))):
      best = b
  return best


def _ratios(rows):
  for r in rows:
    bf16 = [b["label"] for b in rows if b["recipe"] == "bf16" and b["seq_len"] == r["seq_len"]]
    name = baseline_label(r["label"], bf16)
    b = next((b for b in rows if b["label"] == name and b["seq_len"] == r["seq_len"]), None)
    if b:
      r["baseline"] = name
      r["step_time_vs_bf16"] = r["median_step_s"] / b["median_step_s"]
      if b["peak_memory_gib"]:
        r["peak_memory_vs_bf16"] = r["peak_memory_gib"] / b["peak_memory_gib"]


def _table(results):
  print(f"device {results['device']}, jax {results['jax_version']}, commit "
        f"{results['git_commit'][:10]}{' (dirty)' if results['git_dirty'] else ''}; "
        "XLA bf16 GEMM 8192^3: "
        f"{results.get('xla_bf16_gemm_tflops_8192', float('nan')):.0f} TFLOP/s")
  print(f"{'variant':28} {'seq':>5} {'ms/step':>8} {'x bf16':>7} {'tok/s':>8} {'MFU':>6} "
        f"{'peak GiB':>8} {'x bf16':>7} {'fp8 gemms':>10} {'compile s':>9}")
  for r in results["variants"]:
    if "error" in r:
      print(f"{r['label']:28} {r['seq_len']:>5} FAILED")
      continue
    print(f"{r['label']:28} {r['seq_len']:>5} {1e3 * r['median_step_s']:8.1f} "
          f"{r.get('step_time_vs_bf16', float('nan')):7.3f} {r['tokens_per_s']:8.0f} "
          f"{100 * r['mfu_vs_989']:5.1f}% {r['peak_memory_gib']:8.1f} "
          f"{r.get('peak_memory_vs_bf16', float('nan')):7.3f} "
          f"{sum(r['hlo_fp8_gemms'].values()) if isinstance(r['hlo_fp8_gemms'], dict) else r['hlo_fp8_gemms']:>10} "
          f"{r['compile_s']:9.1f}", flush=True)
    other = next((k for k in ("blocked_median_step_s", "pipelined_median_step_s")
                  if r.get(k)), None)
    if other:
      print(f"    timing {r.get('timing_method', 'blocked')}; {other.split('_')[0]}: "
            f"{1e3 * r[other]:.1f} ms/step over {len(r[other.replace('median_step_s', 'step_times_s')])} steps")
    if r.get("peak_memory_after_compile_gib"):
      print(f"    allocator peak after the compile (autotuning), before training: "
            f"{r['peak_memory_after_compile_gib']:.1f} GiB")
    telemetry = r.get("gpu_telemetry") or {}
    if "sm_mhz_median" in telemetry:
      print(f"    while training: SM clock median {telemetry['sm_mhz_median']:.0f} MHz "
            f"(min {telemetry['sm_mhz_min']:.0f}), power median {telemetry['power_w_median']:.0f} W "
            f"(max {telemetry['power_w_max']:.0f}), {telemetry['temp_c_max']:.0f} C max")
    profile = r.get("profile") or {}
    if "ms_by_kind" in profile:
      print("    device ms by kind: " + ", ".join(
          f"{k} {v:.1f}" for k, v in sorted(profile["ms_by_kind"].items(), key=lambda kv: -kv[1])))
    if "concurrency" in profile:
      c = profile["concurrency"]
      print(f"    kernels: {c['summed_ms']:.1f} ms summed, {c['busy_ms']:.1f} ms busy; ran beside "
            "another kernel: " + ", ".join(f"{k} {v:.1f} ms" for k, v in sorted(
                c["overlapped_ms_by_kind"].items(), key=lambda kv: -kv[1])))
    idle = profile.get("idle") or {}
    if idle:
      print(f"    traced step: {idle['kernels']} kernels over {idle['span_ms']:.1f} ms, idle "
            f"{idle['idle_ms']:.1f} ms; gaps " + ", ".join(
                f"{k} {v['count']} ({v['ms']:.1f} ms)" for k, v in idle["gaps_by_size"].items()))
    for g in profile.get("fp8_gemm_by_problem", [])[:12]:
      print(f"    fp8 gemm {g['m']}x{g['n']}x{g['k']} n{g['tile_n']} split{g['split_k']}: "
            f"{g['calls']} calls, {g['ms']:.1f} ms, {g['tflops']:.0f} TFLOP/s")

if __name__ == "__main__":
  main()
