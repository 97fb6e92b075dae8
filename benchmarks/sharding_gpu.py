"""FSDP / tensor parallelism on GPUs: step time and peak memory per GPU, and a 7B AOT fit check.

  # 1.5B at seq 4096 on one GPU, fsdp=2 and tensor=2 (2 GPUs), bf16 and infir2:
  python benchmarks/sharding_gpu.py train --out=$OUT/sharding_1p5b.json
  # configs/7b.py compiled ahead of time for 8 H200s (compile-only topology of the attached
  # GPU, else JAX's mock GPU topology): does the train step fit in 141 GB per GPU?
  python benchmarks/sharding_gpu.py aot --out=$OUT/sharding_7b_aot.json
  # both, and the CPU rehearsal with tiny shapes on 8 fake devices (tests run this):
  python benchmarks/sharding_gpu.py all --out=$OUT/sharding.json
  python benchmarks/sharding_gpu.py all --tiny --out=/tmp/sharding_tiny.json

Tokens are synthetic ids (no tokenizer or data). Each (recipe, mesh) trains in a fresh
process so that device.memory_stats()["peak_bytes_in_use"] is that run's own peak.
"""

import functools
import argparse
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
H200_BYTES = 141e9
MESH_NAMES = ("data", "fsdp", "tensor")


def load_config(path: str, *, tiny: bool, recipe: str, seq_len: int, batch_size: int,
                mesh: tuple[int, int, int], num_layers: int = 0, overrides=()):
  """TrainConfig of a config file with the benchmark's overrides (tiny: CPU-sized widths),
  then `overrides` ("model.remat=none", ...)."""
  from infir2_jax.config import TrainConfig, apply_overrides
  spec = importlib.util.spec_from_file_location("bench_cfg", os.path.join(ROOT, path))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config()
  if tiny:  # widths that still split on 128 for fsdp <= 2 and tensor <= 4
    c.model.update(vocab_size=1024, hidden_size=256, intermediate_size=512, num_layers=1,
                   num_heads=4, num_kv_heads=2, head_dim=128, attention="xla")
    c.precision.backend = "xla"
    if c.model.loss_chunk:  # the chunked (fused) loss too, in chunks the tiny rows divide
      c.model.loss_chunk = 64
  if num_layers:
    c.model.num_layers = num_layers
  c.precision.recipe = recipe
  c.seq_len, c.batch_size = seq_len, batch_size
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = mesh
  c.mesh.fp8_alignment = "warn"  # measure what the user asked for; report the problems
  return TrainConfig.from_config_dict(apply_overrides(c, overrides))


def _setup(cfg, devices):
  """mesh, rules, model, optimizer, init fn and FP8 alignment problems of a run."""
  from infir2_jax import parallel
  from infir2_jax.train.optim import make_optimizer
  from infir2_jax.model import init_params, projections
  from infir2_jax.train.trainer import build_model
  mesh = parallel.make_mesh(cfg.mesh, devices)
  rules = parallel.logical_rules(cfg.mesh, cfg.model, mesh)
  problems = parallel.check_fp8_alignment(
      projections(cfg.model), mesh, rules, cfg.precision,
      batch_rows=cfg.batch_size // cfg.grad_accum_steps, seq_len=cfg.seq_len, mode="warn")
  model = build_model(cfg)
  optimizer = make_optimizer(cfg.opt, cfg.steps)
  return mesh, rules, model, optimizer, functools.partial(init_params, model), problems


def _jit_step(cfg, mesh, rules, model, optimizer, shardings):
  import jax
  from infir2_jax import parallel
  from infir2_jax.train.optim import make_apply, make_schedule
  from infir2_jax.train.step import make_train_step
  return jax.jit(make_train_step(model, optimizer, make_schedule(cfg.opt, cfg.steps),
                                 cfg.grad_accum_steps,
                                 apply=make_apply(cfg.opt, cfg.steps, optimizer)),
                 in_shardings=(shardings, parallel.batch_sharding(mesh, rules)),
                 out_shardings=(shardings, parallel.replicated(mesh)), donate_argnums=0)


def memory_analysis_dict(compiled) -> dict:
  m = compiled.memory_analysis()
  if m is None:
    return {}
  keys = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
          "temp_size_in_bytes", "generated_code_size_in_bytes", "peak_memory_in_bytes")
  out = {k: int(getattr(m, k)) for k in keys if hasattr(m, k)}
  # Live at once: inputs + temporaries + outputs not aliased to (donated) inputs.
  out["total_bytes"] = (out["argument_size_in_bytes"] + out["temp_size_in_bytes"]
                        + out["output_size_in_bytes"] - out["alias_size_in_bytes"])
  return out


