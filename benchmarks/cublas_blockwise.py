"""cuBLAS's own block-scaled FP8 GEMM (through PyTorch) as a vendor baseline for gemm.py.

XLA does not expose cuBLASLt's 1x128 / 128x128 block scaling on Hopper, so the recipe's exact
GEMM from the vendor library is reached through PyTorch's scaled_mm (cuBLASLt >= 12.9, sm90).
Our operands are handed over unchanged: A [M, K] fp8 with [M, Kb] scales, B [N, K] fp8
(K-major, i.e. the column-major [K, N] cuBLAS wants) with [Nb, Kb] or [N, Kb] scales.
PyTorch's scale layouts differ between versions, so each candidate layout is tried and the
first whose output matches our kernel's (relative Frobenius error < 2e-2) is timed.
"""
import numpy as np

MATCH_TOL = 2e-2


def _candidates(torch, a_s, b_s, kind):
  """(name, call(a, b_kn, sa, sb), sa, sb) candidates over PyTorch's APIs and scale layouts."""
  f = torch.nn.functional
  cuda = lambda x: torch.from_numpy(np.ascontiguousarray(x, np.float32)).cuda()
  sa_mxkb = cuda(np.asarray(a_s).T).t()  # [M, Kb], M-major ("outer-dim-major")
  b_s = np.asarray(b_s)
  if kind == "row":
    sb_v2 = cuda(b_s.T).t()  # [N, Kb], N-major (PyTorch's test for 1x128 x 1x128)
    sb_v1 = [cuda(b_s.T), cuda(b_s).t()]  # [Kb, N] both ways
  else:
    kb4 = -(-b_s.shape[1] // 4) * 4  # the block grid padded to 4 K blocks, [L4, Nb]
    sb_v2 = cuda(np.pad(b_s, ((0, 0), (0, kb4 - b_s.shape[1])))).t()
    sb_v1 = [cuda(b_s.T), cuda(b_s).t()]  # [Kb, Nb] both ways
  out = []
  if hasattr(f, "scaled_mm") and hasattr(f, "ScalingType"):
    st, sw = f.ScalingType, f.SwizzleType
    recipe_b = st.BlockWise1x128 if kind == "row" else st.BlockWise128x128

    def v2(a, b_kn, sa, sb):
      return f.scaled_mm(a, b_kn, [sa], [st.BlockWise1x128], [sb], [recipe_b],
                         swizzle_a=[sw.NO_SWIZZLE], swizzle_b=[sw.NO_SWIZZLE],
                         output_dtype=torch.bfloat16)
    out.append(("scaled_mm_v2", v2, sa_mxkb, sb_v2))

  def v1(a, b_kn, sa, sb):
    return torch._scaled_mm(a, b_kn, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
  out += [(f"_scaled_mm_layout{i}", v1, sa_mxkb, sb) for i, sb in enumerate(sb_v1)]
  return out


def _to_torch_fp8(torch, x):
  dtype = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}[str(x.dtype)]
  return torch.from_numpy(np.asarray(x).view(np.uint8)).cuda().view(dtype)


def time_cublas_blockwise(fp8_sets, kind, expected, iters):
  """Device ms per GEMM over the operand sets (each read once per round): CUPTI kernel sums
  from torch.profiler (as ours), with CUDA events over the same calls kept beside them.

  Args:
    fp8_sets: [(a_q, a_s, b_q, b_s)] JAX arrays; the first is checked against `expected`.
    kind: "block" (B 128x128) or "row" (B 1x128, wgrad).
    expected: our kernel's [M, N] output on the first set.
    iters: timed rounds over all sets.
  Returns:
    {"ms", "ms_cuda_events", "ms_kernels", "kernels", "api", "rel_err_vs_ours", "timing"}
    or {"error": ...}.
  """
  try:
    import torch
  except ImportError as e:
    return {"error": f"no PyTorch: {e}"}
  if not torch.cuda.is_available():
    return {"error": "PyTorch sees no CUDA device"}
  # Per operand set: the fp8 tensors and every candidate's scales, built once.
  sets = [(_to_torch_fp8(torch, a), _to_torch_fp8(torch, b).t(), _candidates(torch, a_s, b_s, kind))
          for a, a_s, b, b_s in fp8_sets]
  want = np.asarray(expected, np.float32)
  errors = {}
  for i, (name, call, *_) in enumerate(sets[0][2]):
    try:
      prepared = [(a, b_kn, *cands[i][2:]) for a, b_kn, cands in sets]
      got = call(*prepared[0]).float().cpu().numpy()
      err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
      if not err < MATCH_TOL:
        errors[name] = f"output differs from ours: rel err {err:.3g}"
        continue
      for _ in range(3):
        for args in prepared:
          call(*args)
      start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
      torch.cuda.synchronize()
      start.record()
      for _ in range(iters):
        for args in prepared:
          call(*args)
      end.record()
      torch.cuda.synchronize()
      events_ms = start.elapsed_time(end) / (iters * len(prepared))
      kernels_ms, names = _kernel_ms(torch, call, prepared, iters)
      # Kernel time (CUPTI, as ours and XLA's are timed) when the profiler gives it: events
      # also count the gaps while PyTorch's host code launches the next call, which on a
      # 15-30 us GEMM can be most of the time (session 9: 283 vs 567 TFLOP/s between runs).
      ms = kernels_ms if kernels_ms else events_ms
      return {"ms": ms, "ms_cuda_events": events_ms, "ms_kernels": kernels_ms,
              "kernels": names, "api": name, "rel_err_vs_ours": err, "torch": torch.__version__,
              "timing": ("cupti kernel sums (torch.profiler)" if kernels_ms
                         else "cuda events over back-to-back calls")}
    except Exception as e:  # noqa: BLE001 - try the next layout, report all if none works
      errors[name] = f"{type(e).__name__}: {str(e)[:300]}"
  return {"error": errors}


def _kernel_ms(torch, call, prepared, iters):
  """Device ms per call summed over the CUDA kernels it launches (torch.profiler / CUPTI),
  and their names; (None, []) if the profiler records none."""
  try:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
      for _ in range(iters):
        for args in prepared:
          call(*args)
      torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
  except Exception as e:  # noqa: BLE001 - fall back to CUDA events
    print(f"torch.profiler kernel timing failed: {type(e).__name__}: {e}", flush=True)
    return None, []
  if not kernels:
    return None, []
  total_us = sum(e.time_range.elapsed_us() for e in kernels)
  return total_us / 1e3 / (iters * len(prepared)), sorted({e.name for e in kernels})


def kernel_names(m, n, k, kind):
  """The CUDA kernels cuBLAS runs for one block-scaled GEMM (tile and cluster shapes are in
  the names), from PyTorch's profiler; random operands with unit scales."""
  import torch
  a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
  b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
  kb = -(-k // 128)
  a_s = np.ones((m, kb), np.float32)
  b_s = np.ones((n if kind == "row" else -(-n // 128), kb), np.float32)
  for name, call, sa, sb in _candidates(torch, a_s, b_s, kind):
    try:
      call(a, b.t(), sa, sb)
      torch.cuda.synchronize()
      with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        call(a, b.t(), sa, sb)
        torch.cuda.synchronize()
      return name, sorted({e.name for e in prof.events() if e.device_type.name == "CUDA"})
    except Exception as e:  # noqa: BLE001 - next layout
      last = f"{type(e).__name__}: {e}"
  return None, [last]


if __name__ == "__main__":
  import json
  import sys
  shapes = [(8192, 8192, 8192, "block"), (16384, 8960, 1536, "block"),
            (16384, 1536, 8960, "block"), (1536, 8960, 16384, "row"),
            (16384, 1536, 256, "block"), (1536, 1536, 16384, "row")]
  out = {f"{m}x{n}x{k}_{kind}": kernel_names(m, n, k, kind) for m, n, k, kind in shapes}
  print(json.dumps(out, indent=1))
  if len(sys.argv) > 1:
    with open(sys.argv[1], "w") as f:
      json.dump(out, f, indent=1)
