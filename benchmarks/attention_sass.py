"""The FP8 attention kernel's machine code, compiled for the H200 on a CPU host (no device
time): SASS instructions, registers, spills and shared memory per configuration.

  CUDA_ROOT=<dir with bin/ptxas, bin/nvdisasm> JAX_PLATFORMS=cpu \\
  INFIR2_GPU_TARGET_CONFIG=$PWD/benchmarks/gpu_target_configs/h200.txtpb PYTHONPATH=. \\
      /tmp/gpuaot/bin/python benchmarks/attention_sass.py --out /tmp/attention_sass.json

What it is for: the kernel (precision/kernels/fp8_attention.py) must lower and compile for
Hopper with its compute warpgroups under 232 registers and no spills, and its code inside
the SM's instruction cache (session 18: past ~6,700 SASS instructions a kernel ran 5x
slower), before any device time is spent timing it. The setup of the deviceless compile is
in benchmarks/fused_bwd_bisect.py's docstring.
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
from infir2_jax.precision.kernels import fp8_attention  # noqa: E402

# (label, AttentionConfig overrides) at the 1.5B's attention: 2 x 8192, 12 query heads,
# 2 key/value heads, head dim 128, 8 documents per row.
CASES = (
    ("block_q 64, 2 stages (default)", {}),
    ("block_q 64, 3 stages", {"max_concurrent_steps": 3}),
    ("block_q 128, 2 stages", {"block_q": 128}),
)


def shared_memory_bytes(config, length) -> int:
  """The kernel's scratch (its run_scoped buffers), without alignment padding."""
  bq, steps, dh, bkv = config.block_q, config.max_concurrent_steps, 128, 128
  per_cta = 2 * bq * dh + 2 * bq * dh * 2 + 2 * bq * 4 * 2 + 2 * bq * bkv  # Q8, out, sq+seg, P8
  per_stage = bkv * dh * 2 + bkv * 4 * 2 + dh * 4                           # K8, V8T, sk+seg, sv
  return per_cta + steps * per_stage + 4 * -(-(length // (2 * bq)) // 4) * 4


def kernel_code(overrides, batch=2, length=8192, heads=12, kv_heads=2) -> dict:
  import sass_opcodes
  config = fp8_attention.AttentionConfig(**overrides)
  bf16 = jnp.bfloat16
  specs = [jax.ShapeDtypeStruct((batch, length, heads, 128), bf16),
           jax.ShapeDtypeStruct((batch, length, kv_heads, 128), bf16),
           jax.ShapeDtypeStruct((batch, length, kv_heads, 128), bf16),
           jax.ShapeDtypeStruct((batch, length), jnp.int32)]
  fn = lambda q, k, v, seg: fp8_attention.fp8_attention_forward(q, k, v, seg, config=config)
  text, device_kind = sass_opcodes.deviceless_dump(fn, specs)
  counts = sass_opcodes.opcode_counts(text.splitlines())
  ours = {k: v for k, v in counts.items() if fp8_attention.KERNEL_NAME in k}
  (name, ops), = ours.items()
  regs = re.findall(r"Used (\d+) registers", text)
  spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
  return {"kernel": name, "device_kind": device_kind, "sass_instructions": sum(ops.values()),
          "registers": [int(r) for r in regs], "spill_bytes": [list(map(int, s)) for s in spills],
          "shared_memory_bytes": shared_memory_bytes(config, length),
          "top_opcodes": dict(ops.most_common(25))}


def main(argv):
  p = argparse.ArgumentParser()
  p.add_argument("--out", default="")
  args = p.parse_args(argv)
  result = {"info": benchtools.run_info(["benchmarks/attention_sass.py", *argv],
                                        with_device=False), "cases": []}
  for label, overrides in CASES:
    try:
      row = {"case": label, "config": overrides, **kernel_code(overrides)}
    except Exception as e:  # a config that does not lower is a result too
      row = {"case": label, "config": overrides, "error": f"{type(e).__name__}: {e}"[:2000]}
    result["cases"].append(row)
    print(json.dumps({k: v for k, v in row.items() if k != "top_opcodes"}), flush=True)
  if args.out:
    with open(args.out, "w") as fh:
      json.dump(result, fh, indent=1)


if __name__ == "__main__":
  main(sys.argv[1:])
