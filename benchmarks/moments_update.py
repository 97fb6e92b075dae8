"""The AdamW update at a model's parameter shapes: optax float32 vs opt.moments=fp8, alone and
as the train step runs it from the raw gradient sums.

  python benchmarks/moments_update.py --configs=configs/1p5b.py,configs/7b.py \
      --out=benchmarks/results/moments_update_h200.json
  python benchmarks/moments_update.py --tiny --out=/tmp/moments_update.json   # CPU, a test
  INFIR2_GPU_TARGET_CONFIG=$PWD/benchmarks/gpu_target_configs/h200.txtpb JAX_PLATFORMS=cpu \
      /tmp/gpuaot/bin/python benchmarks/moments_update.py --tiny --aot_gpu --out=/tmp/aot.json

Variants: optax.adamw with float32 moments (the default), and opt.moments=fp8 with each
opt.moments_kernel (train/fp8_adam.py): "reference" (decode, optax's Adam, encode),
"jnp" (one pass per tensor for XLA to fuse) and "pallas" (a Pallas kernel; "fp8_pallas_rN"
runs it with N rows of 128 per program instead of fp8_adam.BLOCK_ROWS, "_wN" with N warps
per program instead of fp8_adam.NUM_WARPS, "_precise" with libdevice's exactly rounded
log2/exp2/sqrt and Triton's division instead of the GPU's approximate instructions,
fp8_adam.FAST_PTX; e.g. fp8_pallas_r8_w2). Each is the
project's own optimizer (train/optim.py, opt.clip_norm=0: the update alone) followed by
optax.apply_updates, jitted with the state donated. Params (float32) and gradients
(bfloat16, as train/grads.py hands them over) are allocated on the device directly from
abstract shapes; no host copy.

Step variants ("_step" in the name) time what the train step now runs from the backward's
raw gradient sums (bf16) and the loss tokens (a float32 scalar, DENOM) to the new params,
state and grad norm, with opt.clip_norm=1.0 (every shape set's norm is above it: the clip
scales; the entry's grad_norm says so): optax_fp32_step and fp8_pallas_step are
optim.generic_apply (/denom, clip, the optimizer's update, apply_updates, the norm) of
optax's float32 AdamW and of fp8 moments with the non-fused Pallas kernel; fp8_fused_step
is optim.make_apply's fused fp8 step (fp8_adam.apply_adamw: one kernel per param from the
sums to the param and moments, in place). The _rN/_wN/_precise options apply to them too
(fp8_fused_step_precise).

Per variant: ms per update (host wall time of back-to-back donated calls: each call consumes
the state the last one returned, so CUPTI's repeated-argument timing does not apply), the
bytes it must move at least (state in and out, gradients in; bytes_moved says what a step
variant adds), the GB/s that makes, the fusions and custom calls (our kernels) of its
compiled HLO, and the temporaries XLA allocates beside the arguments (temp_gib). The fp8
variants run the same steps from the same state, and their results are compared bit for bit
(a fingerprint of every array's bits on the device; whole arrays with --tiny, which also
says how far apart in ulps): the update variants with the first fp8 update variant, the
step variants with the first fp8 step variant. Variants whose float32 ops differ are
expected to differ, and the differences say by how much: fp8_pallas_precise against
fp8_pallas on the GPU; fp8_fused_step against the chain's steps (the fused kernel divides
by the tokens and the norm in its own program, with the approximate reciprocal on the GPU;
even on the CPU the last bit of a gradient moves a group's range, so k by ulps and codes
at rounding boundaries by one, and a param's ulps count large where its update cancels
it). --aot_gpu compiles for the H200 on a CPU host (deviceless,
benchmarks/gpu_target_configs/README.md) and only counts the fusions.
"""

