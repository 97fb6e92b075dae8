"""The block-scaled GEMM's machine code, compiled for the H200 on a CPU host (no device time):
SASS instructions, registers and the opcodes of the promotion, per shape and scale kind.

  CUDA_ROOT=<dir with bin/ptxas, bin/nvdisasm> JAX_PLATFORMS=cpu \\
  INFIR2_GPU_TARGET_CONFIG=$PWD/benchmarks/gpu_target_configs/h200.txtpb PYTHONPATH=. \\
      /tmp/gpuaot/bin/python benchmarks/gemm_sass.py --out /tmp/gemm_sass.json

What it is for: the wgrad GEMMs (1x128 scales on both operands: "row") run at ~0.75-0.82x
the rate of fprop/dgrad (128x128 weight blocks: "block") in the step. Per K block, a row
kernel folds each partial sum with a per-row times per-column scale (FMUL + FFMA per
accumulator) where a block kernel with 128-wide tiles needs one FFMA with a per-row scale.
`k_block` reads the compute warpgroup's K-block loop out of the SASS: its length and the
instructions between the wgmma wait and the stage's release (the serial promotion).
benchmarks/NOTES_kernels.md (session 19) has the reading; the setup of the deviceless
compile is in benchmarks/fused_bwd_bisect.py's docstring.
"""
import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from infir2_jax.bench import tools as benchtools  # noqa: E402
from infir2_jax.precision.kernels import gemm  # noqa: E402
from infir2_jax.precision.kernels.tuning import TuningConfig, default_config  # noqa: E402

# (label, m, n, k, scale kind, config overrides): the 1.5B's large wgrads as the step runs
# them (row scales, the default 192-wide tile), then one 128-wide tile with each scale kind:
# the same tile and pipeline, promotion per row and column vs per row only.
CASES = (
    ("wgrad 1536x17920x16384 (step)", 1536, 17920, 16384, "row", {}),
    ("wgrad 8960x1536x16384 (step)", 8960, 1536, 16384, "row", {}),
    ("fprop 16384x17920x1536 (step)", 16384, 17920, 1536, "block", {}),
    ("1536x17920x16384 row, n128", 1536, 17920, 16384, "row", {"tile_n": 128}),
    ("1536x17920x16384 block, n128", 1536, 17920, 16384, "block", {"tile_n": 128}),
    ("wgrad 1536x17920x16384 scales_first", 1536, 17920, 16384, "row", {"scales_first": True}),
    ("wgrad 8960x1536x16384 scales_first", 8960, 1536, 16384, "row", {"scales_first": True}),
    ("fprop 16384x17920x1536 scales_first", 16384, 17920, 1536, "block", {"scales_first": True}),
    ("1536x17920x16384 row, n128 scales_first", 1536, 17920, 16384, "row",
     {"tile_n": 128, "scales_first": True}),
)
PROMOTION_OPS = ("FMUL", "FFMA", "FADD", "LDS", "LDS.64", "LDS.128", "WARPSYNC", "QGMMA",
                 "SHFL", "MOV", "LDL", "STL")


def k_block_loop(lines) -> dict:
  """Instructions of the compute warpgroup's K-block loop: from the barrier wait before its
  first QGMMA (wgmma with FP8 operands) to the loop's branch back, and the part between the
  wgmma wait (WARPGROUP.DEPBAR) and the stage's release (SYNCS.ARRIVE): the promotion, which
  runs while this warpgroup's tensor-core work is done and before it can issue the next."""
  import sass_opcodes
  insns = [(i, sass_opcodes._INSN.search(l).group(1)) for i, l in enumerate(lines)
           if sass_opcodes._INSN.search(l)]
  ops = [op for _, op in insns]
  first = next((j for j, op in enumerate(ops) if op.startswith("QGMMA")), None)
  if first is None:
    return {}
  start = max(j for j in range(first) if ops[j].startswith("SYNCS.PHASECHK"))
  end = next(j for j in range(first, len(ops)) if ops[j] == "BRA" and j > first + 4)
  wait = next(j for j in range(first, end) if ops[j].startswith("WARPGROUP.DEPBAR"))
  release = next((j for j in range(wait, end) if ops[j].startswith("SYNCS.ARRIVE")), end)
  body = ops[wait + 1:release]
  count = lambda name: sum(op == name or op.startswith(name + ".") for op in body)
  return {"loop_instructions": end - start + 1, "after_wgmma_wait": len(body),
          "qgmma": sum(op.startswith("QGMMA") for op in ops[start:end]),
          "promotion_fmul": count("FMUL"), "promotion_ffma": count("FFMA"),
          "promotion_lds": count("LDS")}


def kernel_code(m, n, k, kind, overrides) -> dict:
  """{instructions, registers, spill_bytes, opcodes} of the GEMM kernel for one case."""
  import sass_opcodes
  config = default_config(m, n, k, 132, b_scale=kind)
  config = TuningConfig(**{**config.__dict__, **overrides}) if overrides else config
  kb, nb = -(-k // 128), -(-n // 128)
  specs = (jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn),
           jax.ShapeDtypeStruct((m, kb), jnp.float32),
           jax.ShapeDtypeStruct((n, k), jnp.float8_e4m3fn),
           jax.ShapeDtypeStruct((n if kind == "row" else nb, kb), jnp.float32))
  fn = lambda a, sa, b, sb: gemm.block_scaled_matmul(a, sa, b, sb, config=config)
  text, _ = sass_opcodes.deviceless_dump(fn, specs)
  counts = sass_opcodes.opcode_counts(text.splitlines())
  kernel = next((c for name, c in counts.items() if gemm.KERNEL_NAME in name), None)
  regs = re.findall(r"Used (\d+) registers", text)
  spills = [int(a) + int(b) for a, b in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)]
  if kernel is None:
    return {"error": "no SASS in the dump (is nvdisasm in $CUDA_ROOT/bin?): " + text[-300:]}
  ops = {op: sum(v for key, v in kernel.items() if key == op or key.startswith(op + "."))
         for op in PROMOTION_OPS}
  return {"config": {key: getattr(config, key) for key in ("tile_m", "tile_n", "compute_wgs")},
          "instructions": sum(kernel.values()), "registers": max(map(int, regs)) if regs else None,
          "spill_bytes": max(spills) if spills else 0, "opcodes": ops,
          "k_block": k_block_loop(text.splitlines())}


def main(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", default="")
  p.add_argument("--only", default="", help="comma-separated substrings of case labels")
  args = p.parse_args(argv)
  result = {"info": benchtools.run_info(["benchmarks/gemm_sass.py", *argv], with_device=False),
            "device": "deviceless compile for the H200 (INFIR2_GPU_TARGET_CONFIG)", "rows": {}}
  for label, m, n, k, kind, overrides in CASES:
    if args.only and not any(s in label for s in args.only.split(",")):
      continue
    row = kernel_code(m, n, k, kind, overrides)
    result["rows"][label] = row
    print(f"{label:44s} {json.dumps(row)}", flush=True)
  if args.out:
    with open(args.out, "w") as fh:
      json.dump(result, fh, indent=1)


if __name__ == "__main__":
  main(sys.argv[1:])
