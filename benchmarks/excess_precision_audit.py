"""Which of the train step's kernel operands does XLA:GPU hand over with a rounding dropped?

XLA's default xla_allow_excess_precision lets XLA:GPU fold convert(convert(x, bf16), f32) to
x. Inside XLA's own fusions that only keeps more precision; before a Pallas kernel (a custom
call) it changes the kernel's input, so the kernel no longer computes its reference's bits
(session 30: the normed quantize kernel got float32 gamma, not gamma rounded to bf16).
The CPU compiler does not fold such a pair alone, so the CPU tests cannot see it.

This compiles the train step for the H200 on the CPU host (deviceless; set-up in
benchmarks/gpu_target_configs/README.md) twice, with XLA's defaults and with
xla_allow_excess_precision off, and compares every Mosaic GPU and Triton kernel call's
operands: each operand described by its producer (through bitcasts and tuple elements) and,
for a fusion, the count of each op in it. An operand that differs is a dropped rounding.

  CUDA_ROOT=<venv>/nvidia/cuda_nvcc JAX_PLATFORMS=cpu \\
  INFIR2_GPU_TARGET_CONFIG=$PWD/benchmarks/gpu_target_configs/h200.txtpb PYTHONPATH=. \\
      /tmp/gpuaot/bin/python benchmarks/excess_precision_audit.py --layers 2 \\
      --variants 'infir2~precision.fused_norm=True;infir2~opt.moments=fp8'
--negative_control puts session 29's convert pair back before the normed kernel: the audit
must then report that kernel's gamma (it shows the audit can fail).
"""
import argparse
import collections
import json
import re
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp

sys.path.insert(0, "benchmarks")
import sharding_gpu  # noqa: E402  (benchmarks/)
from infir2_jax import parallel  # noqa: E402
from infir2_jax.bench import tools as benchtools  # noqa: E402

EXACT = {"xla_allow_excess_precision": False}
_COMPUTATION = re.compile(r"^\s*(?:ENTRY )?%(\S+) \(.*\) -> .* \{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.+?) ([a-z\-]+)\((.*?)\)(.*)$")
_PLUMBING = ("parameter", "bitcast", "broadcast", "reshape", "slice", "constant", "tuple",
             "get-tuple-element")


def parse_hlo(text: str):
  """({computation: [opcodes]}, {instruction: (opcode, type, called computation, operands,
  rest of the line)}) of an optimized HLO module's text."""
  computations, instructions, current = {}, {}, None
  for line in text.splitlines():
    m = _COMPUTATION.match(line)
    if m:
      current = m.group(1)
      computations[current] = []
      continue
    m = _INSTRUCTION.match(line)
    if m and current:
      name, typ, op, args, rest = m.groups()
      computations[current].append(op)
      called = re.search(r"calls=%([^\s,]+)", rest)
      instructions[name] = (op, typ, called.group(1) if called else None, args, rest)
  return computations, instructions


def describe(name: str, computations, instructions, depth: int = 0) -> str:
  """An operand by its producer: through bitcasts, copies and tuple elements; a fusion by the
  count of each op it computes."""
  if name not in instructions:
    return "?"
  op, typ, called, args, _ = instructions[name]
  if op in ("bitcast", "get-tuple-element", "copy") and depth < 4:
    source = args.split(",")[0].strip().lstrip("%")
    return f"{op}<{describe(source, computations, instructions, depth + 1)}>"
  if op == "fusion" and called:
    ops = collections.Counter(o for o in computations.get(called, []) if o not in _PLUMBING)
    return f"fusion[{typ}:{','.join(f'{k}x{v}' for k, v in sorted(ops.items()))}]"
  return f"{op}[{typ}]"


def kernel_operands(text: str) -> dict:
  """{call signature (types): [operand descriptions of each call]} for the kernels."""
  computations, instructions = parse_hlo(text)
  calls = {}
  for op, typ, _, args, rest in instructions.values():
    if op == "custom-call" and ("mosaic_gpu" in rest or "triton" in rest):
      operands = [a.strip().lstrip("%") for a in args.split(",")]
      signature = typ + " <- " + ",".join(
          instructions[o][1] if o in instructions else "?" for o in operands)
      calls.setdefault(signature, []).append(
          tuple(describe(o, computations, instructions) for o in operands))
  return calls


def differences(default: dict, exact: dict) -> list:
  """The signatures whose calls' operands differ, with the calls found only on either side."""
  found = []
  for signature in sorted(set(default) | set(exact)):
    a, b = sorted(default.get(signature, [])), sorted(exact.get(signature, []))
    if a != b:
      found.append({"signature": signature, "default_only": [x for x in a if x not in b],
                    "exact_only": [x for x in b if x not in a]})
  return found


def audit(config: str, label: str, layers: int, seq_len: int, batch_size: int) -> dict:
  recipe, *overrides = label.split("~")
  devices, how = sharding_gpu.compile_only_devices(1, False)
  cfg = sharding_gpu.load_config(config, tiny=False, recipe=recipe, seq_len=seq_len,
                                 batch_size=batch_size, mesh=(1, 1, 1), num_layers=layers,
                                 overrides=overrides)
  cfg = sharding_gpu._as_on_hopper(cfg)
  mesh, rules, model, optimizer, init, _ = sharding_gpu._setup(cfg, devices)
  structs, shardings = parallel.abstract_state(init, optimizer, mesh, rules)
  batch = benchtools.abstract_batch(cfg.batch_size, cfg.seq_len,
                                    parallel.batch_sharding(mesh, rules))
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    lowered = sharding_gpu._jit_step(cfg, mesh, rules, model, optimizer, shardings).lower(
        structs, batch)
  t0 = time.perf_counter()
  default = kernel_operands(lowered.compile().as_text())
  exact = kernel_operands(lowered.compile(compiler_options=EXACT).as_text())
  found = differences(default, exact)
  return {"variant": label, "layers": layers, "how": how,
          "kernel_calls": sum(map(len, default.values())),
          "compile_s": time.perf_counter() - t0, "differing": found}


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--config", default="configs/1p5b.py")
  p.add_argument("--variants", default="infir2~precision.fused_norm=True;infir2~opt.moments=fp8")
  p.add_argument("--layers", type=int, default=2, help="layers compiled (each is the same)")
  p.add_argument("--seq_len", type=int, default=8192)
  p.add_argument("--batch_size", type=int, default=2)
  p.add_argument("--negative_control", action="store_true")
  p.add_argument("--out", default="")
  args = p.parse_args(argv)
  if args.negative_control:   # session 29's wrapper: the pair XLA:GPU folds
    from infir2_jax.precision.kernels import quantize
    quantize._rounded_to = lambda x, dtype: x.astype(dtype).astype(jnp.float32)
  result = {**benchtools.run_info(sys.argv), "negative_control": args.negative_control,
            "rows": []}
  for label in args.variants.split(";"):
    row = audit(args.config, label, args.layers, args.seq_len, args.batch_size)
    result["rows"].append(row)
    print(f"{label}: {row['kernel_calls']} kernel calls, "
          f"{len(row['differing'])} signatures with an operand XLA rounds differently", flush=True)
    for d in row["differing"]:
      print("  ", d["signature"][:160])
      for x in d["default_only"][:2]:
        print("     default:", x)
      for x in d["exact_only"][:2]:
        print("     exact:  ", x)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
