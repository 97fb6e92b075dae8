"""Why the fused SwiGLU backward kernel runs 3.4-3.6x slower than the separate passes: one
factor at a time.

  PYTHONPATH=. python3 benchmarks/fused_bwd_bisect.py --out /tmp/bisect.json
  PYTHONPATH=. python3 benchmarks/fused_bwd_bisect.py --shape=256x256 --interpret   # CPU
  CUDA_ROOT=<dir with bin/ptxas, bin/nvdisasm> JAX_PLATFORMS=cpu \
  INFIR2_GPU_TARGET_CONFIG=$PWD/benchmarks/gpu_target_configs/h200.txtpb PYTHONPATH=. \
      /tmp/gpuaot/bin/python benchmarks/fused_bwd_bisect.py --sass --out /tmp/sass.json

kernels/fused_quantize.py's kernel body with stand-in producers, device time (CUPTI) each,
side by side in one process, at 16384 x 8960 (the 1.5B MLP at 16k tokens):
  fwd            gate, up -> h                 (the fused forward: 1 output, 2 inputs)
  bwd            dh, gate, up -> dgate, dup    (the fused backward as the MLP would run it)
  bwd_noalias    the same, fp8 staging in its own shared memory
  bwd_unrolled   the same, the two outputs' quantization unrolled (session 17's kernel)
  fwd_pipelined, bwd_pipelined(_264), copy2_3in_pipelined: a persistent grid of 132 (264)
                 CTAs, each loading its next block while it makes the current one
                 (FusedConfig.programs, session 21)
  copy2_3in      dh, gate, up -> dh, gate      (no arithmetic: 3 inputs, 2 outputs)
  copy1_3in      dh, gate, up -> dh            (3 inputs, 1 output)
  dg_only_3in    dh, gate, up -> dgate         (the backward's arithmetic for 1 output)
  copy2_2in      gate, up -> gate, up          (2 inputs, 2 outputs, no alias possible)
  du_only_3in, dh_g_3in, sig_3in, fwd_form_3in, dg_u_3in, silu_3in, dhg_then_s_3in,
  dg_plus_du_3in (both formulas, one output), du_dg_swapped (dup made first): the dup side
  separate       XLA's SwiGLU backward, then one quantize_tiles of [dgate | dup]
GB/s counts each variant's own inputs read once and fp8 outputs written once. --sass
compiles each variant for the H200 on a CPU host instead (deviceless, gpu_target_configs/
README.md; nvdisasm from the PyPI wheel nvidia-cuda-nvdisasm) and records the kernel's
SASS size and ptxas' registers: session 18 found the 5x slow variants are exactly those
over ~6,700 instructions (~105 KB), past the SM's instruction cache. Session 17
also timed the backward computing one output per pass over the block (2952-3072 us, slower
than the joint producer; that option is not kept).
"""
import argparse
import json
import sys

import jax
import jax.numpy as jnp

from infir2_jax.bench import tools as benchtools
from infir2_jax.precision import kernels
from infir2_jax.precision.kernels import fused_quantize as fq

STAND_INS = {
    "copy2_3in": (lambda dh, g, u: (dh, g), 2),
    "copy1_3in": (lambda dh, g, u: (dh,), 1),
    "dg_only_3in": (lambda dh, g, u: fq.swiglu_bwd_f32(dh, g, u)[:1], 1),
    "copy2_2in": (lambda g, u: (g, u), 2),
    "du_only_3in": (lambda dh, g, u: fq.swiglu_bwd_f32(dh, g, u)[1:], 1),
    "dh_g_3in": (lambda dh, g, u: (dh * g,), 1),
    "sig_3in": (lambda dh, g, u: (fq.sigmoid_f32(g),), 1),
    "fwd_form_3in": (lambda dh, g, u: (g * fq.sigmoid_f32(g) * dh,), 1),
    "dg_u_3in": (lambda dh, g, u: (fq.swiglu_bwd_f32(dh, g, u)[0], u), 2),
    "silu_3in": (lambda dh, g, u: (g * fq.sigmoid_f32(g),), 1),
    "dhg_then_s_3in": (lambda dh, g, u: ((dh * g) * fq.sigmoid_f32(g),), 1),
    "dg_plus_du_3in": (lambda dh, g, u: (sum(fq.swiglu_bwd_f32(dh, g, u)),), 1),
    "du_dg_swapped": (lambda dh, g, u: fq.swiglu_bwd_f32(dh, g, u)[::-1], 2),
}


