"""The Triton quantizers (kernels/quantize_triton.py) compiled for the H200 on a CPU host.

  CUDA_ROOT=/usr/local/cuda JAX_PLATFORMS=cpu PYTHONPATH=. \
  INFIR2_GPU_TARGET_CONFIG=$PWD/benchmarks/gpu_target_configs/h200.txtpb \
      /tmp/gpuaot/bin/python benchmarks/quantize_triton_deviceless.py \
      --triton_python=.venv/bin/python --out=benchmarks/results/quantize_triton_deviceless_s23.json

For each kernel (quantize_tiles with_transpose at [16384, 1536], swiglu and swiglu_bwd at
16384 x 8960) and each num_warps: XLA's GPU compiler compiles the jitted kernel for the
target of $INFIR2_GPU_TARGET_CONFIG (deviceless; its bundled Triton); its thunk sequence
gives threads and shared memory per program. XLA keeps the PTX to itself, so registers come
from a second compile of the same Triton IR with the PyPI triton package of --triton_python
(a pipeline that may differ from XLA's bundled one in detail) and `ptxas -v` for sm_90a:
registers, spills and the SASS instruction count (nvdisasm). Nothing runs.
"""
import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp

from infir2_jax.bench import tools as benchtools
from infir2_jax.precision.kernels import quantize_triton as qt

SHAPES = {"quantize_t": ((16384, 1536),), "swiglu": ((16384, 17920),),   # input shapes
          "swiglu_bwd": ((16384, 8960), (16384, 17920))}
FNS = {"quantize_t": lambda x, c: qt.quantize_tiles_triton(x, with_transpose=True, config=c),
       "swiglu": lambda gu, c: qt.swiglu_quantize_triton(gu, config=c),
       "swiglu_bwd": lambda dh, gu, c: qt.swiglu_bwd_quantize_triton(dh, gu, config=c)}

# Run by --triton_python: Triton IR -> PTX (sm_90a) -> ptxas -v and nvdisasm; prints JSON.
_PTXAS = r"""
import json, os, re, subprocess, sys, tempfile, triton
from triton.backends.compiler import GPUTarget
ttir, warps = sys.argv[1], int(sys.argv[2])
k = triton.compile(ttir, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps,
                                                                     "num_stages": 1})
bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
with tempfile.TemporaryDirectory() as d:
  open(f"{d}/k.ptx", "w").write(k.asm["ptx"])
  log = subprocess.run([f"{bin_dir}/ptxas", "-arch=sm_90a", "-v", f"{d}/k.ptx", "-o",
                        f"{d}/k.cubin"], capture_output=True, text=True).stderr
  sass = subprocess.run([f"{bin_dir}/nvdisasm", "-c", f"{d}/k.cubin"], capture_output=True,
                        text=True).stdout
  version = subprocess.run([f"{bin_dir}/ptxas", "--version"], capture_output=True,
                           text=True).stdout.strip().splitlines()[-1]
def num(pattern):
  m = re.search(pattern, log)
  return int(m.group(1)) if m else None
print(json.dumps({"registers": num(r"Used (\d+) registers"),
                  "spill_stores_bytes": num(r"(\d+) bytes spill stores"),
                  "spill_loads_bytes": num(r"(\d+) bytes spill loads"),
                  "triton_shared_bytes": k.metadata.shared,
                  "sass_instructions": len(re.findall(r"/\*[0-9a-f]{4,}\*/", sass)),
                  "fp8_cvt_in_ptx": len(re.findall(r"cvt\.rn\.satfinite\.e[45]m[23]x2", k.asm["ptx"])),
                  "ptxas": version, "triton": triton.__version__}))
"""


def _captured_ttir():
  """Patches Pallas' Triton lowering to keep each module's Triton IR (text)."""
  from jax._src.pallas.triton import pallas_call_registration as reg
  captured, lower = [], reg.lowering.lower_jaxpr_to_triton_module

  def keep(*a, **k):
    result = lower(*a, **k)
    captured.append(result.module.operation.get_asm(enable_debug_info=False))
    return result
  reg.lowering.lower_jaxpr_to_triton_module = keep
  return captured