import argparse
import functools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STEP_VARIANTS = ("optax_fp32_step", "fp8_pallas_step", "fp8_fused_step")
VARIANTS = ("optax_fp32", "fp8_reference", "fp8_jnp", "fp8_pallas") + STEP_VARIANTS
# The step variants' loss tokens: not a power of two (1 / DENOM rounds, as the fused kernel's
# approximate reciprocal may not), and small enough that the norm of sums / DENOM is above
# opt.clip_norm at every shape set (the generated sums' norm is ~0.19 sqrt(params)).
DENOM = 48.0
STEP_CLIP_NORM = 1.0
TINY_SHAPES = {"embed": (512, 256), "q_proj": (256, 256), "k_proj": (256, 128),
               "up_proj": (256, 640), "down_proj": (640, 256), "q_bias": (256,),
               "norm": (200,), "gain": ()}


def parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--configs", default="configs/1p5b.py,configs/7b.py",
                 help="comma-separated model configs whose parameter shapes are timed")
  p.add_argument("--tiny", action="store_true", help="a tiny shape set instead (CPU, tests)")
  p.add_argument("--variants", default=",".join(VARIANTS))
  p.add_argument("--steps", type=int, default=3, help="updates before the comparison")
  p.add_argument("--iters", type=int, default=10, help="timed updates per variant")
  p.add_argument("--grad_dtype", default="bfloat16")
  p.add_argument("--aot_gpu", action="store_true",
                 help="compile for the GPU of $INFIR2_GPU_TARGET_CONFIG and count fusions only")
  p.add_argument("--out", default="")
  return p.parse_args(argv)


def param_shapes(spec: str) -> dict[str, tuple[int, ...]]:
  """{path: shape} of a config's model params, from abstract init (nothing allocated)."""
  import flax.linen as nn
  import jax
  from infir2_jax.config import load_config
  from infir2_jax.model import Qwen2, init_params
  from infir2_jax.parallel.state import path_str
  cfg = load_config(spec)
  abstract = nn.unbox(jax.eval_shape(lambda: init_params(Qwen2(cfg.model), jax.random.key(0))))
  return {path_str(p): tuple(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(abstract)[0]}


def is_step(variant: str) -> bool:
  """A step variant (from the raw sums, clipped) rather than the update alone."""
  return "step" in variant.split("_")


def make_update(variant: str):
  """(optimizer, update(params, grads, opt_state, denom) -> (params, opt_state, extra)) of a
  variant: extra is the grad norm of a step variant (its grads the raw sums, divided by
  denom), () for an update variant (grads the gradients; denom unused)."""
  import optax
  from infir2_jax.config import OptConfig
  from infir2_jax.train import optim
  from infir2_jax.train.optim import make_optimizer
  from infir2_jax.train import fp8_adam
  moments, kernel = (("fp32", "jnp" + variant[len("optax_fp32"):])
                     if variant.startswith("optax_fp32") else ("fp8", variant[4:]))
  # fp8_pallas[_rN][_wN][_precise][_step]: N rows per program, N warps, libdevice's exact
  # math, from the raw sums; fp8_fused_step[...]: optim.make_apply's fused step
  kernel, *options = kernel.split("_")
  step = "step" in options
  if kernel == "fused" and not step:
    raise ValueError(f"{variant}: the fused kernel is the train step's (fp8_fused_step)")
  option = lambda key, default: next((int(o[1:]) for o in options if o[0] == key
                                      and o[1:].isdigit()), default)
  settings = {"BLOCK_ROWS": option("r", fp8_adam.BLOCK_ROWS),
              "NUM_WARPS": option("w", fp8_adam.NUM_WARPS),
              "FAST_MATH": "precise" not in options}
  cfg = OptConfig(moments=moments, moments_kernel="pallas" if kernel == "fused" else kernel,
                  clip_norm=STEP_CLIP_NORM if step else 0.0, warmup_steps=1)
  tx = make_optimizer(cfg, 1000)
  # fp8_pallas_step: the non-fused kernel forced through the generic step (make_apply would
  # fuse it); fp8_fused_step: make_apply's fused step.
  apply = optim.make_apply(cfg, 1000) if kernel == "fused" else optim.generic_apply(tx)

  def update(params, grads, opt_state, denom):
    saved = {name: getattr(fp8_adam, name) for name in settings}
    for name, value in settings.items():
      setattr(fp8_adam, name, value)
    try:   # read when the kernel is traced, which is now
      if step:
        return apply(grads, denom, opt_state, params)
      updates, opt_state = tx.update(grads, opt_state, params)
    finally:
      for name, value in saved.items():
        setattr(fp8_adam, name, value)
    return optax.apply_updates(params, updates), opt_state, ()
  return tx, update


def bytes_moved(variant: str, state_bytes: int, grad_bytes: int, padded_params: int) -> int:
  """The bytes a variant must move at least: its state (params and optimizer state) in and
  out, the gradients in. A step variant reads the gradient sums twice: the global norm is a
  reduction over all of them that the clip needs before any param's update. The non-fused
  fp8 Pallas step also writes the float32 gradients (divided, clipped) for its kernel to read
  and the kernel's float32 direction for apply_updates to read, 4 bytes each way a padded
  param. (The update variants keep their first accounting: fp8_pallas's direction is not
  counted there.)"""
  if not is_step(variant):
    return 2 * state_bytes + grad_bytes
  extra = 0
  if variant.startswith("fp8_") and variant.split("_")[1] == "pallas":
    extra = 2 * 4 * padded_params * 2   # the float32 gradients and the direction
  return 2 * state_bytes + 2 * grad_bytes + extra


def hlo_launches(hlo_text: str) -> dict[str, int]:
  """Fusions and custom calls in the compiled HLO's entry computation: what XLA launches
  (on the GPU, a kernel each; a custom call is a cuBLAS call or one of our Pallas kernels)."""
  entry = hlo_text[hlo_text.index("\nENTRY"):]
  entry = entry[:entry.find("\n}") + 1] if "\n}" in entry else entry
  lines = entry.splitlines()
  return {"fusions": sum(" fusion(" in ln for ln in lines),
          "custom_calls": sum(" custom-call(" in ln for ln in lines),
          "pallas_kernels": sum(" custom-call(" in ln and "fp8_adam" in ln for ln in lines)}


def _fingerprint(tree):
  """Two wrapping int32 sums of every array's bits (one position-weighted): equal trees give
  equal fingerprints, and any changed element changes them but by a 2**-32 chance."""
  import jax
  import jax.numpy as jnp

  def one(x):
    bits = (jax.lax.bitcast_convert_type(x, jnp.int8).astype(jnp.int32) if x.dtype.itemsize == 1
            else jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32))
    flat = bits.reshape(-1)
    weight = (jnp.arange(flat.shape[0], dtype=jnp.int32) % 65521) + 1
    return jnp.stack([jnp.sum(flat), jnp.sum(flat * weight)])
  return jax.tree.map(one, tree)