def variants(f):
  """name -> (producer, arrays index list, sources, FusedConfig)."""
  fb = f // 128
  three = ((0, 0), (1, 0), (1, fb))
  return {
      "fwd": ("swiglu", (1,), ((0, 0), (0, fb)), fq.FusedConfig(64, True)),
      "bwd": ("swiglu_bwd", (0, 1), three, fq.FusedConfig(64, True)),
      "bwd_noalias": ("swiglu_bwd", (0, 1), three, fq.FusedConfig(64, False)),
      "bwd_unrolled": ("swiglu_bwd", (0, 1), three, fq.FusedConfig(64, True, False)),
      # the persistent kernel that loads block i + 1 while it makes block i (session 21),
      # one and two CTAs' worth of programs per H200 SM (132 SMs)
      "fwd_pipelined": ("swiglu", (1,), ((0, 0), (0, fb)), fq.FusedConfig(64, False,
                                                                        programs=132)),
      "bwd_pipelined": ("swiglu_bwd", (0, 1), three, fq.FusedConfig(64, False, programs=132)),
      "bwd_pipelined_264": ("swiglu_bwd", (0, 1), three,
                            fq.FusedConfig(64, False, programs=264)),
      "copy2_3in_pipelined": ("copy2_3in", (0, 1), three,
                              fq.FusedConfig(64, False, programs=132)),
      "copy2_3in": ("copy2_3in", (0, 1), three, fq.FusedConfig(64, True)),
      "copy1_3in": ("copy1_3in", (0, 1), three, fq.FusedConfig(64, True)),
      "dg_only_3in": ("dg_only_3in", (0, 1), three, fq.FusedConfig(64, True)),
      "copy2_2in": ("copy2_2in", (1,), ((0, 0), (0, fb)), fq.FusedConfig(64, False)),
      **{k: (k, (0, 1), three, fq.FusedConfig(64, True))
         for k in ("du_only_3in", "dh_g_3in", "sig_3in", "fwd_form_3in", "dg_u_3in",
                   "silu_3in", "dhg_then_s_3in", "dg_plus_du_3in", "du_dg_swapped")},
  }


def chosen_variants(args):
  """(m, f, {name: variant}) of --shape and --variants, the stand-ins registered."""
  m, f = map(int, args.shape.split("x"))
  fq.PRODUCERS.update(STAND_INS)
  chosen = variants(f)
  if args.variants:
    chosen = {k: chosen[k] for k in args.variants.split(",")}
  return m, f, chosen


def kernel_fn(producer, sources, f, config, interpret=False):
  """The jitted fused kernel of one variant (its arrays as positional arguments)."""
  return jax.jit(lambda *a: fq._run(producer, list(a), sources, f, "e4m3", "ue8m0",
                                    interpret, False, config))


