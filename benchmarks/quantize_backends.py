"""The three 1x128 quantizers, Mosaic GPU kernel vs Triton kernel vs XLA, side by side.

  PYTHONPATH=. python3 benchmarks/quantize_backends.py --out /tmp/quantize_backends.json
  PYTHONPATH=. python3 benchmarks/quantize_backends.py --smoke --out /tmp/smoke.json  # CPU

At the 1.5B's and 7B's shapes (16384 tokens; d = 1536 / 3584, F = 8960 / 18944), device
time (CUPTI, benchtools.device_ms; host wall time where CUPTI fails, as the JSON's
timing_method says) of:
  quantize    x [M, d] -> q, s, qT, sT            (quantize_tiles, with_transpose)
  swiglu      gu [M, 2F] -> tiles of h [M, F]     (swiglu_quantize)
  swiglu_bwd  dh [M, F], gu [M, 2F] -> tiles of dgu [M, 2F]   (swiglu_bwd_quantize)
for each path: "mosaic" (kernels/quantize.py, fused_quantize.py), "triton_wN" (kernels/
quantize_triton.py with N warps per program) and "xla" (the pure-jnp reference, jitted).
Each timed call runs over --sets input sets in one jit, so every set is read from HBM. TB/s
counts the fewest bytes: inputs read once, fp8 outputs and scales written once.

Checks on the device, each Triton config: quantize's outputs equal the reference's bit for
bit; the fused kernels' quantized outputs equal the reference quantizer's of the values the
kernel made (with_values), and those values are XLA's but for the documented last-ulp
exp/division differences (fraction differing, max bf16 ulps, as tests/test_kernels_gpu.py).
--smoke: tiny shapes, the kernels interpreted on the CPU, one iteration: it shows the script
works, nothing it times means anything.
"""
import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from infir2_jax.bench import tools as benchtools
from infir2_jax.precision import kernels
from infir2_jax.precision.kernels import fused_quantize as fq
from infir2_jax.precision.kernels import quantize
from infir2_jax.precision.kernels import quantize_triton as qt

MODELS = {"1p5b": (16384, 1536, 8960), "7b": (16384, 3584, 18944)}   # tokens, d, F
SMOKE = {"smoke": (200, 256, 256)}
CASES = ("quantize", "swiglu", "swiglu_bwd")


def _inputs(case, m, d, f, n_sets, seed):
  r = np.random.default_rng(seed)
  def bf16(shape, scale):
    return jnp.asarray(r.standard_normal(shape, np.float32) * scale, jnp.bfloat16)
  if case == "quantize":
    return [(bf16((m, d), 4.0),) for _ in range(n_sets)]
  if case == "swiglu":
    return [(bf16((m, 2 * f), 2.0),) for _ in range(n_sets)]
  return [(bf16((m, f), 1e-2), bf16((m, 2 * f), 2.0)) for _ in range(n_sets)]


def _paths(case, warps, interpret):
  """{path: fn(*inputs) -> (q, s, qT, sT)} of a case."""
  mosaic = {"quantize": lambda x: kernels.quantize_tiles(x, with_transpose=True,
                                                         interpret=interpret),
            "swiglu": lambda gu: kernels.swiglu_quantize(gu, interpret=interpret),
            "swiglu_bwd": lambda dh, gu: kernels.swiglu_bwd_quantize(dh, gu,
                                                                     interpret=interpret)}
  xla = {"quantize": lambda x: kernels.quantize_tiles_reference(x, with_transpose=True),
         "swiglu": kernels.swiglu_quantize_reference,
         "swiglu_bwd": kernels.swiglu_bwd_quantize_reference}
  paths = {"mosaic": mosaic[case], "mosaic_full": _full(mosaic[case]), "xla": xla[case]}
  for w in warps:
    paths[f"triton_w{w}"] = _triton(case, qt.TritonConfig(num_warps=w),
                                    True if interpret else None)
  return paths


def _with_mode(mode, fn, *args):
  """fn(*args) traced with quantize.KERNEL_QUANTIZE = mode."""
  saved, quantize.KERNEL_QUANTIZE = quantize.KERNEL_QUANTIZE, mode
  try:
    return fn(*args)
  finally:
    quantize.KERNEL_QUANTIZE = saved


def _full(fn):
  """fn with the Mosaic kernels as before session 27 (KERNEL_QUANTIZE "full": the clip and
  the subnormal flush on every element): the same bits as "lean", more instructions."""
  return lambda *args: _with_mode("full", fn, *args)


