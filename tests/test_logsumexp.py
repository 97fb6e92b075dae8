"""train/loss.py's log-sum-exp (one pass on CUDA GPUs, two elsewhere) against float64 NumPy,
special values and its derivative (softmax)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infir2_jax.train import loss


@pytest.fixture(params=["one_pass", "two_pass", "auto"])
def form(request, monkeypatch):
  monkeypatch.setattr(loss, "LOGSUMEXP", request.param)
  return request.param


def _logits(rows=48, vocab=3001, seed=0):
  rng = np.random.default_rng(seed)
  x = (rng.standard_normal((rows, vocab)) * 6).astype(np.float32)
  x[1, :-1] = -30.0                   # one dominant logit at the end of the row (the max late)
  x[2] = np.linspace(-50, 60, vocab)   # an ascending row: the running max moves every element
  x[3] += 80.0                         # exp(x) alone would overflow float32
  return x


def test_float64_logsumexp_to_float32_rounding(form):
  x = _logits()
  ref = np.log(np.sum(np.exp(x.astype(np.float64) - 100), axis=-1)) + 100
  got = np.asarray(jax.jit(loss.logsumexp)(jnp.asarray(x)), np.float64)
  assert np.all(np.abs(got - ref) <= 4 * np.spacing(np.abs(ref).astype(np.float32))), (
      np.abs(got - ref).max())
  two = np.asarray(jax.nn.logsumexp(jnp.asarray(x), axis=-1), np.float64)
  assert np.abs(got - ref).max() <= 2 * np.abs(two - ref).max() + 1e-6, form


def test_special_rows_as_jax_nn_logsumexp(form):
  x = np.zeros((5, 8), np.float32)
  x[0] = -np.inf                    # all -inf: -inf, no NaN from -inf - -inf
  x[1, :4] = -np.inf                # some -inf: those add nothing
  x[2, 3] = np.nan                  # NaN propagates
  x[3, 5] = np.inf                  # +inf: +inf
  got = np.asarray(loss.logsumexp(jnp.asarray(x)))
  want = np.asarray(jax.nn.logsumexp(jnp.asarray(x), axis=-1))
  np.testing.assert_allclose(got, want, rtol=1e-6)
  assert got[0] == -np.inf and np.isnan(got[2]) and got[3] == np.inf
  np.testing.assert_allclose(got[1], np.log(4.0), rtol=1e-6)


def test_derivative_is_the_softmax(form):
  x = jnp.asarray(_logits(rows=6, vocab=257))
  g = jax.grad(lambda z: jnp.sum(loss.logsumexp(z) * jnp.arange(1.0, 7.0)))(x)
  lse = loss.logsumexp(x)
  want = jnp.exp(x - lse[:, None]) * jnp.arange(1.0, 7.0)[:, None]
  np.testing.assert_array_equal(np.asarray(g), np.asarray(want))
  ref = np.exp(np.asarray(x, np.float64) - np.asarray(x, np.float64).max(-1, keepdims=True))
  ref = ref / ref.sum(-1, keepdims=True) * np.arange(1.0, 7.0)[:, None]
  np.testing.assert_allclose(np.asarray(g), ref, rtol=1e-5, atol=1e-30)


def test_forms(monkeypatch):
  """two_pass is jax.nn.logsumexp; auto is it on the CPU and one_pass in a CUDA lowering
  (one variadic reduce: one read of the logits)."""
  x = jnp.asarray(_logits(rows=4, vocab=64))
  monkeypatch.setattr(loss, "LOGSUMEXP", "two_pass")
  np.testing.assert_array_equal(np.asarray(loss.logsumexp(x)),
                                np.asarray(jax.nn.logsumexp(x, axis=-1)))
  monkeypatch.setattr(loss, "LOGSUMEXP", "auto")
  np.testing.assert_array_equal(np.asarray(jax.jit(loss.logsumexp)(x)),
                                np.asarray(jax.nn.logsumexp(x, axis=-1)))
  cuda = jax.jit(loss.logsumexp).trace(x).lower(lowering_platforms=("cuda",)).as_text()
  cpu = jax.jit(loss.logsumexp).lower(x).as_text()
  reduces = lambda text: text.count("stablehlo.reduce")
  assert reduces(cuda) == 1 and reduces(cpu) == 2, (reduces(cuda), reduces(cpu))
  monkeypatch.setattr(loss, "LOGSUMEXP", "fast")
  with pytest.raises(ValueError, match="INFIR2_LOGSUMEXP='fast': one of"):
    loss.logsumexp(x)
