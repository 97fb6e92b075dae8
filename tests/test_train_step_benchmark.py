"""benchmarks/train_step.py's step timing and the trace's idle-gap analysis (CPU; the GPU
timings themselves run on the H200 only)."""
import os
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import train_step as bench  # noqa: E402  (benchmarks/train_step.py)
from infir2_jax.bench.profile import idle_gaps  # noqa: E402


class _Pending:
  """A step's output whose value is ready `busy_s` after the device starts it: a stand-in
  for an asynchronously dispatched jitted step on one in-order device queue."""
  device_free_at = 0.0

  def __init__(self, value, busy_s):
    start = max(time.perf_counter(), _Pending.device_free_at)
    self.ready_at = _Pending.device_free_at = start + busy_s
    self.value = value

  def __float__(self):
    time.sleep(max(0.0, self.ready_at - time.perf_counter()))
    return float(self.value)


def _step(host_s, device_s, log):
  def step(state, batch):
    time.sleep(host_s)  # the host's dispatch work, before the device can start the step
    log.append(("dispatch", batch))
    return state + 1, {"loss": _Pending(batch, device_s)}
  return step


@pytest.mark.parametrize("timing", ["pipelined", "blocked"])
def test_timed_steps_reads_every_loss_in_order_and_times_all_but_the_warmup(timing):
  _Pending.device_free_at = 0.0
  log = []
  state, losses, times = bench.timed_steps(_step(0.0, 0.001, log), 0, list(range(7)), timing)
  assert state == 7 and losses == [float(i) for i in range(7)]
  assert len(times) == 7 - bench.WARMUP_STEPS
  assert [b for _, b in log] == list(range(7))


