"""The Pallas kernels' own code (Mosaic GPU interpreter, CPU) trains a model exactly as the
XLA path of the same recipe: every GEMM and quantization of the forward and backward passes
goes through kernels.block_scaled_matmul / quantize_tiles / quantize_blocks and the MLP's
fused swiglu_quantize / swiglu_bwd_quantize.

It runs in a child process with one CPU device: the interpreter keeps per-device state that
the 8 fake devices of conftest.py would share."""

import collections
import functools
import json
import os
import subprocess
import sys
import tempfile
import types

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _interpreted_kernels(kernels, calls):
  """A stand-in kernels module: the real kernels, run by the interpreter, and counted."""
  def counted(name, fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
      calls[name] += 1
      return fn(*args, interpret=True, **kwargs)
    return run
  module = types.ModuleType("infir2_jax.precision.kernels")
  module.available = lambda: True  # as on a Hopper GPU
  module.supports = kernels.supports
  module.block_scaled_matmul = counted("gemm", kernels.block_scaled_matmul)
  module.quantize_tiles = counted("quantize_tiles", kernels.quantize_tiles)
  module.quantize_blocks = counted("quantize_blocks", kernels.quantize_blocks)
  module.swiglu_quantize = counted("swiglu_quantize", kernels.swiglu_quantize)
  module.swiglu_bwd_quantize = counted("swiglu_bwd_quantize", kernels.swiglu_bwd_quantize)
  return module


def _train_both(workdir) -> dict:
  """Trains the same tiny model on both backends; returns their losses and the kernel calls."""
  from infir2_jax.precision import kernels
  from infir2_jax.train.trainer import train
  from test_trainer import tiny_config, train_losses
  # K = 256 and 384: two and three scale blocks per GEMM, so promotion across blocks runs.
  # remat none: the interpreter's callbacks cannot be rematerialized.
  overrides = {"steps": 4, "batch_size": 2, "seq_len": 128, "model.num_layers": 1,
               "model.hidden_size": 256, "model.intermediate_size": 384,
               "model.num_heads": 2, "model.num_kv_heads": 1, "model.remat": "none",
               "eval.every_steps": 0, "checkpoint.every_steps": 0, "mesh.data": 1,
               "precision.recipe": "infir2", "precision.fused_mlp_backward": True,
               "log.tensorboard": False}
  calls = collections.Counter()
  # precision/gemm.py imports the kernels as `from infir2_jax.precision import kernels` at
  # call time, which reads the package's attribute first: swap both it and sys.modules.
  precision = sys.modules["infir2_jax.precision"]
  stand_in = _interpreted_kernels(kernels, calls)
  sys.modules["infir2_jax.precision.kernels"] = precision.kernels = stand_in
  try:
    train(tiny_config(**overrides, **{"precision.backend": "pallas"}),
          os.path.join(workdir, "pallas"))
  finally:
    sys.modules["infir2_jax.precision.kernels"] = precision.kernels = kernels
  train(tiny_config(**overrides, **{"precision.backend": "xla"}), os.path.join(workdir, "xla"))
  return {"calls": dict(calls), "pallas": train_losses(os.path.join(workdir, "pallas")),
          "xla": train_losses(os.path.join(workdir, "xla"))}


@pytest.mark.slow
def test_interpreted_kernels_train_like_the_xla_path(tmp_path):
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1",
             PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
  proc = subprocess.run([sys.executable, __file__, str(tmp_path)], capture_output=True,
                        text=True, timeout=600, env=env)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  result = json.loads(proc.stdout.splitlines()[-1])
  calls = result["calls"]
  # the fused q|k|v, o and the fused MLP's two: 4 fprop + 4 dgrad + 4 wgrad GEMMs per
  # traced step.
  assert calls["gemm"] >= 12 and calls["quantize_tiles"] > 0 and calls["quantize_blocks"] > 0
  assert calls["swiglu_quantize"] > 0 and calls["swiglu_bwd_quantize"] > 0, calls
  pallas, xla = result["pallas"], result["xla"]
  assert sorted(pallas) == ["1", "2", "3", "4"]
  # The learning rate warms up from 0 at step 1: steps 3 and 4 start from weights updated
  # with the kernels' dgrad and wgrad. Same quantization bit for bit, so the two paths differ
  # only in the order of f32 additions (split-K partial sums): ~1e-5 relative by step 3.
  for step in ("1", "2", "3", "4"):
    assert pallas[step] == pytest.approx(xla[step], rel=1e-4, abs=0), (step, pallas, xla)
  assert xla["1"] - xla["4"] > 0.1


if __name__ == "__main__":
  import logging
  logging.disable(logging.WARNING)
  print(json.dumps(_train_both(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp())))