def _triton(case, config, interpret, with_values=False):
  if case == "quantize":
    return lambda x: qt.quantize_tiles_triton(x, with_transpose=True, interpret=interpret,
                                              config=config)
  fn = qt.swiglu_quantize_triton if case == "swiglu" else qt.swiglu_bwd_quantize_triton
  return lambda *a: fn(*a, interpret=interpret, with_values=with_values, config=config)


@jax.jit
def _bit_equal(a, b):
  a, b = a.astype(jnp.float32), b.astype(jnp.float32)
  return jnp.all((a == b) | (jnp.isnan(a) & jnp.isnan(b)))


@jax.jit
def _ulp_mismatch(values, ref):
  """(fraction of finite entries that differ, max difference in bf16 ulps of ref), on the
  device (tests/test_kernels_gpu.py's measure; bf16 differences are exact in f32)."""
  v, r = values.astype(jnp.float32), ref.astype(jnp.float32)
  both = jnp.isfinite(v) & jnp.isfinite(r)
  spacing = jnp.exp2(jnp.floor(jnp.log2(jnp.maximum(jnp.abs(r), 2.0 ** -126))) - 7)
  diff = jnp.where(both, jnp.abs(v - r) / spacing, 0.0)
  differ = jnp.sum(both & (v != r)) / jnp.maximum(jnp.sum(both), 1)
  return differ, jnp.max(diff)


def _same(a, b):
  return a.shape == b.shape and bool(_bit_equal(a, b))


def check(case, config, inputs, interpret):
  """The Triton outputs against the references, on this device (see module doc)."""
  if case == "quantize":
    out = jax.jit(_triton(case, config, interpret))(*inputs)
    ref = jax.jit(lambda x: kernels.quantize_tiles_reference(x, with_transpose=True))(*inputs)
    return {"bit_identical_to_reference": all(_same(o, r) for o, r in zip(out, ref))}
  *quantized, values = jax.jit(_triton(case, config, interpret, with_values=True))(*inputs)
  requant = jax.jit(lambda v: kernels.quantize_tiles_reference(v, with_transpose=True))(values)
  ref_values = jax.jit(fq.swiglu_reference if case == "swiglu"
                       else fq.swiglu_bwd_reference)(*inputs)
  differ, ulps = (float(v) for v in _ulp_mismatch(values, ref_values))
  return {"quantized_bit_identical_to_its_values": all(
              _same(o, r) for o, r in zip(quantized, requant)),
          "values_differ_from_xla": differ, "values_max_ulps": ulps,
          "values_within_tolerance": ulps <= 1.0 and differ < 1e-4}


def _saturating(case, inputs):
  """The inputs with one 128 x 128 block whose quantized values reach +-3.3e38: tiles whose
  ue8m0 scale is capped, the one place the clip (or the GPU's saturating cast) matters."""
  ramp = jnp.linspace(-1.86e19, 1.86e19, 128)[None, :]
  if case == "quantize":   # and a block of tiny tiles (amax ~2e-38, subnormals): the flush
    (x,) = inputs
    tiny = jnp.where(jnp.arange(128) % 2 == 0, 1e-39, -2e-38)[None, :] * jnp.ones((128, 1))
    x = x.at[128:256, :128].set(tiny.astype(x.dtype))
    return (x.at[:128, :128].set((ramp * 1.8e19).astype(x.dtype)),)
  gu = inputs[-1]
  f = gu.shape[1] // 2
  gu = gu.at[:128, :128].set(jnp.full((128, 128), 1.8e19, gu.dtype))   # g: silu(g) = g
  gu = gu.at[:128, f:f + 128].set(jnp.broadcast_to(ramp, (128, 128)).astype(gu.dtype))  # u
  if case == "swiglu":
    return (gu,)
  dh = inputs[0].at[:128, :128].set(jnp.full((128, 128), 1.8e19, inputs[0].dtype))
  return (dh, gu)


def check_mosaic(case, mode, inputs):
  """A Mosaic path (quantize.KERNEL_QUANTIZE = mode) on this device, on inputs with
  saturating and subnormal tiles (_saturating): quantize's outputs bit for bit the
  reference's; the fused kernels' tiles bit for bit the reference quantizer's of the values
  the kernel made."""
  inputs = _saturating(case, inputs)
  if case == "quantize":
    out = _with_mode(mode, jax.jit(lambda x: kernels.quantize_tiles(x, with_transpose=True)),
                     *inputs)
    ref = jax.jit(lambda x: kernels.quantize_tiles_reference(x, with_transpose=True))(*inputs)
    return {"bit_identical_to_reference": all(_same(o, r) for o, r in zip(out, ref))}
  fn = kernels.swiglu_quantize if case == "swiglu" else kernels.swiglu_bwd_quantize
  *quantized, values = _with_mode(mode, jax.jit(lambda *a: fn(*a, with_values=True)), *inputs)
  requant = jax.jit(lambda v: kernels.quantize_tiles_reference(v, with_transpose=True))(values)
  fmax = float(jnp.finfo(quantized[0].dtype).max)
  return {"quantized_bit_identical_to_its_values": all(
              _same(o, r) for o, r in zip(quantized, requant)),
          "saturating_tiles_present": bool(jnp.any(jnp.abs(
              quantized[0][:128, :128].astype(jnp.float32)) == fmax))}


