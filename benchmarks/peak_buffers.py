"""What is live at a train step's memory peak, by owner, from the GPU compiler's own buffer
assignment (a deviceless compile for the H200 on a CPU host: no device time; with
--attached, the trainer's own autotuned compile on the attached GPU).

  CUDA_ROOT=<dir with bin/ptxas> JAX_PLATFORMS=cpu \\
  INFIR2_GPU_TARGET_CONFIG=$PWD/benchmarks/gpu_target_configs/h200.txtpb PYTHONPATH=. \\
      /tmp/gpuaot/bin/python benchmarks/peak_buffers.py --config=configs/7b.py --seq_len=4096 \\
      --batch_size=4 --variants='infir2,infir2~opt.moments=fp8~model.loss_chunk=2048' \\
      --out=benchmarks/results/peak_buffers_7b_s19.json

Each variant is compiled in its own process with XLA's dump on; the train step's live-range
file (`*-live-range.txt`) names the instruction at the peak and gives the "stack trace
breakdown for peak usage": each live buffer under the op (or the argument path) that made
it. Its top-level entries are grouped here into owners: master weights, Adam's moments,
the batch, and the step's own buffers by the op that made them (the scan's stacked weights,
the loss's float32 logits and their gradient, the scan's saved layer inputs, ...).
XLA:GPU's deviceless compile skips autotuning, so the workspace of autotuned kernels is
not in it: the H200 measured 127.2 GiB where this allocates 121.5 for the 7B's infir2 step.

The headline is what the compiled step allocates (arguments + temporaries, the buffer
assignment). The live-range breakdown names what is live at the peak, but it counts values,
not memory: a scan's stacked residuals are one slice that it counts twice (the op that fills
it and the loop's copy), and it ignores packing, so its total can read well above or below
the allocation (7B save_dots_fp8: 186.7 against 127.4 GiB; session 21,
results/peak_buffers_7b_s21_remat_summary.json). Read owners from it, totals from the first.
"""
import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from infir2_jax.bench import labels  # pylint: disable=wrong-import-position

_ENTRY = re.compile(r"^      [├└]── (.+?) \(([\d.]+)%, total: ([\d ]+) bytes")
_PEAK = re.compile(r"Live ranges at (\d+) \(peak\)")


def owner(name: str) -> str:
  """The owner of a top-level entry of XLA's peak breakdown."""
  if name == "state" or name.startswith("state['params']"):
    return "master weights (float32)"
  if ".mu[" in name or ".nu[" in name or "opt_state" in name:
    return "Adam moments"
  if name == "batch" or name.startswith("batch"):
    return "batch"
  if name == "jit(train_step)/convert_element_type":   # train/step.compute_dtype_grad_fn
    return "the params' bf16 copies the step differentiates (bf16 gradients)"
  if "_scanned_layers/stack" in name:
    return "the scan's stacked weights (bf16 copy of every layer's)"
  if "take_along_axis" in name or "transpose(jvp())/mul" in name or "log_softmax" in name \
      or "logsumexp" in name:
    return "loss: float32 logits and their gradient"
  if "_scanned_layers/while" in name:
    return "the scan's saved layer inputs (remat residuals)"
  if re.search(r"jvp\(Qwen2\)/layers_\d+/", name):   # unrolled layers: what remat keeps
    return "the layers' saved activations (GEMM outputs; FP8 operands with save_dots_fp8)"
  if name.startswith("jit(train_step)/transpose(jvp())/while"):
    return "loss: the chunked loss's backward loop"
  if "transpose(jvp" in name:
    return "backward: other gradients and temporaries"
  if "jvp(" in name:
    return "forward: other activations and temporaries"
  return "other"


def parse_live_range(text: str) -> dict:
  """{peak_instruction, peak_bytes, entries: [(name, bytes)], by_owner: {owner: bytes}}."""
  peak = _PEAK.search(text)
  start = text.find("Stack trace breakdown for peak usage")
  if start < 0:
    raise ValueError("no 'Stack trace breakdown for peak usage' in the live-range dump")
  total = int(re.search(r"peak usage: ([\d ]+) bytes", text[start:]).group(1).replace(" ", ""))
  entries = []
  for line in text[start:].splitlines():
    m = _ENTRY.match(line)
    if m:
      entries.append((m.group(1), int(m.group(3).replace(" ", ""))))
  by_owner = {}
  for name, size in entries:
    by_owner[owner(name)] = by_owner.get(owner(name), 0) + size
  return {"peak_instruction": int(peak.group(1)) if peak else None, "peak_bytes": total,
          "entries": sorted(entries, key=lambda e: -e[1])[:25],
          "by_owner": dict(sorted(by_owner.items(), key=lambda kv: -kv[1]))}