def train_one(spec: dict) -> dict:
  """Trains spec["steps"] steps of one (recipe, mesh) in this process; returns its numbers."""
  import flax.linen as nn
  import jax
  from infir2_jax.bench import tools as benchtools
  from infir2_jax import parallel
  mesh_shape = tuple(spec["mesh"])
  cfg = load_config(spec["config"], tiny=spec["tiny"], recipe=spec["recipe"],
                    seq_len=spec["seq_len"], batch_size=spec["batch_size"], mesh=mesh_shape,
                    num_layers=spec.get("num_layers", 0), overrides=spec.get("overrides", ()))
  devices = jax.devices()[:math.prod(mesh_shape)]
  mesh, rules, model, optimizer, init, problems = _setup(cfg, devices)
  t0 = time.perf_counter()
  state, shardings = parallel.sharded_init(init, optimizer, mesh, rules, jax.random.key(0))
  jax.block_until_ready(state)
  init_s = time.perf_counter() - t0
  batch_sharding = parallel.batch_sharding(mesh, rules)
  batch = jax.device_put(
      benchtools.synthetic_batch(cfg.batch_size, cfg.seq_len, cfg.model.vocab_size),
      batch_sharding)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    t0 = time.perf_counter()
    compiled = _jit_step(cfg, mesh, rules, model, optimizer, shardings).lower(
        state, batch).compile()
    compile_s = time.perf_counter() - t0
    times, losses = [], []
    for _ in range(spec["steps"] + 1):  # the first step is a warm-up
      t0 = time.perf_counter()
      state, metrics = compiled(state, batch)
      losses.append(float(metrics["loss"]))  # waits for the step
      times.append(time.perf_counter() - t0)
  step_s = statistics.median(times[1:])
  tokens = cfg.batch_size * cfg.seq_len
  peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in devices]
  return {"kind": "train", "config": spec["config"], "recipe": cfg.precision.recipe,
          "mesh": dict(zip(MESH_NAMES, mesh_shape)), "devices": len(devices),
          "device_kind": devices[0].device_kind, "seq_len": cfg.seq_len,
          "batch_size": cfg.batch_size, "num_layers": cfg.model.num_layers,
          "params": cfg.model.num_params(), "init_s": init_s, "compile_s": compile_s,
          "step_times_s": times[1:], "median_step_s": step_s, "tokens_per_s": tokens / step_s,
          "model_tflops_per_device": cfg.model.flops_per_token(cfg.seq_len) * tokens
                                     / step_s / len(devices) / 1e12,
          "peak_bytes_per_device": peaks, "memory_analysis": memory_analysis_dict(compiled),
          "losses": losses, "fp8_alignment_problems": problems,
          "overrides": list(spec.get("overrides", ())), "remat": cfg.model.remat}


def compile_only_devices(num: int, tiny: bool):
  """(devices, how): `num` devices to compile for, without needing them attached.

  On GPUs: a compile-only PJRT topology "1x1xN" (slices x hosts x devices) whose target
  config the CUDA plugin takes from the attached GPU (XLA's PJRT_GpuDeviceTopology_Create).
  Without a GPU, $INFIR2_GPU_TARGET_CONFIG names a GpuTargetConfigProto text file (see
  benchmarks/gpu_target_configs/README.md): XLA then compiles for that GPU on the CPU host
  (deviceless: no autotuning, so memory and errors are real, kernel choices are defaults).
  """
  import jax
  from jax.experimental import topologies
  target = os.environ.get("INFIR2_GPU_TARGET_CONFIG")
  if target and not tiny:
    with open(target) as f:
      topology = topologies.get_topology_desc(platform="cuda", topology=f"1x1x{num}",
                                              target_config=f.read())
    return (list(topology.devices), f"deviceless compile for {topology.devices[0].device_kind}"
            f" from {os.path.basename(target)}")
  if tiny or jax.default_backend() == "cpu":
    return jax.devices()[:num], "cpu devices"
  topology = topologies.get_topology_desc(platform="cuda", topology=f"1x1x{num}")
  return (list(topology.devices),
          f"compile-only topology 1x1x{num} ({topology.devices[0].device_kind})")


