"""opt.moments=fp8's Triton kernel on the GPU (train/fp8_adam.py) against the reference path.

On the CPU the kernel (interpreted) is bit-identical to the reference (tests/test_fp8_adam.py).
On the GPU it uses the approximate log2/exp2/division/square root (fp8_adam.FAST_PTX), so
the bits differ; this bounds by how much: a stored FP8 moment may round to a neighbouring
code where the float32 value sits at a rounding boundary, never further, and its group's
scale and exponent, and Adam's direction, stay within float32 rounding of the reference's.

Run on the device machine: PYTHONPATH=. python3 -m pytest -m gpu tests/test_fp8_adam_gpu.py
"""
import jax
import numpy as np
import pytest

from infir2_jax.train import fp8_adam
from tests.test_fp8_adam import B1, B2, EPS, real_like_gradients, run_steps

pytestmark = pytest.mark.gpu

SHAPES = {"w": (1536, 8960), "k": (1536, 256), "bias": (1536,), "norm": (77,)}


def ordered_codes(q):
  """float8 bytes -> integers in the order of their values (sign-magnitude unfolded)."""
  b = np.asarray(q).view(np.int8).astype(np.int32)
  return np.where(b < 0, -128 - b, b)


@pytest.mark.parametrize("fast_math", [True, False])
def test_triton_update_is_the_reference_up_to_float32_rounding(monkeypatch, fast_math):
  monkeypatch.setattr(fp8_adam, "FAST_MATH", fast_math)
  rng = np.random.default_rng(0)
  params = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
  grads = [{k: real_like_gradients(s, rng) for k, s in SHAPES.items()} for _ in range(3)]
  want = jax.device_get(run_steps("reference", params, grads))
  got = jax.device_get(run_steps("pallas", params, grads))
  flipped = total = 0
  for (g_dir, g_state), (w_dir, w_state) in zip(got, want):
    for part in (0, 1, 2):   # q, a, k of both moments
      for g_leaf, w_leaf in zip(jax.tree.leaves((g_state.mu[part], g_state.nu[part])),
                                jax.tree.leaves((w_state.mu[part], w_state.nu[part]))):
        if part == 0:
          step = np.abs(ordered_codes(g_leaf) - ordered_codes(w_leaf))
          assert step.max() <= 1, step.max()
          flipped, total = flipped + int(np.count_nonzero(step)), total + step.size
        else:
          np.testing.assert_allclose(g_leaf, w_leaf, rtol=1e-5, atol=0)
    for g_leaf, w_leaf in zip(jax.tree.leaves(g_dir), jax.tree.leaves(w_dir)):
      rel = np.abs(g_leaf - w_leaf) / np.maximum(np.abs(w_leaf), 1e-30)
      # A neighbouring FP8 code moves that element's decoded moment by one step of the
      # format; everywhere else the direction is the reference's to float32 rounding.
      assert np.quantile(rel, 0.99) < 1e-4, np.quantile(rel, 0.99)
      assert rel.max() < 0.5, rel.max()
  assert flipped / total < 0.01, (flipped, total)
