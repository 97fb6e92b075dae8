"""Compile time of the train step: unrolled layers vs model.scan_layers, per recipe.

  python benchmarks/compile_time.py --config=configs/1p5b.py --recipes=bf16,infir2 \
      --seq_len=2048 --batch_size=1 --out=benchmarks/results/compile_time_cpu.json

Each (recipe, scan_layers) is lowered and compiled ahead of time from abstract shapes (no
device memory, nothing runs) in a fresh process, so no compilation cache is shared. On the
H200 the FP8 train step of the unrolled 28-layer 1.5B took over 7 minutes to compile (bf16:
under one), which is what scan_layers is for.
"""

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def compile_one(config: str, overrides: list[str]) -> dict:
  import jax
  from infir2_jax.bench.tools import compile_train_step
  from infir2_jax.config import load_config

  step = compile_train_step(load_config(config, ["mesh.data=1", *overrides]), jax.devices()[:1])
  memory = step.compiled.memory_analysis()
  return {"overrides": overrides, "lower_s": step.lower_s, "compile_s": step.compile_s,
          "hlo_chars": len(step.compiled.as_text()),
          "temp_gib": getattr(memory, "temp_size_in_bytes", 0) / 2**30,
          "argument_gib": getattr(memory, "argument_size_in_bytes", 0) / 2**30}


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--config", default="configs/1p5b.py")
  p.add_argument("--recipes", default="bf16,infir2")
  p.add_argument("--seq_len", type=int, default=2048)  # configs/1p5b.py chunks its loss by 2048
  p.add_argument("--batch_size", type=int, default=1)
  p.add_argument("--override", action="append", default=[])
  p.add_argument("--scan", default="False,True", help="scan_layers values to compile")
  p.add_argument("--out", default="")
  p.add_argument("--child", default="", help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.child:
    print("RESULT " + json.dumps(compile_one(args.config, json.loads(args.child))), flush=True)
    return
  from infir2_jax.bench import tools as benchtools
  results = {**benchtools.run_info(sys.argv), "variants": []}
  print(f"{'recipe':16} {'scan':>5} {'lower s':>8} {'compile s':>9} {'temp GiB':>8}")
  for recipe in args.recipes.split(","):
    for scan in (v.strip() == "True" for v in args.scan.split(",")):
      overrides = [f"precision.recipe={recipe}", f"model.scan_layers={scan}",
                   f"seq_len={args.seq_len}", f"batch_size={args.batch_size}", *args.override]
      proc = subprocess.run([sys.executable, __file__, "--config", args.config,
                             "--child", json.dumps(overrides)], capture_output=True, text=True)
      lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
      if proc.returncode or not lines:
        r = {"overrides": overrides, "error": (proc.stderr or proc.stdout)[-2000:]}
        print(f"{recipe:16} {scan!s:>5} FAILED {r['error'][-300:]}", flush=True)
      else:
        r = json.loads(lines[-1][len("RESULT "):])
        print(f"{recipe:16} {scan!s:>5} {r['lower_s']:8.1f} {r['compile_s']:9.1f} "
              f"{r['temp_gib']:8.2f}", flush=True)
      r.update(recipe=recipe, scan_layers=scan)
      results["variants"].append(r)
      if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
          json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