def _as_on_hopper(cfg):
  """The choices a Hopper GPU process makes by itself, made explicit for a deviceless
  compile on a CPU host: cuDNN attention for "auto", the Pallas kernels for "auto"."""
  import dataclasses
  from jax._src.cudnn import fused_attention_stablehlo as cudnn_fa
  from infir2_jax.precision import kernels
  kernels.available = lambda: True  # the target is an H100/H200 (sm_90)
  # cuDNN's packed layout asks the attached GPU for sm_90; the target is one
  cudnn_fa.check_compute_capability = lambda *_: True
  if cfg.model.attention == "auto":
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention="cudnn"))
  return cfg


def aot_one(spec: dict) -> dict:
  """Compiles the train step for spec["devices"] GPUs ahead of time; memory per device."""
  import flax.linen as nn
  import jax
  from infir2_jax.bench import tools as benchtools
  from infir2_jax import parallel
  from infir2_jax.parallel.distributed import DEFAULT_MEMORY_FRACTION
  mesh_shape = tuple(spec["mesh"])
  cfg = load_config(spec["config"], tiny=spec["tiny"], recipe=spec["recipe"],
                    seq_len=spec["seq_len"], batch_size=spec["batch_size"], mesh=mesh_shape,
                    overrides=spec.get("overrides", ()))
  if spec.get("mock"):  # mock NCCL + remote devices: compiles for all, runs nothing
    jax.config.update("jax_mock_gpu_topology", spec["mock"])  # before the backend starts
    devices, how = jax.devices()[:spec["devices"]], f"mock GPU topology {spec['mock']}"
  elif spec.get("attached"):  # the trainer's own compile: autotuned on the attached GPU
    devices = jax.devices()[:spec["devices"]]
    how = f"compiled on the attached {devices[0].device_kind} (autotuned, as the trainer)"
  else:
    devices, how = compile_only_devices(spec["devices"], spec["tiny"])
  if how.startswith("deviceless"):  # compiling for the GPU on a CPU host: as on that GPU
    cfg = _as_on_hopper(cfg)
  mesh, rules, model, optimizer, init, problems = _setup(cfg, devices)
  structs, shardings = parallel.abstract_state(init, optimizer, mesh, rules)
  batch_sharding = parallel.batch_sharding(mesh, rules)
  batch = benchtools.abstract_batch(cfg.batch_size, cfg.seq_len, batch_sharding)
  t0 = time.perf_counter()
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    compiled = _jit_step(cfg, mesh, rules, model, optimizer, shardings).lower(
        structs, batch).compile()
  memory = memory_analysis_dict(compiled)
  needed = memory.get("total_bytes", math.inf)
  return {"kind": "aot", "config": spec["config"], "recipe": cfg.precision.recipe,
          "mesh": dict(zip(MESH_NAMES, mesh_shape)), "devices": len(devices), "how": how,
          "seq_len": cfg.seq_len, "batch_size": cfg.batch_size, "params": cfg.model.num_params(),
          "compile_s": time.perf_counter() - t0, "memory_analysis": memory,
          "fits_141GB": needed <= H200_BYTES,
          # what JAX's allocator may hand out: XLA_PYTHON_CLIENT_MEM_FRACTION of the card
          # (distributed.default_memory_fraction sets 0.95; JAX's own default 0.75 is smaller)
          "fits_allocator_pool": needed <= H200_BYTES * float(
              os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", DEFAULT_MEMORY_FRACTION)),
          "fp8_alignment_problems": problems,
          "overrides": list(spec.get("overrides", ())), "remat": cfg.model.remat}


def child_env(tiny: bool, **extra) -> dict:
  """A child's environment; tiny runs get 8 fake CPU devices, as in the tests."""
  env = dict(os.environ, **extra)
  if tiny:
    env["JAX_PLATFORMS"] = "cpu"
    if "xla_force_host_platform_device_count" not in env.get("XLA_FLAGS", ""):
      env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  return env


def _start_child(kind: str, spec: dict, **env) -> subprocess.Popen:
  cmd = [sys.executable, os.path.abspath(__file__), "_child", kind, json.dumps(spec)]
  return subprocess.Popen(cmd, env=child_env(spec["tiny"], **env), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)


def _child_result(kind: str, spec: dict, proc: subprocess.Popen) -> dict:
  stdout, stderr = proc.communicate()
  lines = [l for l in stdout.splitlines() if l.startswith("RESULT ")]
  if proc.returncode or not lines:
    return {"kind": kind, "spec": spec, "error": (stderr or stdout)[-3000:]}
  return json.loads(lines[-1][len("RESULT "):])


def run_child(kind: str, spec: dict, **env) -> dict:
  """Runs train_one / aot_one in a fresh process (its own memory peak); its JSON result.

  The parent never initialises a JAX backend: it would hold GPU memory the child needs.
  With spec["in_process"] (the CPU rehearsal) it runs here instead.
  """
  if spec.get("in_process"):
    try:
      return train_one(spec) if kind == "train" else aot_one(spec)
    except Exception as e:  # reported like a failed child
      return {"kind": kind, "spec": spec, "error": f"{type(e).__name__}: {e}"}
  return _child_result(kind, spec, _start_child(kind, spec, **env))


def run_train_specs(specs: list[dict], on_result=lambda r: None) -> list[dict]:
  """Single-GPU runs side by side, one per GPU (compiling is the slow part); the rest in turn.

  on_result(result) is called as each finishes (the caller saves what it has so far).
  """
  single = [s for s in specs if math.prod(s["mesh"]) == 1 and not s.get("in_process")]
  gpus = local_gpu_count() if single else 1
  results = {}
  for start in range(0, len(single), gpus):
    batch = single[start:start + gpus]
    procs = [_start_child("train", s, CUDA_VISIBLE_DEVICES=str(i)) for i, s in enumerate(batch)]
    for s, p in zip(batch, procs):
      results[id(s)] = _child_result("train", s, p)
      print_table([results[id(s)]])
      on_result(results[id(s)])
  for s in specs:
    if id(s) not in results:
      results[id(s)] = run_child("train", s)
      print_table([results[id(s)]])
      on_result(results[id(s)])
  return [results[id(s)] for s in specs]


def local_gpu_count() -> int:
  try:
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    return max(sum(line.startswith("GPU ") for line in out.stdout.splitlines()), 1)
  except (OSError, subprocess.SubprocessError):
    return 1


def aot_with_fallback(spec: dict) -> dict:
  result = run_child("aot", spec)
  if "error" in result and not spec["tiny"]:  # no compile-only topology: mock one
    local = local_gpu_count()
    if spec["devices"] % local:
      return result
    mock = f"1x{spec['devices'] // local}x{local}"
    retry = run_child("aot", dict(spec, mock=mock))
    retry["first_attempt_error"] = result["error"][-800:]
    result = retry
  return result


def parse_mesh(text: str) -> tuple[int, int, int]:
  sizes = tuple(int(s) for s in text.split("x"))
  if len(sizes) != 3:
    raise ValueError(f"mesh {text!r}: expected DATAxFSDPxTENSOR, e.g. 1x2x1")
  return sizes


def print_table(results: list[dict]) -> None:
  gb = lambda b: f"{b / 1e9:7.2f}" if isinstance(b, (int, float)) else "      -"
  print(f"{'kind':5} {'config':16} {'recipe':8} {'mesh d/f/t':10} {'step ms':>8} "
        f"{'tok/s':>9} {'TFLOP/s/dev':>11} {'peak GB/dev':>11} {'XLA GB/dev':>10} note")
  for r in results:
    mesh = "/".join(str(v) for v in r.get("mesh", {}).values()) or "-"
    if "error" in r:
      print(f"{r['kind']:5} {os.path.basename(r['spec']['config']):16} {r['spec']['recipe']:8} "
            f"{'x'.join(map(str, r['spec']['mesh'])):10} ERROR {r['error'].splitlines()[-1][:80]}")
      continue
    peaks = [p for p in r.get("peak_bytes_per_device", []) if p is not None]
    step = f"{r['median_step_s'] * 1e3:8.1f}" if "median_step_s" in r else "       -"
    tok = f"{r['tokens_per_s']:9.0f}" if "tokens_per_s" in r else "        -"
    tf = f"{r['model_tflops_per_device']:11.1f}" if "model_tflops_per_device" in r else " " * 11
    note = (f"fits 141 GB: {r['fits_141GB']}, the allocator's pool: "
            f"{r.get('fits_allocator_pool')} ({r['how']})" if r["kind"] == "aot"
            else f"fp8 misaligned: {len(r['fp8_alignment_problems'])}")
    print(f"{r['kind']:5} {os.path.basename(r['config']):16} {r['recipe']:8} {mesh:10} {step} "
          f"{tok} {tf}     {gb(max(peaks)) if peaks else '      -'}    "
          f"{gb(r['memory_analysis'].get('total_bytes'))} {note}")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("mode", choices=["train", "aot", "all", "_child"])
  parser.add_argument("child", nargs="*", help=argparse.SUPPRESS)
  parser.add_argument("--tiny", action="store_true", help="CPU rehearsal: tiny widths")
  parser.add_argument("--children", action="store_true",
                      help="with --tiny: still one process per run, as on GPUs")
  parser.add_argument("--config", default="configs/1p5b.py")
  parser.add_argument("--aot_config", default="configs/7b.py")
  parser.add_argument("--recipes", default="bf16,infir2")
  parser.add_argument("--meshes", default="1x1x1,1x2x1,1x1x2", help="train meshes d x f x t")
  parser.add_argument("--runs", default="",
                      help="train runs RECIPE@MESH instead of recipes x meshes, e.g. "
                           "bf16@1x1x1,infir2@1x1x1,infir2@1x2x1")
  parser.add_argument("--aot_meshes", default="1x2x4", help="AOT meshes over --aot_devices")
  parser.add_argument("--aot_devices", type=int, default=8)
  parser.add_argument("--seq_len", type=int, default=4096)
  parser.add_argument("--batch_size", type=int, default=4)
  parser.add_argument("--aot_batch_size", type=int, default=8)
  parser.add_argument("--steps", type=int, default=5, help="timed steps after one warm-up")
  parser.add_argument("--num_layers", type=int, default=0, help="override (0 = the config's)")
  parser.add_argument("--override", action="append", default=[],
                      help="config override a.b=v for every run (repeatable)")
  parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."),
                                                    "sharding_gpu.json"))
  args = parser.parse_args(argv)
  if args.mode == "_child":
    kind, spec = args.child[0], json.loads(args.child[1])
    if kind == "train" and not spec["tiny"]:  # runs after the first reuse its init compile
      from infir2_jax.parallel import distributed
      distributed.default_memory_fraction()
      distributed.enable_compilation_cache()
    print("RESULT " + json.dumps(train_one(spec) if kind == "train" else aot_one(spec)),
          flush=True)
    return 0
  if args.tiny:
    args.seq_len, args.batch_size, args.aot_batch_size = 128, 4, 8
    os.environ.update(child_env(True))  # before this process imports jax (in-process runs)
  # imports jax; run_info(with_device=False) starts no backend
  from infir2_jax.bench import tools as benchtools
  results = []
  common = {"tiny": args.tiny, "seq_len": args.seq_len, "overrides": args.override,
            "in_process": args.tiny and not args.children}
  info = benchtools.run_info(sys.argv if argv is None else ["sharding_gpu.py", *argv],
                             with_device=False)

  def save(partial=None):  # after every run: a call cut short keeps what it measured
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
      json.dump({**info, "args": vars(args), "results": results + (partial or [])}, f,
                indent=1)

  if args.mode in ("train", "all"):
    runs = ([r.split("@") for r in args.runs.split(",")] if args.runs else
            [(recipe, mesh) for recipe in args.recipes.split(",")
             for mesh in args.meshes.split(",")])
    done = []
    results += run_train_specs(
        [dict(common, config=args.config, recipe=recipe, mesh=parse_mesh(mesh),
              batch_size=args.batch_size, steps=args.steps, num_layers=args.num_layers)
         for recipe, mesh in runs],
        on_result=lambda r: (done.append(r), save(done)))
    save()
  if args.mode in ("aot", "all"):
    for mesh in args.aot_meshes.split(","):
      spec = dict(common, config=args.aot_config, recipe=args.recipes.split(",")[-1],
                  mesh=parse_mesh(mesh), devices=args.aot_devices,
                  batch_size=args.aot_batch_size)
      results.append(aot_with_fallback(spec))
      print_table(results[-1:])
      save()
  print()
  print_table(results)
  save()
  print(f"wrote {args.out}")
  return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
  sys.exit(main())
