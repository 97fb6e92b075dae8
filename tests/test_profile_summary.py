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


HLO = """
%fused_slice (param_0: bf16[8,1024,512], param_1: s32[]) -> bf16[1024,512] {
  %param_0 = bf16[8,1024,512]{2,1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %c = s32[] constant(0)
  %dynamic-slice.1 = bf16[1,1024,512]{2,1,0} dynamic-slice(%param_0, %param_1, %c, %c), dynamic_slice_sizes={1,1024,512}
  ROOT %bitcast.1 = bf16[1024,512]{1,0} bitcast(%dynamic-slice.1)
}

ENTRY %main (x: bf16[1024,512], stack: bf16[8,1024,512], i: s32[]) -> (f32[1024], bf16[8,1024,512]) {
  %x = bf16[1024,512]{1,0} parameter(0)
  %stack = bf16[8,1024,512]{2,1,0} parameter(1)
  %i = s32[] parameter(2)
  %input_reduce_fusion.3 = f32[1024]{0} fusion(%stack, %i), kind=kInput, calls=%fused_slice, metadata={op_name="jit(f)/Qwen2/layers/input_layernorm/reduce_sum"}
  %loop_dynamic_update_slice_fusion = bf16[8,1024,512]{2,1,0} fusion(%stack, %x, %i), kind=kLoop, calls=%fused_dus
  %loop_add_fusion.2 = (f32[512,512]{1,0}, f32[512,512]{1,0}, f32[512,512]{1,0}) fusion(%x, %x), kind=kLoop, calls=%fused_adam
  ROOT %t = (f32[1024]{0}, bf16[8,1024,512]{2,1,0}) tuple(%input_reduce_fusion.3, %loop_dynamic_update_slice_fusion)
}
"""


def test_hlo_bytes_counts_what_each_kernel_touches():
  from infir2_jax.bench.hlo_bytes import instruction_bytes
  sizes = instruction_bytes(HLO)
  layer = 1024 * 512 * 2
  # the stack through its dynamic-slice only (one layer), the index, the f32 result
  assert sizes["input_reduce_fusion_3"]["bytes"] == layer + 4 + 1024 * 4
  # in place: the update read and written, not the stacked buffer
  assert sizes["loop_dynamic_update_slice_fusion"]["bytes"] == 2 * (layer + 4)
  # a loop fusion reads no operand beyond its result's size
  assert sizes["loop_add_fusion_2"]["bytes"] == 3 * 512 * 512 * 4 + 2 * layer


def test_profile_other_groups_kernels_by_what_they_write():
  import importlib.util, os
  path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "benchmarks", "profile_other.py")
  spec = importlib.util.spec_from_file_location("profile_other", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  assert module.group_of("loop_add_fusion_2", "jit(train_step)/add",
                         "(f32[512,512]{1,0}, f32[512,512]{1,0}, f32[512,512]{1,0})") == (
                             "optimizer update")
  assert module.group_of("loop_multiply_fusion", "jit(train_step)/mul",
                         "f32[2,8192,151936]{2,1,0}") == "loss and logits"
  assert module.group_of("input_reduce_fusion_3", module.op_names(HLO)["input_reduce_fusion_3"],
                         "f32[1024]{0}") == "norms"


def test_hlo_bytes_counts_one_element_of_a_tuple_operand():
  """'%t#1' reads element 1 of the tuple %t, not the whole tuple (XLA's dump names an
  element of an optimization barrier's or a while's result this way)."""
  from infir2_jax.bench.hlo_bytes import instruction_bytes, tuple_element
  assert tuple_element("(f32[2]{0}, (bf16[3]{0}, s32[]), bf16[4,5]{1,0})", 1) == (
      "(bf16[3]{0}, s32[])")
  assert tuple_element("(f32[2]{0}, (bf16[3]{0}, s32[]), bf16[4,5]{1,0})", 2) == (
      "bf16[4,5]{1,0}")
  hlo = """HloModule m

%fused_reduce (p0: bf16[1536,8960]) -> f32[1536] {
  %p0 = bf16[1536,8960]{1,0} parameter(0)
  ROOT %r = f32[1536]{0} reduce(%p0), dimensions={1}
}

ENTRY %main (a: bf16[1536,8960], b: f32[151936,1536]) -> f32[1536] {
  %a = bf16[1536,8960]{1,0} parameter(0)
  %b = f32[151936,1536]{1,0} parameter(1)
  %opt = (f32[151936,1536]{1,0}, bf16[1536,8960]{1,0}) opt-barrier(%b, %a)
  ROOT %input_reduce_fusion = f32[1536]{0} fusion(%opt#1), kind=kInput, calls=%fused_reduce
}
"""
  sizes = instruction_bytes(hlo)
  assert sizes["input_reduce_fusion"]["bytes"] == 1536 * 8960 * 2 + 1536 * 4
