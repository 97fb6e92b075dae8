"""Ahead-of-time compile of a config's train step from abstract shapes, with XLA's memory
analysis: no parameter is ever allocated, so any config compiles on any machine.

  python benchmarks/aot_memory.py --config=configs/1p5b.py --seq_len=4096 --batch_size=4 \
      --out=benchmarks/results/aot_1p5b_cpu.json
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--config", default="configs/1p5b.py")
  p.add_argument("--seq_len", type=int, default=4096)
  p.add_argument("--batch_size", type=int, default=4)
  p.add_argument("--override", action="append", default=[])
  p.add_argument("--out", default="")
  args = p.parse_args()
  import jax
  from infir2_jax.bench.tools import compile_train_step
  from infir2_jax.config import load_config

  cfg = load_config(args.config, [f"seq_len={args.seq_len}", f"batch_size={args.batch_size}",
                                  *args.override])
  step = compile_train_step(cfg)
  compiled, mesh = step.compiled, step.mesh
  compile_s = step.lower_s + step.compile_s
  params = cfg.model.num_params()
  m = compiled.memory_analysis()
  gib = lambda n: n / 2**30
  result = {
      "config": args.config, "overrides": args.override, "seq_len": cfg.seq_len,
      "batch_size": cfg.batch_size, "recipe": cfg.precision.recipe, "remat": cfg.model.remat,
      "backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
      "num_devices": mesh.size, "params": params, "compile_s": compile_s,
      "argument_gib": gib(m.argument_size_in_bytes), "output_gib": gib(m.output_size_in_bytes),
      "alias_gib": gib(m.alias_size_in_bytes), "temp_gib": gib(m.temp_size_in_bytes),
      "generated_code_gib": gib(m.generated_code_size_in_bytes),
      "command": " ".join(["python"] + sys.argv), "jax": jax.__version__,
  }
  result["peak_estimate_gib"] = (result["argument_gib"] + result["output_gib"]
                                 - result["alias_gib"] + result["temp_gib"])
  print(json.dumps(result, indent=1))
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
