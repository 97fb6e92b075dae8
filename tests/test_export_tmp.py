"""No temporary folder outlives a killed export (issue 36, item 8): SIGTERM and SIGINT
remove OUT.tmp-PID at once; what a SIGKILLed export left is cleared by the next export, or
the next export is refused while the export that writes it still runs."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from infir2_jax.hf import save as hf_save

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# An export that writes part of its folder and then waits (as a long shard write does).
# SIGINT as an interactive shell leaves it (a suite started in the background, `cmd &`,
# hands its children SIGINT ignored, and then Python raises no KeyboardInterrupt).
SLOW_EXPORT = textwrap.dedent("""
    import signal, sys, time
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from infir2_jax.hf.save import atomic_dir
    with atomic_dir(sys.argv[1], overwrite=True) as tmp:
      open(tmp + "/model-00001.safetensors", "wb").write(b"x" * 1000)
      print("writing", flush=True)
      time.sleep(120)
""")


def _start_slow_export(out):
  proc = subprocess.Popen([sys.executable, "-c", SLOW_EXPORT, out], cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.stdout.readline().strip() == "writing", proc.stderr.read()
  return proc


def _siblings(out):
  parent, name = os.path.split(out)
  return sorted(e for e in os.listdir(parent) if e.startswith(name + "."))


def _dead_pid():
  proc = subprocess.Popen([sys.executable, "-c", "pass"])
  proc.wait()
  return proc.pid


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, -signal.SIGINT)])
def test_a_signalled_export_removes_its_folder_and_keeps_the_old_export(tmp_path, signum, code):
  out = str(tmp_path / "hf")
  os.makedirs(out)
  open(os.path.join(out, "config.json"), "w").write("{}")   # an earlier export
  proc = _start_slow_export(out)
  assert _siblings(out) == [f"hf.tmp-{proc.pid}"]
  proc.send_signal(signum)
  assert proc.wait(timeout=60) == code, proc.stderr.read()
  assert _siblings(out) == [] and os.listdir(out) == ["config.json"]


def test_the_next_export_clears_what_a_sigkilled_one_left(tmp_path):
  out = str(tmp_path / "hf")
  proc = _start_slow_export(out)
  proc.kill()
  proc.wait()
  assert _siblings(out) == [f"hf.tmp-{proc.pid}"]   # SIGKILL cannot clean up
  with hf_save.atomic_dir(out) as tmp:
    open(os.path.join(tmp, "config.json"), "w").write("{}")
  assert _siblings(out) == [] and os.listdir(out) == ["config.json"]


def test_an_export_killed_between_its_renames_gets_the_old_one_back(tmp_path):
  out = str(tmp_path / "hf")
  old = f"{out}.old-{_dead_pid()}"
  os.makedirs(old)
  open(os.path.join(old, "config.json"), "w").write('{"old": 1}')
  assert hf_save.clear_stale(out)
  assert open(os.path.join(out, "config.json")).read() == '{"old": 1}' and not _siblings(out)


def test_an_export_writing_now_is_not_disturbed(tmp_path):
  out = str(tmp_path / "hf")
  proc = _start_slow_export(out)
  try:
    with pytest.raises(FileExistsError, match=rf"another export \(pid {proc.pid}\) is writing"):
      with hf_save.atomic_dir(out, overwrite=True):
        pass
    assert _siblings(out) == [f"hf.tmp-{proc.pid}"]
  finally:
    proc.kill()
    proc.wait()
