"""`pip install -e .` gives a package that declares its dependencies and runs from anywhere."""

import os
import re
import subprocess
import sys
import sysconfig

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def requirement_lines(path):
  out = []
  for line in open(path):
    line = line.split("#", 1)[0].strip()
    if line and not line.startswith("-"):
      out.append(line)
  return out


@pytest.mark.slow
def test_editable_install_declares_requirements_and_trains_outside_the_repo(tmp_path):
  venv = tmp_path / "venv"
  subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
  python = str(venv / "bin" / "python")
  site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                        capture_output=True, text=True, check=True).stdout.strip()
  # The dependencies themselves come from this interpreter's environment (no network here).
  with open(os.path.join(site, "deps_of_the_test_env.pth"), "w") as f:
    f.write(sysconfig.get_paths()["purelib"] + "\n")
  install = subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps",
                            "--no-build-isolation", "-e", ROOT], capture_output=True, text=True,
                           timeout=600)
  assert install.returncode == 0, install.stderr[-3000:]
  elsewhere = tmp_path / "elsewhere"
  elsewhere.mkdir()
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
  env.update(XLA_FLAGS="", INFIR2_COMPILATION_CACHE="")
  meta = subprocess.run(
      [python, "-c", "import importlib.metadata as m, infir2_jax; print(infir2_jax.__file__); "
       "print('\\n'.join(m.requires('infir2_jax') or []))"],
      cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120)
  assert meta.returncode == 0, meta.stderr
  where, *requires = meta.stdout.splitlines()
  assert where == os.path.join(ROOT, "infir2_jax", "__init__.py")
  assert requires == requirement_lines(os.path.join(ROOT, "requirements.txt"))
  run = subprocess.run(
      [python, "-m", "infir2_jax.train", "--config.steps=2", "--config.batch_size=2",
       "--config.seq_len=32", "--config.eval.every_steps=0", "--config.log.tensorboard=False"],
      cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, run.stderr[-3000:]
  assert re.search(r"done: steps 1-2 in", run.stdout)
  assert (elsewhere / "runs" / "default" / "checkpoints" / "2").is_dir()
