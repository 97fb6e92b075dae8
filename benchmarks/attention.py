"""Document-masked attention on the H200: the candidate kernels side by side, fwd+bwd.

  python benchmarks/attention.py --out=benchmarks/results/attention_h200.json

For each shape (the 1.5B at 2 x 8192, the 7B at 4 x 4096) and segment layout (8 equal
documents per row; lengths from a long-tailed document distribution; one document = causal)
it times jax.grad of sum(out * dy) (CUPTI kernel sums, median) for:
  dense     cuDNN with a dense [B, 1, L, L] segment mask + is_causal (the model before)
  causal    cuDNN causal over the whole row (attends across documents: the speed yardstick)
  packed_M  cuDNN's packed layout (segment lengths and offsets, at most M segments per row)
  fa3       FlashAttention-3 varlen (flash-attn3-jax), when it imports
  mgpu_causal  JAX's own Mosaic GPU FlashAttention-3 (jax.experimental.pallas.ops.gpu.
            attention_mgpu; causal over the whole row: it takes no segments), the kernel
            issue 39's FP8 attention starts from; mgpu_full: the same without a mask
  fp8       our FP8 forward kernel (precision/kernels/fp8_attention.py: Q, K, P, V in E4M3
            with 1x128 UE8M0 tiles, documents as block-skipping + masks), its quantization
            pre-pass included; without --fwd_only its backward is cuDNN packed's BF16
            backward through jax.vjp, which recomputes cuDNN's forward first (so fwd+bwd
            over-counts by one BF16 forward until the kernel hands cuDNN its statistics)
and the largest |difference| of each output and input gradient from the dense path's; for
fp8 also its output's largest |difference| from its online reference (XLA on the same GPU).
With --fwd_only, the forward alone is timed (issue 39's forward target: >= 1.5x BF16 cuDNN).
"""

import argparse
import functools
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = {"1p5b_8k": (2, 8192, 12, 2), "7b_4k": (4, 4096, 28, 4)}  # B, L, heads, KV heads
HEAD_DIM = 128


