"""The kernels one FP8 linear (forward and backward) compiles to on the H200, without a GPU.

  export INFIR2_GPU_TARGET_CONFIG=$PWD/benchmarks/gpu_target_configs/h200.txtpb JAX_PLATFORMS=cpu
  PYTHONPATH=. /tmp/gpuaot/bin/python benchmarks/linear_kernels.py --out benchmarks/results/linear_kernels_h200_deviceless.json

For each linear of Qwen2.5-1.5B at 16384 tokens: jax.grad of sum(y^2) through the infir2
recipe's dot_general with the Pallas kernels, compiled deviceless for the H200
(gpu_target_configs/README.md), and the list of what XLA launches: our kernels (by name) and
XLA's own fusions between them. It answers what benchmarks/gemm.py cannot: which of the XLA
ops around a GEMM survive in a real graph (there the quantizers' scale layouts meet the GEMM's
and transposes cancel).
"""
import argparse
import json
import os
import re
import sys

import jax
import jax.numpy as jnp

from infir2_jax.bench import tools as benchtools
from infir2_jax.precision import kernels
from infir2_jax.precision import dot_general

SHAPES_1P5B = {"q_proj": (1536, 1536), "k_proj": (1536, 256), "gate_proj": (1536, 8960),
               "down_proj": (8960, 1536)}  # (in, out); v = k, o = q, up = gate
TOKENS = 16384


def h200_device():
  from jax.experimental import topologies
  path = os.environ.get("INFIR2_GPU_TARGET_CONFIG")
  if not path:
    raise SystemExit("set INFIR2_GPU_TARGET_CONFIG (benchmarks/gpu_target_configs/README.md)")
  with open(path) as f:
    topology = topologies.get_topology_desc(platform="cuda", topology="1x1x1",
                                            target_config=f.read())
  return topology.devices[0]


def launched(hlo_text: str) -> list[dict]:
  """Fusions and custom calls of the entry computation, in order: name, shape, our kernel."""
  entry = hlo_text[hlo_text.index("\nENTRY"):]
  out = []
  for line in entry.splitlines():
    if " fusion(" not in line and " custom-call(" not in line:
      continue
    m = re.match(r"\s*(?:ROOT )?%?([\w.-]+) = (.+?) (?:fusion|custom-call)\(", line)
    ours = re.search(r"infir2_\w+", line)
    out.append({"op": m.group(1) if m else line.strip()[:40],
                "shape": m.group(2)[:80] if m else "",
                "kernel": ours.group(0) if ours else None})
  return out


def linear_kernels(device, tokens, d_in, d_out, recipe="infir2"):
  mesh = jax.sharding.Mesh([device], ("x",))
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  dot = dot_general.make_dot_general(recipe)

  def loss(x, w):
    y = dot(x, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.bfloat16)
    return jnp.sum(y.astype(jnp.float32) ** 2)

  grad = jax.jit(jax.grad(loss, argnums=(0, 1)), in_shardings=(rep, rep),
                 out_shardings=(rep, rep))
  x = jax.ShapeDtypeStruct((tokens, d_in), jnp.bfloat16, sharding=rep)
  w = jax.ShapeDtypeStruct((d_in, d_out), jnp.bfloat16, sharding=rep)
  with jax.set_mesh(mesh):
    return launched(grad.lower(x, w).compile().as_text())


def main(argv):
  p = argparse.ArgumentParser()
  p.add_argument("--out", required=True)
  args = p.parse_args(argv)
  kernels.available = lambda: True  # compiling for the H200: the recipe picks the kernels
  device = h200_device()
  result = {"info": benchtools.run_info(["benchmarks/linear_kernels.py", *argv]),
            "device": f"deviceless compile for {device.device_kind}", "linears": {}}
  for name, (d_in, d_out) in SHAPES_1P5B.items():
    ops = linear_kernels(device, TOKENS, d_in, d_out)
    ours = [o for o in ops if o["kernel"]]
    result["linears"][name] = {
        "in": d_in, "out": d_out, "launched": ops,
        "ours": len(ours), "xla": len(ops) - len(ours),
        "xla_ops": [o["op"] + " " + o["shape"] for o in ops if not o["kernel"]]}
    print(name, f"{len(ours)} ours + {len(ops) - len(ours)} XLA:",
          [o["kernel"] or o["op"] for o in ops], flush=True)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=1)


if __name__ == "__main__":
  main(sys.argv[1:])
