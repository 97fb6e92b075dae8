"""Opcode counts per kernel from a Mosaic GPU SASS dump (MOSAIC_GPU_DUMP_SASS=1 output).

  MOSAIC_GPU_DUMP_SASS=1 python3 benchmarks/fused_bwd_bisect.py ... > sass.log 2>&1
  python3 benchmarks/sass_opcodes.py sass.log --top=40 --out=sass.json

A kernel starts at a line naming its function (`Function : NAME` or `.text.NAME`); each
instruction line `/*0x...*/  [@P0] OPCODE.MODS operands ;` counts under OPCODE (modifiers
kept: F2FP.BF16.F32.PACK_AB and MUFU.EX2 differ in cost). Branches to a slow path (CALL.REL,
BSSY) and local-memory traffic (LDL/STL) are what this is for.
"""
import argparse
import collections
import json
import re
import sys

_FUNC = re.compile(r"(?:Function\s*:\s*|\.text\.)([A-Za-z_][\w$.]*)")
_INSN = re.compile(r"/\*[0-9a-fx]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)")


def opcode_counts(lines):
  """{kernel name: Counter(opcode -> count)} over the dump's lines."""
  kernels, current = {}, None
  for line in lines:
    m = _FUNC.search(line)
    if m and "/*" not in line:
      current = m.group(1)
      kernels.setdefault(current, collections.Counter())
      continue
    m = _INSN.search(line)
    if m and current is not None:
      kernels[current][m.group(1)] += 1
  return kernels


def deviceless_dump(fn, specs) -> tuple[str, str]:
  """Compiles fn(*specs) for $INFIR2_GPU_TARGET_CONFIG's GPU on this (CPU) host with Mosaic
  GPU's ptxas report and SASS on; returns (what it printed, the device kind). Mosaic GPU
  prints both to fd 1, so the compile runs with fd 1 redirected to a temporary file."""
  import os
  import tempfile
  import jax
  import linear_kernels  # benchmarks/: the H200 topology from INFIR2_GPU_TARGET_CONFIG
  os.environ["MOSAIC_GPU_DUMP_SASS"] = os.environ["MOSAIC_GPU_DUMP_PTXAS"] = "1"
  device = linear_kernels.h200_device()
  mesh = jax.sharding.Mesh([device], ("x",))
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  specs = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=rep) for s in specs]
  with tempfile.TemporaryFile("w+") as dump:
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(dump.fileno(), 1)
    try:
      with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",)).compile()
    finally:
      sys.stdout.flush()
      os.dup2(saved, 1)
      os.close(saved)
    dump.seek(0)
    return dump.read(), device.device_kind


def main(argv):
  p = argparse.ArgumentParser()
  p.add_argument("dump")
  p.add_argument("--top", type=int, default=30)
  p.add_argument("--out", default="")
  args = p.parse_args(argv)
  with open(args.dump, errors="replace") as fh:
    kernels = opcode_counts(fh)
  for name, counts in kernels.items():
    print(f"{name}: {sum(counts.values())} instructions")
    print("  " + ", ".join(f"{op} {n}" for op, n in counts.most_common(args.top)))
  if args.out:
    with open(args.out, "w") as fh:
      json.dump({k: dict(v) for k, v in kernels.items()}, fh, indent=1)


if __name__ == "__main__":
  main(sys.argv[1:])
