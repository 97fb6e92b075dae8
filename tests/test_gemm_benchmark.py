"""benchmarks/gemm.py's config plumbing (the GPU timings themselves run on the H200 only)."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import gemm as bench  # noqa: E402  (benchmarks/gemm.py)
from infir2_jax.precision.kernels import tuning  # noqa: E402


def test_variants_override_the_default_of_each_shape_and_kind():
  cross = bench.parse_variant("cross_tile=False;epi_n=64")
  assert cross == {"cross_tile": False, "epi_n": 64}
  # Overrides apply to what the library would pick for that shape and B-scale kind.
  wgrad = bench.config_for(cross, 1536, 8960, 16384, "row")
  assert (wgrad.tile_n, wgrad.cross_tile, wgrad.epi_n) == (192, False, 64)
  dgrad = bench.config_for(cross, 16384, 1536, 18944, "block")
  assert (dgrad.tile_n, dgrad.cross_tile) == (128, False)
  assert bench.applies(cross, "7b.gate_proj.wgrad") and bench.applies(None, "square8192")


def test_label_restricted_variant():
  only = bench.parse_variant("k_proj.wgrad@split_k=4")
  assert only == {"only": "k_proj.wgrad", "split_k": 4}
  assert bench.applies(only, "1p5b.k_proj.wgrad")
  assert not bench.applies(only, "1p5b.k_proj.dgrad")
  assert bench.config_for(only, 1536, 256, 16384, "row").split_k == 4
  assert bench.config_label(only) == "default+only=k_proj.wgrad;split_k=4"


def test_unknown_variant_field_is_named():
  with pytest.raises(ValueError, match="not a TuningConfig field"):
    bench.parse_variant("tile_k=64")


def test_library_default_wgrad_rule_on_the_benchmarked_shapes():
  """The tile widths gemm.py's 'None' column ran in session 8 (gemm_h200_s8_7b_cublas.json)."""
  shapes = {s[0]: s for s in bench.gemm_shapes("7b")}
  widths = {label: tuning.default_config(m, n, k, b_scale=kind).tile_n
            for label, (_, m, n, k, kind, _names) in shapes.items()}
  assert widths["7b.gate_proj.wgrad"] == 192 and widths["7b.down_proj.wgrad"] == 192
  assert widths["7b.q_proj.wgrad"] == 128 and widths["7b.k_proj.wgrad"] == 128
  assert all(w == 128 for label, w in widths.items() if not label.endswith("wgrad"))


def test_short_k_default_stages_the_output_in_one_chunk():
  """K <= 512: one 128-wide epilogue store per warpgroup (measured faster on K=256 dgrad),
  which still leaves shared memory for a pipeline as deep as the K blocks."""
  shapes = {s[0]: s for s in bench.gemm_shapes("1p5b") + bench.gemm_shapes("7b")}
  for label, (_, m, n, k, kind, _names) in shapes.items():
    cfg = tuning.default_config(m, n, k, b_scale=kind)
    assert (cfg.epi_n == 128) == (k <= 512), (label, cfg)
  fitted = tuning.fit_stages(tuning.default_config(16384, 1536, 256), "bfloat16")
  assert fitted.epi_n == 128 and fitted.max_concurrent_steps >= 4