def segment_layouts(rows: int, length: int, seed: int = 0) -> dict[str, np.ndarray]:
  """[rows, length] int32 segment ids (runs of equal ids, from 1) of each layout."""
  rng = np.random.default_rng(seed)
  out = {"8_docs": np.repeat(np.arange(1, 9), length // 8)[None].repeat(rows, 0),
         "1_doc": np.ones((rows, length), np.int64)}
  ids = np.zeros((rows, length), np.int64)
  for r in range(rows):  # log-normal document lengths, median ~600 tokens: web-text-like
    t, doc = 0, 1
    while t < length:
      n = int(np.clip(rng.lognormal(np.log(600), 1.0), 16, length))
      ids[r, t:t + n] = doc
      t, doc = t + n, doc + 1
  out["lognormal_docs"] = ids
  return {k: v.astype(np.int32) for k, v in out.items()}


def mgpu_causal(q, k, v, blocks: str, causal: bool = True):
  """JAX's Mosaic GPU FlashAttention-3 forward (and backward), causal, GQA.

  In float16: jax 0.11.2's kernel declares its shared-memory buffers float16 whatever the
  inputs are, and bf16 inputs fail to lower ("src had type bfloat16 and dst had type
  float16", deviceless H200 compile, session 22). Its causal mask refuses CUDA runtimes
  12.8.0-12.9.0 (a ptxas miscompilation, its own check)."""
  import jax.numpy as jnp
  from jax.experimental.pallas.ops.gpu import attention_mgpu
  block_q, block_kv, steps = map(int, blocks.split(","))
  config = attention_mgpu.TuningConfig(block_q=block_q, block_kv=block_kv,
                                       max_concurrent_steps=steps, causal=causal)
  half = lambda x: x.astype(jnp.float16)
  return attention_mgpu.attention(half(q), half(k), half(v), config).astype(q.dtype)


def fp8_forward_packed_backward(q, k, v, segment_ids, max_segments: int):
  """Our FP8 forward kernel, with cuDNN packed's BF16 backward (its jax.vjp recomputes the
  BF16 forward: see the module doc)."""
  import jax
  from infir2_jax.model import packed_attention as pa
  from infir2_jax.precision.kernels import fp8_attention as fp8_kernel

  @jax.custom_vjp
  def attend(q, k, v):
    return fp8_kernel.fp8_attention_forward(q, k, v, segment_ids)

  def fwd(q, k, v):
    return attend(q, k, v), (q, k, v)

  def bwd(res, g):
    _, vjp = jax.vjp(lambda q, k, v: pa.cudnn_packed(q, k, v, segment_ids, max_segments), *res)
    return vjp(g)
  attend.defvjp(fwd, bwd)
  return attend(q, k, v)


def max_abs_diffs(got, want) -> dict[str, float]:
  """Largest |difference| of out, dq, dk, dv (as float32) between two variants' results."""
  import jax.numpy as jnp
  return {t: float(jnp.max(jnp.abs(a.astype(jnp.float32) - r.astype(jnp.float32))))
          for t, a, r in zip(("out", "dq", "dk", "dv"), got, want)}


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--out", default="")
  p.add_argument("--shapes", default=",".join(SHAPES))
  p.add_argument("--max_segments", default="16,64")
  p.add_argument("--iters", type=int, default=10)
  p.add_argument("--fwd_only", action="store_true", help="time the forward pass alone")
  p.add_argument("--mgpu_blocks", default="128,128,2",
                 help="JAX Mosaic GPU attention's block_q,block_kv,max_concurrent_steps")
  args = p.parse_args()
  import jax
  import jax.numpy as jnp
  from infir2_jax.bench import tools as benchtools
  from infir2_jax.model import packed_attention as pa

  try:
    import flash_attn3_jax  # noqa: F401
    have_fa3 = True
  except ImportError as e:
    print(f"flash-attn3-jax unavailable: {e}")
    have_fa3 = False
  results = {**benchtools.run_info(sys.argv), "cases": []}
  for shape_name in args.shapes.split(","):
    b, length, heads, kv_heads = SHAPES[shape_name]
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (b, length, heads, HEAD_DIM), jnp.bfloat16)
    k = jax.random.normal(keys[1], (b, length, kv_heads, HEAD_DIM), jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, length, kv_heads, HEAD_DIM), jnp.bfloat16)
    dy = jax.random.normal(keys[3], q.shape, jnp.bfloat16)
    # causal attention FLOPs, fwd + bwd (bwd = 2.5 x fwd), as the step benchmark counts them
    causal_flops = 3.5 * 4 * b * heads * HEAD_DIM * length * length / 2
    for layout, seg_np in segment_layouts(b, length).items():
      seg = jnp.asarray(seg_np)
      counts = [len(np.unique(r)) for r in seg_np]
      variants = {
          "dense": lambda q, k, v, s: pa.dense_cudnn(q, k, v, s),
          "causal": lambda q, k, v, s: jax.nn.dot_product_attention(
              q, k, v, is_causal=True, implementation="cudnn"),
      }
      for m in map(int, args.max_segments.split(",")):
        if max(counts) <= m:
          variants[f"packed_{m}"] = lambda q, k, v, s, m=m: pa.cudnn_packed(q, k, v, s, m)
      if have_fa3:
        variants["fa3"] = lambda q, k, v, s: pa.fa3_varlen(q, k, v, s)
      variants["mgpu_causal"] = lambda q, k, v, s: mgpu_causal(q, k, v, args.mgpu_blocks)
      # No mask at all (twice the causal FLOPs): the kernel's rate where its causal mask is
      # refused (CUDA runtime 12.8.0-12.9.0; the deviceless wheels here report 12.9.0).
      variants["mgpu_full"] = lambda q, k, v, s: mgpu_causal(q, k, v, args.mgpu_blocks, False)
      packed_m = next((m for m in map(int, args.max_segments.split(",")) if max(counts) <= m),
                      None)
      if packed_m is not None:
        variants["fp8"] = functools.partial(fp8_forward_packed_backward, max_segments=packed_m)
      outs, case = {}, {"shape": shape_name, "layout": layout, "segments_per_row": counts}
      for name, fn in variants.items():
        def loss(q, k, v, fn=fn):
          out = fn(q, k, v, seg)
          return jnp.sum(out.astype(jnp.float32) * dy.astype(jnp.float32)), out
        if args.fwd_only:
          forward = jax.jit(lambda q, k, v, fn=fn: fn(q, k, v, seg))
        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
        try:
          if args.fwd_only:
            out = forward(q, k, v)
            dq = dk = dv = jnp.zeros((), jnp.float32)
            ms = benchtools.device_ms(forward, (q, k, v), iters=args.iters)
          else:
            (dq, dk, dv), out = grad(q, k, v)
            ms = benchtools.device_ms(grad, (q, k, v), iters=args.iters)
        except Exception as e:  # noqa: BLE001 - a candidate that fails is a result
          case[name] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
          print(shape_name, layout, name, "FAILED", case[name]["error"][:200], flush=True)
          continue
        outs[name] = (out, dq, dk, dv)
        flops = (causal_flops / 3.5 if args.fwd_only else causal_flops) * (
            2 if name == "mgpu_full" else 1)
        case[name] = {"ms": ms, "causal_equivalent_tflops": flops / ms / 1e9}
      ref = outs.get("dense")
      for name, got in outs.items():
        if ref is not None and name not in ("causal", "mgpu_causal", "mgpu_full"):
          case[name]["max_abs_diff_vs_dense"] = max_abs_diffs(got, ref)
      if "fp8" in outs:
        from infir2_jax.precision.kernels import fp8_attention as fp8_kernel
        want = jax.jit(fp8_kernel.online_reference)(q, k, v, seg)
        case["fp8"]["max_abs_diff_vs_online_reference"] = float(
            jnp.max(jnp.abs(outs["fp8"][0].astype(jnp.float32) - want.astype(jnp.float32))))
        case["fp8"]["max_abs_out"] = float(jnp.max(jnp.abs(want.astype(jnp.float32))))
      if "causal" in outs and "mgpu_causal" in outs:
        case["mgpu_causal"]["max_abs_diff_vs_causal"] = max_abs_diffs(outs["mgpu_causal"],
                                                                      outs["causal"])
      results["cases"].append(case)
      print(json.dumps({k: (v if not isinstance(v, dict) else
                            {kk: vv for kk, vv in v.items() if kk != "max_abs_diff_vs_dense"})
                        for k, v in case.items() if k != "segments_per_row"}), flush=True)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