def _thunks(dump_dir):
  """(name, threads, shared bytes) of each custom kernel in XLA's thunk sequence dump."""
  out = []
  for path in glob.glob(os.path.join(dump_dir, "*thunk_sequence.txt")):
    for line in open(path):
      m = re.search(r"kCustomKernel.*? (\S+) grid: \[([\d, ]+)\] threads: \[(\d+), \d+, \d+\]\s+"
                    r"shared_memory: (\d+) bytes", line)
      if m:
        out.append({"kernel": m.group(1), "grid": [int(g) for g in m.group(2).split(",")],
                    "threads": int(m.group(3)), "xla_shared_bytes": int(m.group(4))})
  return out


def compile_one(name, shapes, warps, device, triton_python, captured):
  mesh = jax.sharding.Mesh([device], ("x",))
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  specs = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=rep) for s in shapes]
  config = qt.TritonConfig(num_warps=warps)
  row = {"kernel": name, "shapes": [list(s) for s in shapes], "num_warps": warps}
  with tempfile.TemporaryDirectory() as dump:
    # XLA reads XLA_FLAGS once per process: the dump dir goes through the compile options.
    fn = jax.jit(lambda *a: FNS[name](*a, config))
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      lowered = fn.trace(*specs).lower(lowering_platforms=("cuda",))
      compiled = lowered.compile({"xla_dump_to": dump})
    text = compiled.as_text()
    row["triton_custom_calls"] = text.count("__gpu$xla.gpu.triton")
    row["xla"] = _thunks(dump)
  if triton_python and captured:
    with tempfile.NamedTemporaryFile("w", suffix=".ttir", delete=False) as f:
      f.write(captured[-1])
    try:
      res = subprocess.run([triton_python, "-c", _PTXAS, f.name, str(warps)],
                           capture_output=True, text=True, timeout=600)
      row["ptxas"] = (json.loads(res.stdout.strip().splitlines()[-1]) if res.returncode == 0
                      else {"error": res.stderr[-800:]})
    finally:
      os.unlink(f.name)
  return row


def main(argv):
  p = argparse.ArgumentParser()
  p.add_argument("--out", default="")
  p.add_argument("--warps", default="4,8,16,32")
  p.add_argument("--kernels", default=",".join(FNS))
  p.add_argument("--triton_python", default="",
                 help="a python with the PyPI triton package, for registers (ptxas -v)")
  args = p.parse_args(argv)
  import linear_kernels  # benchmarks/: the H200 from $INFIR2_GPU_TARGET_CONFIG
  device = linear_kernels.h200_device()
  captured = _captured_ttir()
  result = {"info": benchtools.run_info(["benchmarks/quantize_triton_deviceless.py", *argv],
                                        with_device=False),
            "device": f"deviceless compile for {device.device_kind} (nothing ran)",
            "env": {k: os.environ.get(k, "") for k in ("CUDA_ROOT", "JAX_PLATFORMS",
                                                       "INFIR2_GPU_TARGET_CONFIG")},
            "jax": jax.__version__, "rows": []}
  for name in args.kernels.split(","):
    shapes = SHAPES[name]
    for warps in (int(w) for w in args.warps.split(",")):
      try:
        row = compile_one(name, shapes, warps, device, args.triton_python, captured)
      except Exception as e:  # noqa: BLE001 - record and go on
        row = {"kernel": name, "shapes": [list(s) for s in shapes], "num_warps": warps,
               "error": f"{type(e).__name__}: {str(e)[:800]}"}
      print(json.dumps(row), flush=True)
      result["rows"].append(row)
      if args.out:
        with open(args.out, "w") as fh:
          json.dump(result, fh, indent=1)


if __name__ == "__main__":
  main(sys.argv[1:])
