"""The embedding lookup's gradient (model/layers.embed_lookup): repeated tokens' rows are
summed in float32 and rounded once, against a float64 NumPy sum."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from infir2_jax.model import layers


def _skewed_problem(vocab=40, d=16, n=4096, seed=0):
  """bf16 table and cotangent rows; token 3 is ~80% of the tokens, as frequent tokens
  ("the", ",") are of text, so its gradient is a sum of ~3,300 rows. The rows are
  multiples of 1/64 below 4 (8 significant bits: bf16), so every float32 sum of them is
  exact in any order (|sum| < 2**14, 20 bits)."""
  rng = np.random.default_rng(seed)
  table = jnp.asarray(rng.standard_normal((vocab, d)), jnp.bfloat16)
  tokens = np.where(rng.random(n) < 0.8, 3, rng.integers(0, vocab, n)).astype(np.int32)
  g = (rng.integers(-255, 256, (n, d)) / 64).astype(ml_dtypes.bfloat16)
  return table, tokens, g


def _table_gradient(lookup, table, tokens, g):
  g32 = jnp.asarray(g, jnp.float32)
  loss = lambda t: jnp.sum(lookup(t, jnp.asarray(tokens)).astype(jnp.float32) * g32)
  return np.asarray(jax.jit(jax.grad(loss))(table))


def _float64_sums(vocab, tokens, g):
  ref = np.zeros((vocab, g.shape[-1]))
  np.add.at(ref, tokens, g.astype(np.float64))
  return ref


@pytest.mark.parametrize("form", ["f32", "f32_table"])
def test_repeated_tokens_sum_in_float32_and_round_once(form, monkeypatch):
  monkeypatch.setattr(layers, "EMBED_GRAD", form)
  table, tokens, g = _skewed_problem()
  ref = _float64_sums(table.shape[0], tokens, g)
  got = _table_gradient(layers.embed_lookup, table, tokens, g)
  assert got.dtype == ml_dtypes.bfloat16
  # exact float32 sums rounded once: the float64 sums rounded to bf16, bit for bit
  np.testing.assert_array_equal(got, ref.astype(ml_dtypes.bfloat16))
  # jnp.take's own transpose adds the rows in bf16: the frequent token's sums drift by far
  # more than a rounding (the test can fail)
  autodiff = _table_gradient(lambda t, i: jnp.take(t, i, axis=0), table, tokens, g)
  err = lambda x: np.abs(x.astype(np.float64) - ref)[3].max()
  half_ulp = np.abs(ref[3]).max() * 2.0**-8
  assert err(got) <= half_ulp < err(autodiff) / 4, (err(got), err(autodiff))


@pytest.mark.parametrize("form", ["f32", "f32_table"])
def test_indices_as_take_reads_them(form, monkeypatch):
  """Negative indices count from the end; out-of-range ones (NaN rows forward, jnp.take's
  fill) add nothing, as in jnp.take's transpose."""
  monkeypatch.setattr(layers, "EMBED_GRAD", form)
  table, _, _ = _skewed_problem(vocab=8, d=4)
  tokens = np.array([0, -1, 7, 9, -20, 2, 2], np.int32)
  g = np.arange(1, 1 + 7 * 4, dtype=np.float32).reshape(7, 4).astype(ml_dtypes.bfloat16)
  got = _table_gradient(layers.embed_lookup, table, tokens, g)
  want = _table_gradient(lambda t, i: jnp.take(t, i, axis=0), table, tokens, g)
  np.testing.assert_array_equal(got, want)   # small exact sums: the same either way
  ref = np.zeros((8, 4))
  for row, tok in zip(g.astype(np.float64), tokens):
    if -8 <= tok < 8:
      ref[tok] += row
  np.testing.assert_array_equal(got.astype(np.float64), ref)
  forward = np.asarray(layers.embed_lookup(table, jnp.asarray(tokens)), np.float64)
  np.testing.assert_array_equal(forward[:3], np.asarray(table, np.float64)[[0, 7, 7]])
  assert np.isnan(forward[3]).all() and np.isnan(forward[4]).all()


def test_float32_tables_and_the_autodiff_switch_use_jnp_take(monkeypatch):
  table, tokens, _ = _skewed_problem(vocab=8, d=4, n=64)
  t32 = table.astype(jnp.float32)
  # a new function each time: make_jaxpr caches its trace by function
  jaxpr = lambda t: jax.make_jaxpr(lambda x: layers.embed_lookup(x, tokens))(t)
  assert "custom_vjp_call" not in str(jaxpr(t32))
  assert "custom_vjp_call" in str(jaxpr(table))
  monkeypatch.setattr(layers, "EMBED_GRAD", "autodiff")
  assert "custom_vjp_call" not in str(jaxpr(table))
  monkeypatch.setattr(layers, "EMBED_GRAD", "bf16")
  with pytest.raises(ValueError, match="INFIR2_EMBED_GRAD='bf16': one of"):
    layers.embed_lookup(table, tokens)


def test_a_mesh_of_several_devices_sums_into_the_table():
  """On a mesh of several devices the backward scatter-adds into a float32 table (sharded
  as XLA's partitioner lays it out) instead of sorting every device's tokens: no sort in
  the program, and the same float32 sums rounded once."""
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel
  table, tokens, g = _skewed_problem(n=1024)
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  ref = _float64_sums(table.shape[0], tokens, g).astype(ml_dtypes.bfloat16)
  with jax.set_mesh(mesh):
    tok = jax.device_put(jnp.asarray(tokens.reshape(8, -1)), NamedSharding(mesh, P("data")))
    g32 = jax.device_put(jnp.asarray(g, jnp.float32).reshape(8, -1, g.shape[-1]),
                         NamedSharding(mesh, P("data")))
    loss = lambda t: jnp.sum(layers.embed_lookup(t, tok).astype(jnp.float32) * g32)
    assert " sort[" not in str(jax.make_jaxpr(jax.grad(loss))(table))
    got = np.asarray(jax.jit(jax.grad(loss))(table))
  np.testing.assert_array_equal(got, ref)
  assert " sort[" in str(jax.make_jaxpr(jax.grad(
      lambda t: jnp.sum(layers.embed_lookup(t, jnp.asarray(tokens)).astype(jnp.float32))))(
          table))