def main(argv):
  p = argparse.ArgumentParser()
  p.add_argument("--out", default="")
  p.add_argument("--shape", default="16384x8960")
  p.add_argument("--iters", type=int, default=10)
  p.add_argument("--interpret", action="store_true", help="CPU smoke test (no timing)")
  p.add_argument("--variants", default="", help="comma-separated subset (default: all)")
  p.add_argument("--sass", action="store_true",
                 help="deviceless: SASS instructions and registers of each variant, no timing")
  args = p.parse_args(argv)
  if args.sass:
    return sass_sizes(args)
  m, f, chosen = chosen_variants(args)
  k1, k2 = jax.random.split(jax.random.key(0))
  gu = jax.random.normal(k1, (m, 2 * f), jnp.bfloat16) * 2
  dh = jax.random.normal(k2, (m, f), jnp.bfloat16) * 1e-2
  inputs = (dh, gu)
  nbytes = lambda xs: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(xs))
  result = {"info": benchtools.run_info(["benchmarks/fused_bwd_bisect.py", *argv],
                                        with_device=not args.interpret),
            "shape": [m, f], "rows": {}}
  want = fq.swiglu_bwd_quantize_reference(dh, gu)
  for name, (producer, which, sources, config) in chosen.items():
    arrays = [inputs[i] for i in which]
    fn = kernel_fn(producer, sources, f, config, args.interpret)
    try:
      out = jax.block_until_ready(fn(*arrays))
      row = {"bytes": nbytes(arrays) + nbytes(out)}
      if name.startswith("bwd"):
        row.update(reference_mismatch(out, want))
      if not args.interpret:
        ms = benchtools.device_ms(fn, arrays, args.iters)
        row.update(us=ms * 1e3, gbps=row["bytes"] / (ms * 1e-3) / 1e9)
    except Exception as e:  # noqa: BLE001 - record and go on
      row = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
    result["rows"][name] = row
    print(f"{name:12s} " + " ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                                    for k, v in row.items()), flush=True)

  def separate(dh, gu):
    return kernels.quantize_tiles(fq.swiglu_bwd_reference(dh, gu), with_transpose=True)
  if not args.interpret and not args.variants:
    fn = jax.jit(separate)
    out = fn(dh, gu)
    ms = benchtools.device_ms(fn, (dh, gu), args.iters)
    b = nbytes((dh, gu)) + nbytes(out)
    result["rows"]["separate"] = {"bytes": b, "us": ms * 1e3, "gbps": b / (ms * 1e-3) / 1e9,
                                  "kernels": benchtools.kernel_breakdown(fn, (dh, gu))}
    print(f"separate     us={ms * 1e3:.1f} gbps={b / (ms * 1e-3) / 1e9:.0f}", flush=True)
  if args.out:
    with open(args.out, "w") as fh:
      json.dump(result, fh, indent=1)


def reference_mismatch(out, want) -> dict:
  """How far the kernel's outputs are from the reference's: matches_reference (bit for bit),
  and per output the count of differing elements (fp8 values compared as floats, so a
  flipped rounding is one element) and the largest difference. On the GPU exp and the
  division round differently from XLA's in the last bit, so a few fp8 values may flip."""
  import numpy as np
  counts, largest = [], []
  for a, b in zip(out, want):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    diff = a != b
    counts.append(int(diff.sum()))
    largest.append(float(np.abs(a - b)[diff].max()) if diff.any() else 0.0)
  return {"matches_reference": not any(counts), "differing_elements": counts,
          "largest_difference": largest}


def sass_sizes(args):
  """{variant: {instructions, registers}} of each variant compiled for $INFIR2_GPU_TARGET_CONFIG
  (sass_opcodes.deviceless_dump)."""
  import re
  import sass_opcodes  # benchmarks/ is sys.path[0]
  m, f, chosen = chosen_variants(args)
  specs = (jax.ShapeDtypeStruct((m, f), jnp.bfloat16),
           jax.ShapeDtypeStruct((m, 2 * f), jnp.bfloat16))
  result = {"info": benchtools.run_info(["benchmarks/fused_bwd_bisect.py", "--sass"],
                                        with_device=False),
            "device": None, "shape": [m, f], "rows": {}}
  for name, (producer, which, sources, config) in chosen.items():
    fn = kernel_fn(producer, sources, f, config)
    text, kind = sass_opcodes.deviceless_dump(fn, [specs[i] for i in which])
    result["device"] = f"deviceless compile for {kind}"
    counts = sass_opcodes.opcode_counts(text.splitlines())
    kernel = [c for k, c in counts.items() if fq.FUSED_KERNEL_NAME in k]
    regs = re.findall(r"Used (\d+) registers", text)
    row = {"instructions": sum(kernel[0].values()) if kernel else None,
           "registers": int(regs[0]) if regs else None}
    if row["instructions"] is None:
      row["error"] = "no SASS in the dump (is nvdisasm in $CUDA_ROOT/bin?): " + text[-300:]
    result["rows"][name] = row
    print(f"{name:16s} {row}", flush=True)
  if args.out:
    with open(args.out, "w") as fh:
      json.dump(result, fh, indent=1)


if __name__ == "__main__":
  main(sys.argv[1:])
