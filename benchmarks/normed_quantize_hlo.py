"""What XLA:GPU hands the RMSNorm -> quantize kernel, compiled deviceless for the H200 on a CPU
host: the optimized HLO around quantize_normed_tiles (gamma rounded by reduce_precision, and
the session-29 form whose convert pair XLA folded away), and XLA's own RMSNorm fusion with
and without xla_allow_excess_precision (both keep the two bf16 roundings).

  CUDA_ROOT=... JAX_PLATFORMS=cpu INFIR2_GPU_TARGET_CONFIG=$PWD/benchmarks/gpu_target_configs/h200.txtpb \
      PYTHONPATH=. /tmp/gpuaot/bin/python benchmarks/normed_quantize_hlo.py
(set-up: benchmarks/gpu_target_configs/README.md; CUDA_ROOT: the nvidia/cuda_nvcc folder of
that venv, for ptxas.)
"""
import re
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, "benchmarks")
import linear_kernels  # noqa: E402  (benchmarks/: the H200 topology)
from infir2_jax.precision import kernels
from infir2_jax.precision.kernels import quantize

EXACT = {"xla_allow_excess_precision": False}


def optimized_hlo(mesh, fn, *specs, **jit_options) -> str:
  """fn compiled for the H200 deviceless: XLA's optimized HLO text."""
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    compiled = jax.jit(fn, **jit_options).trace(*specs).lower(
        lowering_platforms=("cuda",)).compile()
  return compiled.as_text()


def show(title: str, text: str, pattern: str):
  print(f"==== {title}")
  for line in text.splitlines():
    if re.search(pattern, line):
      print("  ", line.strip()[:230])


def main():
  device = linear_kernels.h200_device()
  mesh = jax.sharding.Mesh([device], ("x",))
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=rep)
  h, inv, g = (spec((16384, 1536), jnp.bfloat16), spec((16384, 1), jnp.float32),
               spec((1536,), jnp.float32))
  kernel_inputs = r"reduce-precision|convert|custom-call\("
  show("normed kernel's inputs (gamma by reduce_precision)",
       optimized_hlo(mesh, lambda h, i, g: kernels.quantize_normed_tiles(
           h, i, g, with_transpose=True), h, inv, g), kernel_inputs)
  session_29 = lambda h, i, g: quantize._quantize_2d(
      h, fmt="e4m3", scale_format="ue8m0", blocks=False, with_transpose=True,
      interpret=False, norm=(i.reshape(-1), g.astype(jnp.bfloat16).astype(jnp.float32)))
  show("normed kernel's inputs (session 29's convert pair)",
       optimized_hlo(mesh, session_29, h, inv, g), kernel_inputs)
  show("XLA's RMSNorm fusion (default options)",
       optimized_hlo(mesh, quantize.rms_normed_reference, h, inv, g), r"convert|multiply")
  show("XLA's RMSNorm fusion (excess precision off)",
       optimized_hlo(mesh, quantize.rms_normed_reference, h, inv, g, compiler_options=EXACT),
       r"convert|multiply")


if __name__ == "__main__":
  main()
