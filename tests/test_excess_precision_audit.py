"""benchmarks/excess_precision_audit.py's reading of optimized HLO: a kernel operand that XLA
hands over unrounded under its defaults (a folded convert pair) is reported, one that is the
same either way is not. The HLO below is the shape of session 30's finding, trimmed."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import excess_precision_audit as audit  # noqa: E402

_MODULE = """HloModule jit_train_step

%fused_rsqrt (param_0: f32[256]) -> f32[256] {
  %param_0 = f32[256]{0} parameter(0)
  ROOT %rsqrt.1 = f32[256]{0} rsqrt(%param_0)
}

%fused_gamma (param_0.1: f32[128]) -> f32[128] {
  %param_0.1 = f32[128]{0} parameter(0)
  %convert.1 = bf16[128]{0} convert(%param_0.1)
  ROOT %convert.2 = f32[128]{0} convert(%convert.1)
}

ENTRY %main (h.1: bf16[256,128], ss.1: f32[256], g.1: f32[128]) -> f8e4m3fn[256,128] {
  %h.1 = bf16[256,128]{1,0} parameter(0)
  %ss.1 = f32[256]{0} parameter(1)
  %g.1 = f32[128]{0} parameter(2)
  %inv.1 = f32[256]{0} fusion(%ss.1), kind=kLoop, calls=%fused_rsqrt
  GAMMA
  ROOT %mpmd_map.0 = f8e4m3fn[256,128]{1,0} custom-call(%h.1, %inv.1, OPERAND), custom_call_target="mosaic_gpu_v2"
}
"""
_ROUNDED = "%gamma.1 = f32[128]{0} fusion(%g.1), kind=kLoop, calls=%fused_gamma"


def _module(folded: bool) -> str:
  return (_MODULE.replace("GAMMA", "" if folded else _ROUNDED)
          .replace("OPERAND", "%g.1" if folded else "%gamma.1"))


def test_a_folded_rounding_before_a_kernel_is_reported():
  folded = audit.kernel_operands(_module(folded=True))
  exact = audit.kernel_operands(_module(folded=False))
  (signature,) = exact
  assert signature.startswith("f8e4m3fn[256,128]{1,0} <- bf16[256,128]{1,0},f32[256]{0}")
  assert exact[signature] == [("parameter[bf16[256,128]{1,0}]", "fusion[f32[256]{0}:rsqrtx1]",
                               "fusion[f32[128]{0}:convertx2]")]
  (found,) = audit.differences(folded, exact)
  assert found["default_only"] == [("parameter[bf16[256,128]{1,0}]",
                                    "fusion[f32[256]{0}:rsqrtx1]", "parameter[f32[128]{0}]")]
  assert found["exact_only"] == exact[signature]


def test_the_same_operands_either_way_are_not_reported():
  text = _module(folded=False)
  assert audit.differences(audit.kernel_operands(text), audit.kernel_operands(text)) == []
  assert audit.kernel_operands(text.replace("mosaic_gpu_v2", "cublas")) == {}