def run_shape_set(name, shapes, args, device_or_none, save=lambda partial: None):
  import jax
  import jax.numpy as jnp
  import numpy as np
  from infir2_jax.train.moments import GROUP, group_shape
  grad_dtype = jnp.dtype(args.grad_dtype)
  abstract_params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}
  abstract_grads = {k: jax.ShapeDtypeStruct(s, grad_dtype) for k, s in shapes.items()}
  abstract_denom = jax.ShapeDtypeStruct((), jnp.float32)
  n_params = int(sum(np.prod(s) for s in shapes.values()))
  padded_params = int(sum(np.prod(group_shape(s) or (1,)) * GROUP for s in shapes.values()))
  out = {"shapes": name, "tensors": len(shapes), "params": n_params, "variants": {}}
  fingerprints = {}
  for variant in args.variants.split(","):
    tx, update = make_update(variant)
    abstract_state = jax.eval_shape(tx.init, abstract_params)
    step = jax.jit(update, donate_argnums=(0, 2))
    t0 = time.perf_counter()
    print(f"[{name}] {variant}: compiling ({n_params / 1e9:.2f}B params)", flush=True)
    if args.aot_gpu:
      rep = jax.sharding.SingleDeviceSharding(device_or_none)
      on = lambda tree: jax.tree.map(
          lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), tree)
      # The abstract mesh names the GPU for Pallas' Triton lowering (no GPU here).
      with jax.sharding.use_abstract_mesh(
          jax.sharding.Mesh([device_or_none], ("x",)).abstract_mesh):
        compiled = step.trace(on(abstract_params), on(abstract_grads), on(abstract_state),
                              on(abstract_denom)).lower(lowering_platforms=("cuda",)).compile()
    else:
      compiled = step.lower(abstract_params, abstract_grads, abstract_state,
                            abstract_denom).compile()
    entry = {"compile_s": round(time.perf_counter() - t0, 1),
             **hlo_launches(compiled.as_text())}
    memory = compiled.memory_analysis()   # the temporaries beside the donated state
    if memory is not None:
      entry["temp_gib"] = round(memory.temp_size_in_bytes / 2**30, 3)
    state_bytes = sum(x.size * x.dtype.itemsize for x in
                      jax.tree.leaves((abstract_params, abstract_state)))
    grad_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract_grads))
    entry["bytes_moved"] = bytes_moved(variant, state_bytes, grad_bytes, padded_params)
    entry["bytes_per_param"] = round(entry["bytes_moved"] / n_params, 3)
    if not args.aot_gpu:
      entry.update(_time_variant(step, tx, abstract_params, grad_dtype, args, fingerprints,
                                 variant))
      entry["gb_per_s"] = round(entry["bytes_moved"] / entry["ms"] / 1e6, 1)
    out["variants"][variant] = entry
    print(f"[{name}] {variant}: {entry}", flush=True)
    save(out)   # what is measured survives a run cut short
  for step_kind in (False, True):   # update variants with each other, step variants too
    fp8 = [v for v in fingerprints if v.startswith("fp8_") and is_step(v) == step_kind]
    if len(fp8) < 2:
      continue
    ref = fingerprints[fp8[0]]
    out["bit_identical_to_" + fp8[0]] = {
        v: bool(all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(ref),
                                                         jax.tree.leaves(fingerprints[v]))))
        for v in fp8[1:]}
    print(f"[{name}] bit-identical: {out['bit_identical_to_' + fp8[0]]}", flush=True)
    if args.tiny:  # whole arrays: say how far apart, not only whether
      out["differences_to_" + fp8[0]] = {
          v: _differences(ref, fingerprints[v]) for v in fp8[1:]}
      print(f"[{name}] differences: {out['differences_to_' + fp8[0]]}", flush=True)
  return out