def _nbytes(arrays):
  return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(arrays))


def bench(case, model, m, d, f, args):
  interpret = args.smoke
  sets = _inputs(case, m, d, f, args.sets, seed=m + d + f)
  paths = _paths(case, args.warps, interpret)
  row = {"case": case, "model": model, "shapes": [list(a.shape) for a in sets[0]]}
  ref_out = jax.jit(paths["xla"])(*sets[0])
  row["bytes"] = nbytes = _nbytes(sets[0]) + _nbytes(ref_out)
  for name, fn in paths.items():
    try:
      timed = jax.jit(lambda sets, fn=fn: [fn(*s) for s in sets])
      ms = benchtools.device_ms(timed, (sets,), args.iters, warmup=1) / args.sets
      entry = {"us": ms * 1e3, "tbps": nbytes / (ms * 1e-3) / 1e12}
      if name.startswith("triton"):
        config = qt.TritonConfig(num_warps=int(name.split("_w")[1]))
        entry["check"] = check(case, config, sets[0], True if interpret else None)
        q, q_mosaic = jax.jit(fn)(*sets[0])[0], jax.jit(paths["mosaic"])(*sets[0])[0]
        entry["q_entries_differ_from_mosaic"] = float(_ulp_mismatch(q, q_mosaic)[0])
      if name.startswith("mosaic") and not interpret:   # on the device, saturating tiles
        try:
          entry["check"] = check_mosaic(case, "full" if name == "mosaic_full" else "lean",
                                        sets[0])
        except Exception as e:  # noqa: BLE001 - the timing stands; the check says why not
          entry["check"] = {"ran": False, "error": f"{type(e).__name__}: {str(e)[:400]}"}
    except Exception as e:  # noqa: BLE001 - record and go on
      entry = {"error": f"{type(e).__name__}: {str(e)[:600]}"}
    row[name] = entry
  if not args.smoke:
    row["kernels"] = {name: benchtools.kernel_breakdown(jax.jit(fn), sets[0], iters=3)
                      for name, fn in paths.items() if name != "xla"}
  return row


def _print(row):
  cells = []
  for name, e in row.items():
    if isinstance(e, dict) and "us" in e:
      ok = e.get("check", {})
      flag = "" if not ok else (" ok" if all(v for k, v in ok.items() if isinstance(v, bool))
                                else " CHECK FAILED")
      cells.append(f"{name} {e['us']:8.1f} us {e['tbps']:5.2f} TB/s{flag}")
    elif isinstance(e, dict) and "error" in e:
      cells.append(f"{name} ERROR {e['error'][:120]}")
  print(f"{row['model']:5s} {row['case']:10s} " + " | ".join(cells), flush=True)


def main(argv):
  p = argparse.ArgumentParser()
  p.add_argument("--out", required=True)
  p.add_argument("--iters", type=int, default=20)
  p.add_argument("--sets", type=int, default=2)
  p.add_argument("--models", default="1p5b,7b")
  p.add_argument("--cases", default=",".join(CASES))
  p.add_argument("--warps", default="8,16,32")
  p.add_argument("--smoke", action="store_true",
                 help="tiny shapes, interpreted kernels, one iteration (CPU; times mean nothing)")
  args = p.parse_args(argv)
  args.warps = [int(w) for w in args.warps.split(",") if w]
  if args.smoke:
    args.iters, args.sets = 1, 1
  models = SMOKE if args.smoke else {k: MODELS[k] for k in args.models.split(",")}
  result = {"info": benchtools.run_info(["benchmarks/quantize_backends.py", *argv]),
            "smoke": args.smoke, "rows": []}
  for model, (m, d, f) in models.items():
    for case in args.cases.split(","):
      row = bench(case, model, m, d, f, args)
      _print(row)
      result["rows"].append(row)
      result["info"]["timing_method"] = benchtools.timing_method()
      with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)


if __name__ == "__main__":
  main(sys.argv[1:])