_SLICE = re.compile(r"^\s*[\d.]+[KMG]iB\(\s*\d+%\);\s*([\d.]+)([KMG])iB;\s*\d+;\s*\d+;\s*(.+)$")
_TOTAL = re.compile(r"^Total bytes: (\d+)")


def parse_memory_usage(text: str, top: int = 12) -> dict:
  """{total_bytes, slices: [(GiB, shapes)]} of XLA's memory-usage report: the allocation's
  largest slices of memory, each with the shapes of the values that share it over the step
  (what the allocation holds, where the live-range breakdown names owners at one point)."""
  total = next((int(m.group(1)) for m in map(_TOTAL.match, text.splitlines()) if m), None)
  if total is None:
    raise ValueError("no 'Total bytes' line in the memory-usage report")
  unit = {"K": 2**-20, "M": 2**-10, "G": 1.0}
  slices = [(float(m.group(1)) * unit[m.group(2)], m.group(3).strip())
            for m in map(_SLICE.match, text.splitlines()) if m]
  return {"total_bytes": total, "slices": slices[:top]}


# an instruction's definition; its type may be a tuple "(T0, T1)" (multi-output fusions)
_DEFINITION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+) = ")
_BF16_ADD = re.compile(r"^%([\w.\-]+) \([\w.]+: bf16\[\], [\w.]+: bf16\[\]\) -> bf16\[\] \{",
                       re.M)
_REDUCE = re.compile(r"= bf16\[[\d,]*\]\S* reduce\(.*to_apply=%([\w.\-]+)")


def count_kernels(hlo_text: str) -> dict:
  """The compiled step's kernels (fusions, custom calls, copies of its entry computation),
  the bytes XLA's own kernels of them move, the fusions that recompute a remat'd layer's
  forward in the backward pass, and the reductions anywhere in the program that add in
  bf16 (XLA:GPU rounds every partial sum: precision/cotangents.py)."""
  from infir2_jax.bench.hlo_bytes import instruction_bytes, kernel_name, split_type
  entry = hlo_text[hlo_text.index("\nENTRY "):]
  entry = entry[:entry.index("\n}")]
  kernels = {}   # name: op, of the entry's fusions, custom calls and copies
  for line in entry.splitlines():
    m = _DEFINITION.match(line)
    if m:
      op = split_type(line[m.end():])[1].split("(", 1)[0]
      if op in ("fusion", "custom-call", "copy"):
        kernels[m.group(1)] = (op, line)
  bf16_adds = set(_BF16_ADD.findall(hlo_text))
  sizes = instruction_bytes(hlo_text)
  xla_kernels = [kernel_name(n) for n, (op, _) in kernels.items() if op != "custom-call"]
  return {"kernels": len(kernels),
          # bytes XLA's own kernels (fusions, copies) of the entry computation move
          # (infir2_jax.bench.hlo_bytes): what the step's elementwise rest reads and writes
          "xla_kernel_bytes": sum(sizes[k]["bytes"] for k in xla_kernels if k in sizes),
          "recomputed_fusions": sum(op == "fusion" and "rematted_computation" in l
                                    for op, l in kernels.values()),
          "bf16_reductions": sum(m is not None and m.group(1) in bf16_adds
                                 for m in map(_REDUCE.search, hlo_text.splitlines()))}