def _differences(ref, other) -> dict:
  """How two trees of arrays differ: arrays and elements that differ, and the largest
  distance in units in the last place (float32 bits; fp8 codes for one-byte arrays)."""
  import jax
  import numpy as np
  arrays = elements = max_ulp = 0
  for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(other)):
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype.itemsize == 1:
      ia, ib = a.view(np.int8).astype(np.int64), b.view(np.int8).astype(np.int64)
    else:
      ia, ib = (x.astype(np.float32).view(np.int32).astype(np.int64) for x in (a, b))
    low = -2 ** (8 * min(a.dtype.itemsize, 4) - 1)  # sign-magnitude -> ordered integers
    ia, ib = (np.where(x < 0, low - x, x) for x in (ia, ib))
    diff = np.abs(ia - ib)
    n = int(np.count_nonzero(diff))
    arrays, elements = arrays + bool(n), elements + n
    max_ulp = max(max_ulp, int(diff.max(initial=0)))
  return {"arrays": arrays, "elements": elements, "max_ulp": max_ulp}


@functools.lru_cache(maxsize=None)
def _generators():
  """(param(key, shape), grad(key, shape, dtype)): one small jitted program per shape."""
  import jax
  import jax.numpy as jnp

  @functools.partial(jax.jit, static_argnums=1)
  def param(key, shape):
    return jax.random.normal(key, shape, jnp.float32)

  @functools.partial(jax.jit, static_argnums=(1, 2))
  def grad(key, shape, dtype):
    # Gradients spanning decades, with exact zeros, as real ones do.
    k1, k2, k3 = jax.random.split(key, 3)
    g = jax.random.normal(k1, shape) * 10.0 ** jax.random.uniform(k2, shape, minval=-6,
                                                                   maxval=0)
    return jnp.where(jax.random.uniform(k3, shape) < 0.05, 0.0, g).astype(dtype)
  return param, grad


