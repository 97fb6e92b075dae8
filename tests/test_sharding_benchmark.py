"""benchmarks/sharding_gpu.py's CPU rehearsal (--tiny): its train and AOT paths run end to end."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_tiny_cpu_rehearsal_writes_train_and_aot_results(tmp_path):
  """One child process per run, as on the GPUs; tiny widths on 8 fake CPU devices."""
  out = tmp_path / "sharding.json"
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "benchmarks", "sharding_gpu.py"), "all", "--tiny",
       "--children", "--recipes=bf16", "--meshes=1x2x1", "--steps=2", f"--out={out}"],
      capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "step ms" in proc.stdout and "fits 141 GB: True" in proc.stdout
  results = json.loads(out.read_text())["results"]
  train, aot = results
  assert train["kind"] == "train" and train["mesh"] == {"data": 1, "fsdp": 2, "tensor": 1}
  assert train["devices"] == 2 and len(train["step_times_s"]) == 2
  assert train["median_step_s"] > 0 and all(l > 0 for l in train["losses"])
  assert train["memory_analysis"]["total_bytes"] > 0 and train["fp8_alignment_problems"] == []
  assert aot["kind"] == "aot" and aot["devices"] == 8
  assert aot["fits_141GB"] and aot["fits_allocator_pool"]
  assert aot["mesh"] == {"data": 1, "fsdp": 2, "tensor": 4}
  assert aot["memory_analysis"]["argument_size_in_bytes"] > 0