def _child(config: str, label: str, seq_len: int, batch_size: int, attached: bool) -> dict:
  """One compile with the dump on (runs in its own process): deviceless, or autotuned on
  the attached GPU."""
  import sharding_gpu  # benchmarks/
  recipe, *overrides = label.split("~")
  overrides = [o for o in overrides if not labels.is_env_part(o)]   # in the environment
  spec = {"config": config, "tiny": False, "recipe": recipe, "seq_len": seq_len,
          "batch_size": batch_size, "mesh": [1, 1, 1], "devices": 1, "overrides": overrides,
          "attached": attached}
  result = sharding_gpu.aot_one(spec)
  dump = os.environ["INFIR2_PEAK_DUMP"]
  files = glob.glob(os.path.join(dump, "*jit_train_step*after_optimizations-live-range.txt"))
  if not files:
    raise SystemExit(f"no train-step live-range file in {dump}")
  with open(max(files, key=os.path.getsize)) as f:
    result["peak"] = parse_live_range(f.read())
  hlos = glob.glob(os.path.join(dump, "*jit_train_step*after_optimizations.txt"))
  if hlos:
    with open(max(hlos, key=os.path.getsize)) as f:
      result["kernel_counts"] = count_kernels(f.read())
  reports = glob.glob(os.path.join(
      dump, "*jit_train_step*after_optimizations-memory-usage-report.txt"))
  if reports:
    with open(max(reports, key=os.path.getsize)) as f:
      result["allocation"] = parse_memory_usage(f.read())
  return result


def main(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--config", default="configs/7b.py")
  p.add_argument("--seq_len", type=int, default=4096)
  p.add_argument("--batch_size", type=int, default=4)
  p.add_argument("--variants", default="infir2,bf16",
                 help="comma-separated: a recipe with ~a.b=v overrides")
  p.add_argument("--out", default="")
  p.add_argument("--attached", action="store_true",
                 help="compile on the attached GPU, autotuned as the trainer's compile is "
                      "(the deviceless compile leaves autotuned kernels' workspace out)")
  p.add_argument("--child", default="", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.child:
    print("RESULT " + json.dumps(_child(args.config, args.child, args.seq_len,
                                        args.batch_size, args.attached)), flush=True)
    return
  from infir2_jax.bench import tools as benchtools
  out = {"info": benchtools.run_info(["benchmarks/peak_buffers.py", *argv],
                                     with_device=args.attached),
         "device": ("the attached GPU (autotuned compile)" if args.attached else
                    "deviceless compile for the H200 (INFIR2_GPU_TARGET_CONFIG)"), "rows": {}}
  for label in args.variants.split(","):
    with tempfile.TemporaryDirectory() as dump:
      env = dict(os.environ, **labels.env_of(label), INFIR2_PEAK_DUMP=dump,
                 XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") +
                            f" --xla_dump_to={dump} --xla_dump_hlo_module_re=.*train_step.*"
                            " --xla_dump_hlo_pass_re=NONE").strip())
      proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", label,
                             f"--config={args.config}", f"--seq_len={args.seq_len}",
                             f"--batch_size={args.batch_size}",
                             *(["--attached"] if args.attached else [])], env=env,
                            capture_output=True, text=True, cwd=ROOT)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if proc.returncode or not lines:
      out["rows"][label] = {"error": (proc.stderr or proc.stdout)[-2000:]}
      print(f"{label}: FAILED\n{out['rows'][label]['error'][-600:]}", flush=True)
    else:
      r = json.loads(lines[-1][len("RESULT "):])
      out["rows"][label] = {"memory_analysis": r["memory_analysis"], "peak": r["peak"],
                            "allocation": r.get("allocation"),
                            "kernel_counts": r.get("kernel_counts"),
                            "compile_s": r["compile_s"], "how": r["how"]}
      gib = lambda b: b / 2**30
      mem = r["memory_analysis"]
      allocated = mem["argument_size_in_bytes"] + mem["temp_size_in_bytes"]
      out["rows"][label]["allocated_gib"] = gib(allocated)
      print(f"{label}: allocates {gib(allocated):.1f} GiB (arguments "
            f"{gib(mem['argument_size_in_bytes']):.1f} + temporaries "
            f"{gib(mem['temp_size_in_bytes']):.1f}); live ranges at the peak "
            f"{gib(r['peak']['peak_bytes']):.1f} GiB at instruction "
            f"{r['peak']['peak_instruction']}, by owner:", flush=True)
      if r.get("kernel_counts"):
        print(f"  kernels: {r['kernel_counts']}", flush=True)
      for name, size in r["peak"]["by_owner"].items():
        print(f"    {gib(size):7.2f} GiB  {name}", flush=True)
      if r.get("allocation"):
        print("  the allocation's largest slices (the values that share each):", flush=True)
        for size, shapes in r["allocation"]["slices"][:6]:
          print(f"    {size:7.2f} GiB  {shapes[:140]}", flush=True)
    if args.out:
      with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  main(sys.argv[1:])
