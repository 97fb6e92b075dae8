"""infir2_jax.bench.profile on a trace in jax.profiler's format (Chrome trace events)."""

import gzip
import json

import pytest

from infir2_jax.bench import profile as profile_summary
from infir2_jax.precision.kernels.gemm import gemm_kernel_name, parse_gemm_kernel_name


def test_gemm_kernel_name_round_trips():
  name = gemm_kernel_name(16384, 1536, 8960, 192, 1)
  assert parse_gemm_kernel_name(f"{name}_mosaic_gpu") == {
      "m": 16384, "n": 1536, "k": 8960, "tile_n": 192, "split_k": 1}
  assert parse_gemm_kernel_name("nvjet_tst_128x256_64x4_bf16") is None


def _write_trace(tmp_path, events):
  run = tmp_path / "plugins" / "profile" / "2026_11_30"
  run.mkdir(parents=True)
  meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
          {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0"}}]
  with gzip.open(run / "host.trace.json.gz", "wt") as f:
    json.dump({"traceEvents": meta + events}, f)


def test_summary_by_kind_and_in_step_gemm_rates(tmp_path):
  fprop = gemm_kernel_name(16384, 1536, 1536, 128, 1)
  wgrad = gemm_kernel_name(1536, 256, 16384, 128, 4)
  kernel = lambda name, ts, us, pid=7: {"ph": "X", "pid": pid, "name": name, "ts": ts, "dur": us}
  _write_trace(tmp_path, [  # one after another, but for a copy that runs beside the wgrad
      kernel(fprop + "_mosaic_gpu", 0, 100.0), kernel(fprop + "_mosaic_gpu", 100, 100.0),
      kernel(wgrad, 200, 50.0),
      kernel("infir2_quantize_tiles_t_16384x1536_mosaic_gpu", 250, 40.0),
      kernel("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 290, 300.0),
      kernel("nvjet_tst_192x192_64x4_2x1_v_bz_TNN", 590, 80.0),
      kernel("loop_multiply_fusion", 230, 30.0),
      kernel(fprop, 0, 999.0, pid=1),  # a host-side event: not GPU time
      kernel("infir2_fused_quantize_swiglu_bwd_16384x8960_mosaic_gpu", 700, 60.0),
  ])
  summary = profile_summary.summarize_trace(str(tmp_path))
  assert summary["ms_by_kind"] == pytest.approx({
      "pallas_fp8_gemm": 0.25, "pallas_quantize": 0.04, "attention": 0.3, "gemm": 0.08,
      "other": 0.03, "pallas_fused_quantize": 0.06})
  assert summary["device_ms_total"] == pytest.approx(0.76)
  rows = {(r["m"], r["n"], r["k"]): r for r in summary["fp8_gemm_by_problem"]}
  assert rows[(16384, 1536, 1536)]["calls"] == 2
  # 2 calls x 2 * 16384 * 1536 * 1536 FLOPs in 200 us
  assert rows[(16384, 1536, 1536)]["tflops"] == pytest.approx(2 * 2 * 16384 * 1536**2 / 200e-6 / 1e12)
  assert rows[(1536, 256, 16384)]["split_k"] == 4
  assert [r["ms"] for r in summary["fp8_gemm_by_problem"]] == [0.2, 0.05]  # slowest first
  # The fusion (230-260 us) overlaps the wgrad's last 20 us and the quantization's first 10.
  overlap = summary["concurrency"]
  assert overlap["summed_ms"] == pytest.approx(0.76)
  assert overlap["busy_ms"] == pytest.approx(0.73)
  assert overlap["overlapped_ms_by_kind"] == pytest.approx(
      {"pallas_fp8_gemm": 0.02, "pallas_quantize": 0.01, "other": 0.03})


def test_missing_trace_is_reported(tmp_path):
  assert "no trace" in profile_summary.summarize_trace(str(tmp_path))["error"]
