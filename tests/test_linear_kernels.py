"""benchmarks/linear_kernels.py's reading of an optimized HLO module (the compile itself needs
the CUDA plugin, see benchmarks/gpu_target_configs/README.md)."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import linear_kernels  # noqa: E402  (benchmarks/linear_kernels.py)

HLO = """HloModule jit_loss

%fused_transpose (p: bf16[1536,256]) -> bf16[256,1536] {
  %x = bf16[256,1536]{1,0} fusion(%p), kind=kLoop
}

ENTRY %main (x: bf16[16384,1536], w: bf16[1536,256]) -> bf16[1536,256] {
  %wrapped_transpose = bf16[256,1536]{1,0} fusion(%w), kind=kInput, calls=%fused_transpose
  %mpmd_map.10 = (f8e4m3fn[256,1536]{1,0}, f32[2,48]{1,0}) custom-call(%wrapped_transpose), custom_call_target="mosaic_gpu_v2", backend_config={"kernel_name":"infir2_quantize_blocks_256x1536"}
  ROOT %mpmd_map.16 = bf16[1,16384,256]{2,1,0} custom-call(%x), custom_call_target="mosaic_gpu_v2", metadata={op_name="infir2_fp8_gemm_16384x256x1536_n128_split1"}
}
"""


def test_launched_lists_entry_kernels_in_order_and_names_ours():
  ops = linear_kernels.launched(HLO)
  assert [o["op"] for o in ops] == ["wrapped_transpose", "mpmd_map.10", "mpmd_map.16"]
  assert [o["kernel"] for o in ops] == [None, "infir2_quantize_blocks_256x1536",
                                        "infir2_fp8_gemm_16384x256x1536_n128_split1"]
  assert ops[0]["shape"] == "bf16[256,1536]{1,0}"