def test_pipelined_hides_the_dispatch_that_blocked_timing_counts():
  # host 30 ms of dispatch per step, device 60 ms: queued ahead, a step costs the device's
  # 60 ms; waited for one by one, it costs both (90 ms).
  _Pending.device_free_at = 0.0
  _, _, piped = bench.timed_steps(_step(0.03, 0.06, []), 0, list(range(8)), "pipelined")
  _Pending.device_free_at = 0.0
  _, _, blocked = bench.timed_steps(_step(0.03, 0.06, []), 0, list(range(8)), "blocked")
  median = lambda t: sorted(t)[len(t) // 2]
  assert median(piped) == pytest.approx(0.06, abs=0.012)
  assert median(blocked) == pytest.approx(0.09, abs=0.012)


def test_a_label_splits_into_recipe_overrides_xla_flags_and_environment():
  label = "infir2~INFIR2_KERNEL_QUANTIZE=full~precision.fused_qkv=False~--xla_gpu_foo=1"
  assert bench.split_label(label) == ("infir2", ["precision.fused_qkv=False"])
  assert bench.xla_flags_of(label) == ["--xla_gpu_foo=1"]
  assert bench.env_of(label) == {"INFIR2_KERNEL_QUANTIZE": "full"}
  assert bench.env_of("infir2~model.remat=none") == {}


def test_unknown_timing_is_refused():
  with pytest.raises(ValueError, match="pipelined or blocked"):
    bench.timed_steps(lambda s, b: (s, {"loss": 0.0}), 0, [0], "async")


def test_idle_gaps_measures_the_time_no_kernel_runs():
  kernels = [(0, 100, "gemm", "a"), (105, 200, "other", "b"),   # 5 us gap
             (150, 180, "other", "side"),                         # inside b: no gap
             (700, 800, "attention", "c"),                        # 500 us gap after b
             (800, 2900, "gemm", "d"), (4400, 4500, "other", "e")]  # 1500 us gap after d
  idle = idle_gaps(kernels)
  assert idle["span_ms"] == pytest.approx(4.5)
  assert idle["idle_ms"] == pytest.approx((5 + 500 + 1500) / 1e3)
  assert idle["kernels"] == 6 and idle["gaps_over_threshold"] == 2
  assert idle["gaps_by_size"]["2-10us"] == {"count": 1, "ms": pytest.approx(0.005)}
  assert idle["gaps_by_size"]["0.1-1ms"]["count"] == 1
  assert idle["gaps_by_size"][">=1ms"] == {"count": 1, "ms": pytest.approx(1.5)}
  assert idle["largest_gaps"][0] == {"us": 1500, "after": "d", "before": "e"}
  assert idle["largest_gaps"][1]["after"] == "b"   # the kernel that ended last, not "side"
  assert idle_gaps([]) == {}


LIVE_RANGE = """HloLiveRange (max 30):
  Live ranges at 12 (peak):
    loop_multiply_fusion.6{}: 400 bytes (cumulative: 400 bytes)
  Stack trace breakdown for peak usage: 1 000 bytes
    main.841 (100.0%, total: 1 000 bytes, current: 0 bytes, remaining: 1 000 bytes)
      ├── state (30.0%, total: 300 bytes, current: 0 bytes, remaining: 1 000 bytes)
      │   ├── params (30.0%, total: 300 bytes, current: 0 bytes, remaining: 1 000 bytes)
      │   │   └── embedding (30.0%, total: 300 bytes, current: 300 bytes, remaining: 700 bytes)
      ├── jit(train_step)/jvp(Qwen2)/Qwen2._scanned_layers/stack (20.0%, total: 200 bytes, current: 200 bytes, remaining: 500 bytes)
      ├── jit(train_step)/transpose(jvp())/mul (25.0%, total: 250 bytes, current: 250 bytes, remaining: 250 bytes)
      ├── state['opt_state'][1][0].mu['lm_head']['kernel'] (10.0%, total: 100 bytes, current: 100 bytes, remaining: 150 bytes)
      ├── state['opt_state'][1][0].nu['lm_head']['kernel'] (10.0%, total: 100 bytes, current: 100 bytes, remaining: 50 bytes)
      ├── jit(train_step)/jvp(Qwen2)/Qwen2._scanned_layers/while{2} (5.0%, total: 50 bytes, current: 50 bytes, remaining: 0 bytes)
      └── jit(train_step)/convert_element_type (0.0%, total: 0 bytes, current: 0 bytes, remaining: 0 bytes)
"""


def test_peak_buffers_groups_the_peak_by_owner():
  import peak_buffers  # benchmarks/
  peak = peak_buffers.parse_live_range(LIVE_RANGE)
  assert peak["peak_instruction"] == 12 and peak["peak_bytes"] == 1000
  assert peak["by_owner"] == {
      "master weights (float32)": 300, "loss: float32 logits and their gradient": 250,
      "the scan's stacked weights (bf16 copy of every layer's)": 200, "Adam moments": 200,
      "the scan's saved layer inputs (remat residuals)": 50,
      "the params' bf16 copies the step differentiates (bf16 gradients)": 0}
  assert sum(peak["by_owner"].values()) == peak["peak_bytes"]   # top-level entries only
  with pytest.raises(ValueError, match="Stack trace breakdown"):
    peak_buffers.parse_live_range("HloLiveRange (max 3):\n")


MEMORY_REPORT = """\
Memory Space: default (color=0)
Total bytes: 136769757522 (127.38GiB)
  cumulative_size;       size;       offset; used_by_n_values; shapes_list
  ------------------------------------------------------------
   32.38GiB( 29%);   32.38GiB;            0;              173; f32[152064,3584], 5×bf16[28,16384,37888]
   40.47GiB( 37%);    8.09GiB;  34762391552;                5; 5×f8e4m3fn[28,18944,16384]
   90.04GiB( 81%);  784.00MiB;  82069946368;                5; 5×f32[28,64,28,4096]
"""


def test_peak_buffers_reads_the_allocations_slices():
  import peak_buffers  # benchmarks/
  report = peak_buffers.parse_memory_usage(MEMORY_REPORT)
  assert report["total_bytes"] == 136769757522
  assert report["slices"] == [(32.38, "f32[152064,3584], 5×bf16[28,16384,37888]"),
                              (8.09, "5×f8e4m3fn[28,18944,16384]"),
                              (784.0 / 1024, "5×f32[28,64,28,4096]")]
  with pytest.raises(ValueError, match="Total bytes"):
    peak_buffers.parse_memory_usage("Memory Space: default\n")


OPTIMIZED_HLO = """\
%fused_add (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %a = f32[4]{0} add(%p, %p)
}

%region_0.1 (a.1: bf16[], b.1: bf16[]) -> bf16[] {
  ROOT %add.1 = bf16[] add(%a.1, %b.1)
}

%region_1.2 (a.2: f32[], b.2: f32[]) -> f32[] {
  ROOT %add.2 = f32[] add(%a.2, %b.2)
}

%fused_reduce (p.1: bf16[16,4]) -> bf16[4] {
  %p.1 = bf16[16,4]{1,0} parameter(0)
  %c.1 = bf16[] constant(0)
  ROOT %reduce.1 = bf16[4]{0} reduce(%p.1, %c.1), dimensions={0}, to_apply=%region_0.1
}

%fused_reduce.2 (p.2: f32[16,4]) -> f32[4] {
  %p.2 = f32[16,4]{1,0} parameter(0)
  %c.2 = f32[] constant(0)
  ROOT %reduce.2 = f32[4]{0} reduce(%p.2, %c.2), dimensions={0}, to_apply=%region_1.2
}

ENTRY %main.1 (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %loop_add_fusion.1 = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_add, metadata={op_name="jit(train_step)/jvp(Qwen2)/layers_0/add"}
  %loop_add_fusion.2 = f32[4]{0} fusion(%loop_add_fusion.1), kind=kLoop, calls=%fused_add, metadata={op_name="jit(train_step)/transpose(jvp(Qwen2))/jvp(Qwen2)/checkpoint/rematted_computation/layers_0/add"}
  %copy.3 = f32[4]{0} copy(%loop_add_fusion.2)
  %loop_adam_fusion.7 = (f32[4]{0}, f32[4]{0}) fusion(%x), kind=kLoop, calls=%fused_add
  %custom-call.4 = f32[4]{0} custom-call(%copy.3), custom_call_target="mosaic_gpu_v2", metadata={op_name="rematted_computation/kernel"}
  %bitcast.5 = f32[4]{0} bitcast(%custom-call.4)
  ROOT %loop_add_fusion.6 = f32[4]{0} fusion(%bitcast.5), kind=kLoop, calls=%fused_add
}
"""


def test_peak_buffers_counts_the_kernels_and_the_recomputed_fusions():
  import peak_buffers  # benchmarks/
  assert peak_buffers.count_kernels(OPTIMIZED_HLO) == {
      "kernels": 6, "recomputed_fusions": 1, "bf16_reductions": 1,
      # three fusions and a copy of f32[4] -> f32[4], a fusion f32[4] -> 2 x f32[4]
      "xla_kernel_bytes": 4 * 2 * 16 + 3 * 16}


def test_peak_buffers_names_unrolled_layers_activations():
  import peak_buffers
  assert peak_buffers.owner(
      "jit(train_step)/jvp(Qwen2)/layers_12/mlp/fp8_fprop/jit(wrapper)/x").startswith(
          "the layers' saved activations")
  assert peak_buffers.owner("jit(train_step)/jvp(Qwen2)/norm/rsqrt") == (
      "forward: other activations and temporaries")
