"""infir2_jax.bench.tools.GpuTelemetry with a stand-in nvidia-smi (no GPU here)."""

import os
import stat
import time

import pytest

from infir2_jax.bench.tools import GpuTelemetry


def test_parse_skips_unreadable_lines():
  text = "1980, 650.5, 61\n[N/A], 100, 40\n1755, 699.9, 70\n1830, 6"  # last line cut off
  summary = GpuTelemetry.parse(text)
  assert summary["samples"] == 2
  assert summary["sm_mhz_median"] == pytest.approx((1980 + 1755) / 2)
  assert summary["sm_mhz_min"] == 1755 and summary["power_w_max"] == pytest.approx(699.9)
  assert summary["temp_c_max"] == 70
  assert GpuTelemetry.parse("")["error"] == "no samples"


def test_samples_a_running_block(tmp_path):
  fake = tmp_path / "nvidia-smi"
  args_file = tmp_path / "args"
  fake.write_text("#!/bin/sh\n"
                  f'echo "$@" > {args_file}\n'
                  "while true; do echo '1410, 500.0, 55'; sleep 0.02; done\n")
  fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
  with GpuTelemetry(interval_ms=20, executable=str(fake)) as telemetry:
    time.sleep(0.5)
  assert telemetry.summary["samples"] >= 3, telemetry.summary
  assert telemetry.summary["sm_mhz_median"] == 1410
  assert telemetry.summary["power_w_median"] == 500
  assert "--query-gpu=clocks.sm,power.draw,temperature.gpu" in args_file.read_text()


def test_missing_nvidia_smi_is_reported_not_raised(tmp_path):
  with GpuTelemetry(executable=os.fspath(tmp_path / "absent")) as telemetry:
    pass
  assert "not available" in telemetry.summary["error"]


@pytest.mark.parametrize("visible,expected", [(None, "-i=0"), ("1", "-i=1"), ("3,2", "-i=3")])
def test_samples_the_gpu_the_process_computes_on(tmp_path, monkeypatch, visible, expected):
  """nvidia-smi ignores CUDA_VISIBLE_DEVICES: a run pinned to GPU 1 must ask for GPU 1."""
  if visible is None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
  else:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
  fake = tmp_path / "nvidia-smi"
  args_file = tmp_path / "args"
  fake.write_text(f'#!/bin/sh\necho "$@" > {args_file}\necho "1410, 500.0, 55"\n')
  fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
  with GpuTelemetry(interval_ms=20, executable=str(fake)):
    time.sleep(0.2)
  assert expected in args_file.read_text().split()


def test_source_digest_names_the_code_not_the_git_metadata(tmp_path):
  """The digest of a copy of the sources equals the repository's, moves when one source
  byte changes (and back when it is restored), ignores what is not Python source, and
  run_info carries it."""
  import shutil
  from infir2_jax.bench import tools
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  for top in tools.SOURCE_DIRS:
    shutil.copytree(os.path.join(root, top), tmp_path / top,
                    ignore=shutil.ignore_patterns("__pycache__", "*.json", "*.log", "*.png"))
  here = tools.source_digest(root)
  assert tools.source_digest(str(tmp_path)) == here and len(here) == 16
  (tmp_path / "benchmarks" / "notes.txt").write_text("not source")
  assert tools.source_digest(str(tmp_path)) == here
  target = tmp_path / "infir2_jax" / "precision" / "formats.py"
  original = target.read_bytes()
  target.write_bytes(original + b"\n")
  assert tools.source_digest(str(tmp_path)) != here
  target.write_bytes(original)
  assert tools.source_digest(str(tmp_path)) == here
  assert tools.run_info(["x"], with_device=False)["source_digest"] == here