def _time_variant(step, tx, abstract_params, grad_dtype, args, fingerprints, variant):
  """Runs `args.steps` updates from a seeded state (the same for every variant), keeps the
  fingerprint (or, --tiny, the arrays) of the result, then times `args.iters` more."""
  import jax
  import jax.numpy as jnp

  def make_inputs():
    # One small jitted generator per (shape, kind), not one jit over every tensor: at 1.5B
    # that single program of 338 x 4 random draws took 254 s to compile (CPU) and timed out
    # the GPU run before its first print.
    param, grad = _generators()
    keys = jax.random.split(jax.random.key(0), 2 * len(abstract_params))
    params = {k: param(keys[i], x.shape) for i, (k, x) in enumerate(abstract_params.items())}
    grads = {k: grad(keys[len(abstract_params) + i], x.shape, jnp.dtype(grad_dtype))
             for i, (k, x) in enumerate(abstract_params.items())}
    return params, grads, jax.jit(tx.init)(params)

  t0 = time.perf_counter()
  params, grads, opt_state = jax.block_until_ready(make_inputs())
  print(f"  {variant}: inputs on the device in {time.perf_counter() - t0:.1f} s", flush=True)
  # A step variant's grads are the raw sums over DENOM tokens (the same draws: the sums of
  # every step variant are equal, as the gradients of every update variant are).
  denom = jnp.float32(DENOM)
  extra = ()
  for _ in range(args.steps):
    params, opt_state, extra = step(params, grads, opt_state, denom)
  if variant.startswith("fp8_"):
    result = (params, opt_state, extra)   # extra: () for an update variant, the norm for a step
    fingerprints[variant] = jax.device_get(result if args.tiny else _fingerprint(result))
  jax.block_until_ready((params, opt_state))
  print(f"  {variant}: {args.steps} updates and the fingerprint in "
        f"{time.perf_counter() - t0:.1f} s", flush=True)
  t0 = time.perf_counter()
  for _ in range(args.iters):
    params, opt_state, _ = step(params, grads, opt_state, denom)
  jax.block_until_ready((params, opt_state))
  ms = (time.perf_counter() - t0) * 1e3 / args.iters
  del params, grads, opt_state
  timing = {"ms": round(ms, 3)}
  if jax.tree.leaves(extra):
    timing["grad_norm"] = float(extra)   # after the first --steps: above the clip's norm
  return timing


def main(argv):
  args = parse_args(argv)
  import jax
  from infir2_jax.bench.tools import run_info
  device = None
  if args.aot_gpu:
    from jax.experimental import topologies
    path = os.environ.get("INFIR2_GPU_TARGET_CONFIG")
    if not path:
      raise SystemExit("--aot_gpu: set INFIR2_GPU_TARGET_CONFIG "
                       "(benchmarks/gpu_target_configs/README.md)")
    with open(path) as f:
      device = topologies.get_topology_desc(platform="cuda", topology="1x1x1",
                                            target_config=f.read()).devices[0]
  shape_sets = ({"tiny": TINY_SHAPES} if args.tiny else
                {spec: param_shapes(spec) for spec in args.configs.split(",")})
  results = {**run_info(argv), "aot_gpu": args.aot_gpu, "grad_dtype": args.grad_dtype,
             "steps": args.steps, "iters": args.iters, "results": []}
  if args.aot_gpu:
    results["device"] = "H200 (deviceless AOT from $INFIR2_GPU_TARGET_CONFIG): nothing ran"

  def save(partial=None):
    if args.out:
      with open(args.out, "w") as f:
        json.dump({**results, "results": results["results"] + ([partial] if partial else [])},
                  f, indent=1)
  for name, shapes in shape_sets.items():
    results["results"].append(run_shape_set(name, shapes, args, device, save))
    save()
  del jax
  return results


if __name__ == "__main__":
  main(sys.argv[1:])
