"""FP8 attention (precision/fp8_attention.py) against an independent float64 NumPy reference,
its BF16 backward, its document mask, its statistics, and the recipe that turns it on."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import precision_np_reference as npref
from infir2_jax.precision import PrecisionConfig
from infir2_jax.precision.factory import make_dot_general_factory
from infir2_jax.precision.fp8_attention import (
    bf16_attention, fp8_attention, quantization_stats)
from infir2_jax.precision.recipes import AttentionSpec, get_recipe

B, L, H, K, DH = 2, 256, 4, 2, 128   # GQA 4/2, two 128-key tiles per query row
SPEC = AttentionSpec()


def make_inputs(seed=0, scale=1.0):
  rng = np.random.default_rng(seed)
  q = (rng.standard_normal((B, L, H, DH)) * 2.0 * scale).astype(np.float32)
  k = (rng.standard_normal((B, L, K, DH)) * scale).astype(np.float32)
  v = rng.standard_normal((B, L, K, DH)).astype(np.float32)
  segments = np.ones((B, L), np.int32)
  segments[0, 90:] = 2           # row 0: documents of 90, 100 and 66 tokens
  segments[0, 190:] = 3          # row 1: one document (causal only)
  return q, k, v, segments


def numpy_fp8_attention(q, k, v, segments, fmt="e4m3", scale_format="ue8m0"):
  """The module docstring's forward, written with the float64 reference quantizer."""
  tile = (1, 128)
  rt = lambda x: npref.dequantize(*npref.quantize(x, tile, fmt, scale_format), tile)
  q64, k64 = rt(q), rt(k)                                   # tiles along the head dim
  v64 = np.transpose(rt(np.transpose(v, (0, 2, 3, 1))), (0, 3, 1, 2))   # along the tokens
  groups = q.shape[2] // k.shape[2]
  out = np.zeros(q.shape, np.float64)
  causal = np.tril(np.ones((L, L), bool))
  for b in range(q.shape[0]):
    allowed = causal & (segments[b][:, None] == segments[b][None, :])
    for h in range(q.shape[2]):
      s = q64[b, :, h] @ k64[b, :, h // groups].T / np.sqrt(q.shape[-1])
      s = np.where(allowed, s, -np.inf)
      p = np.where(allowed, np.exp(s - s.max(axis=1, keepdims=True)), 0.0)
      out[b, :, h] = (rt(p) @ v64[b, :, h // groups]) / p.sum(axis=1, keepdims=True)
  return out


@pytest.mark.parametrize("scale_format", ["ue8m0", "fp32"])
def test_forward_is_the_float64_reference(scale_format):
  """The FP8 forward equals the float64 NumPy forward to float32 rounding (an FP8 rounding
  of P that float32 vs float64 exp flips moves one output by ~1e-3 at most), and is
  measurably not the unquantized attention (the quantization is really there)."""
  q, k, v, segments = make_inputs()
  spec = AttentionSpec(scale_format=scale_format)
  got = np.asarray(jax.jit(fp8_attention, static_argnums=4)(q, k, v, segments, spec),
                   np.float64)
  want = numpy_fp8_attention(q, k, v, segments, scale_format=scale_format)
  exact = np.asarray(bf16_attention(q, k, v, segments), np.float64)
  rel = lambda a, b: np.linalg.norm(a - b) / np.linalg.norm(b)
  assert rel(got, want) < 1e-5, rel(got, want)
  assert np.max(np.abs(got - want)) < 2e-3
  assert rel(got, exact) > 1e-3, rel(got, exact)     # 100x the agreement above
  assert rel(got, exact) < 0.1      # E4M3 (~30 dB) on V and on P: a few percent


def test_documents_do_not_see_each_other_and_the_row_stays_causal():
  """Changing the keys and values of row 0's second document changes no output of its first
  document; changing a later token's changes no earlier output (bit for bit). Outside the
  V tile the first document shares with the second (tokens 0-127): a shared tile's scale
  is the one way a neighbour reaches a document (module docstring), shown too."""
  q, k, v, segments = make_inputs()
  attend = jax.jit(fp8_attention, static_argnums=4)
  base = np.asarray(attend(q, k, v, segments, SPEC))
  k2, v2 = k.copy(), v.copy()
  k2[0, 128:190] += 3.0
  v2[0, 128:190] -= 5.0
  moved = np.asarray(attend(q, k2, v2, segments, SPEC))
  np.testing.assert_array_equal(moved[0, :90], base[0, :90])
  assert not np.array_equal(moved[0, 128:190], base[0, 128:190])
  v4 = v.copy()
  v4[0, 100] = 1e3                      # in the first document's V tile: its scale grows
  shared = np.asarray(attend(q, k, v4, segments, SPEC))
  assert not np.array_equal(shared[0, :90], base[0, :90])
  np.testing.assert_allclose(shared[0, :90], base[0, :90], atol=0.5)
  k3, v3 = k.copy(), v.copy()
  k3[1, 200:] += 3.0
  v3[1, 200:] -= 5.0
  later = np.asarray(attend(q, k3, v3, segments, SPEC))
  # Row 1's tokens before 200 see none of it. The V tile of keys 128..255 holds tokens 200+
  # too, so its scale may change and re-round keys 128..199: compare before 128 exactly.
  np.testing.assert_array_equal(later[1, :128], base[1, :128])
  np.testing.assert_array_equal(later[0], base[0])


def test_gradients_are_the_bf16_attentions():
  """The backward is the unquantized attention's VJP on the same inputs (TE's BF16
  backward), exactly, for bf16 inputs and segment ids (no gradient for the ids)."""
  q, k, v, segments = (jnp.asarray(x, jnp.bfloat16) if x.dtype == np.float32 else x
                       for x in make_inputs(1))
  g = jnp.asarray(np.random.default_rng(2).standard_normal((B, L, H, DH)), jnp.bfloat16)
  _, vjp_fp8 = jax.vjp(lambda q, k, v: fp8_attention(q, k, v, segments, SPEC), q, k, v)
  _, vjp_bf16 = jax.vjp(lambda q, k, v: bf16_attention(q, k, v, segments), q, k, v)
  for got, want in zip(vjp_fp8(g), vjp_bf16(g)):
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  assert float(jnp.abs(vjp_fp8(g)[0]).max()) > 0


def test_the_backward_is_the_given_bf16_attentions():
  """`backward` (the model's own BF16 attention) gives the gradients: a stand-in that is
  twice the BF16 attention gives exactly twice its gradients, and sees the segment ids."""
  q, k, v, segments = (jnp.asarray(x, jnp.bfloat16) if x.dtype == np.float32 else x
                       for x in make_inputs(3))
  g = jnp.asarray(np.random.default_rng(5).standard_normal((B, L, H, DH)), jnp.bfloat16)
  seen = []

  def doubled(q, k, v, seg):
    seen.append(seg)
    return 2 * bf16_attention(q, k, v, seg)
  _, vjp_fp8 = jax.vjp(lambda q, k, v: fp8_attention(q, k, v, segments, SPEC, False, doubled),
                       q, k, v)
  _, vjp_bf16 = jax.vjp(lambda q, k, v: bf16_attention(q, k, v, segments), q, k, v)
  for got, want in zip(vjp_fp8(g), vjp_bf16(g)):
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  2 * np.asarray(want, np.float32))
  assert len(seen) == 1 and np.array_equal(np.asarray(seen[0]), np.asarray(segments))


def test_the_model_hands_its_own_bf16_attention_to_the_backward(monkeypatch):
  """In the model the FP8 attention's backward is model/attention.bf16_train_attention (on a
  GPU cuDNN's packed kernel, not XLA's dense scores), called with the model's config and
  the segment ids; on the CPU its gradients equal fp8_attention's default ones."""
  import flax.linen as nn
  from infir2_jax.model import ModelConfig, Qwen2, init_params
  from infir2_jax.model import attention as attention_mod
  cfg = ModelConfig(vocab_size=256, hidden_size=256, intermediate_size=256, num_layers=1,
                    num_heads=2, num_kv_heads=1, head_dim=128, dtype="bfloat16",
                    attention="xla", remat="none")
  rng = np.random.default_rng(6)
  tokens = jnp.asarray(rng.integers(0, 256, (1, 128)), jnp.int32)
  segments = jnp.asarray([[1] * 50 + [2] * 78], jnp.int32)
  positions = jnp.asarray([list(range(50)) + list(range(78))], jnp.int32)
  model = Qwen2(cfg, make_dot_general_factory(PrecisionConfig(backend="xla",
                                                              recipe="infir2_fp8attn")))
  params = nn.unbox(init_params(model, jax.random.key(0)))
  loss = lambda p: jnp.mean(model.apply({"params": p}, tokens, positions, segments)
                            .astype(jnp.float32) ** 2)
  reference = jax.jit(jax.grad(loss))(params)   # the backward the model hands over
  calls = []
  real = attention_mod.bf16_train_attention

  def recorded(config, *args):
    calls.append((config, args[3]))
    return real(config, *args)
  monkeypatch.setattr(attention_mod, "bf16_train_attention", recorded)
  got = jax.jit(jax.grad(loss))(params)
  assert len(calls) == 1 and calls[0][0] is cfg and calls[0][1].shape == (1, 128)
  monkeypatch.setattr(attention_mod, "bf16_train_attention",
                      lambda config, q, k, v, seg: bf16_attention(q, k, v, seg))
  xla_dense = jax.jit(jax.grad(loss))(params)
  for a, b, c in zip(jax.tree.leaves(got), jax.tree.leaves(reference),
                     jax.tree.leaves(xla_dense)):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(c, np.float32),
                               rtol=0.05, atol=1e-3)


def test_quantization_stats_count_flushed_probabilities():
  """p_flush is the share of attended (normal float32) probabilities whose E4M3 code is 0,
  counted again here in float64; peaked scores (large q, k) flush many, flat ones none; the operands'
  SNR is E4M3's (~30 dB), and the output error is the forward's against the exact one."""
  # Peaked scores (logits of std ~70) also amplify Q's and K's E4M3 error in the softmax.
  for scale, flushes, most_error in ((1.0, False, 0.1), (6.0, True, 0.5)):
    q, k, v, segments = make_inputs(3, scale)
    stats = {n: float(x) for n, x in jax.jit(quantization_stats, static_argnums=4)(
        q, k, v, segments, SPEC).items()}
    tile = (1, 128)
    rt = lambda x: npref.dequantize(*npref.quantize(x, tile), tile)
    q64, k64 = rt(q), rt(k)
    attended = flushed = 0
    causal = np.tril(np.ones((L, L), bool))
    for b in range(B):
      allowed = causal & (segments[b][:, None] == segments[b][None, :])
      for h in range(H):
        s = np.where(allowed, q64[b, :, h] @ k64[b, :, h // 2].T / np.sqrt(DH), -np.inf)
        p = np.where(allowed, np.exp(s - s.max(axis=1, keepdims=True)), 0.0)
        p8, _ = npref.quantize(p, tile)
        normal = p >= 2.0 ** -126
        attended += np.sum(normal)
        flushed += np.sum(normal & (np.asarray(p8, np.float64) == 0))
    assert stats["p_flush"] == pytest.approx(flushed / attended, abs=2e-4)
    assert (stats["p_flush"] > 0.01) == flushes, stats
    for name in ("q", "k", "v"):
      assert 25 < stats[f"{name}_snr_db"] < 40, stats
    assert 0 < stats["out_rel_err"] < most_error, stats
    assert 0 <= stats["p_flush_mass"] < 1e-3, stats   # what flushes is what weighs least


def test_the_recipe_turns_it_on_where_its_overrides_say():
  """infir2_fp8attn is infir2's GEMMs plus an attention spec; the factory gives the FP8
  attention to the attention modules its recipe reaches, none elsewhere."""
  fp8attn, infir2 = get_recipe("infir2_fp8attn"), get_recipe("infir2")
  assert fp8attn.gemms() == infir2.gemms() and infir2.attention is None
  assert fp8attn.attention == AttentionSpec("e4m3", "ue8m0")
  factory = make_dot_general_factory(PrecisionConfig(
      recipe="infir2_fp8attn", overrides=("layers_0/=infir2",)))
  assert factory.attention("layers_0/self_attn") is None
  assert factory.attention("layers_1/self_attn") is not None
  assert make_dot_general_factory(PrecisionConfig(recipe="infir2")).attention(
      "layers_1/self_attn") is None


@pytest.mark.slow   # ~35 s of XLA:CPU compiles
def test_the_model_runs_fp8_attention_only_where_the_recipe_says():
  """A one-layer Qwen2 (head dim 128, documents): infir2_fp8attn's logits differ from
  infir2's (attention is quantized) by a few percent at most, equal them bit for bit when an
  override gives every layer infir2 again, and its gradients are finite and nonzero."""
  import flax.linen as nn
  from infir2_jax.model import ModelConfig, Qwen2, init_params
  cfg = ModelConfig(vocab_size=256, hidden_size=256, intermediate_size=256, num_layers=1,
                    num_heads=2, num_kv_heads=1, head_dim=128, dtype="float32",
                    attention="xla", remat="none")
  rng = np.random.default_rng(4)
  tokens = jnp.asarray(rng.integers(0, 256, (2, 128)), jnp.int32)
  segments = jnp.asarray(np.repeat(np.array([[1] * 70 + [2] * 58]), 2, 0), jnp.int32)
  positions = jnp.asarray(np.concatenate([np.arange(70), np.arange(58)])[None].repeat(2, 0),
                          jnp.int32)
  model = lambda **kw: Qwen2(cfg, make_dot_general_factory(PrecisionConfig(backend="xla", **kw)))
  params = nn.unbox(init_params(model(recipe="infir2"), jax.random.key(0)))
  logits = lambda m, p: jax.jit(m.apply)({"params": p}, tokens, positions, segments)
  base = np.asarray(logits(model(recipe="infir2"), params))
  fp8 = np.asarray(logits(model(recipe="infir2_fp8attn"), params))
  undone = np.asarray(logits(model(recipe="infir2_fp8attn", overrides=("layers_=infir2",)),
                             params))
  np.testing.assert_array_equal(undone, base)
  rel = np.linalg.norm(fp8 - base) / np.linalg.norm(base)
  assert 0 < rel < 0.05, rel
  fp8_model = model(recipe="infir2_fp8attn")
  loss = lambda p: jnp.mean(jax.nn.logsumexp(
      fp8_model.apply({"params": p}, tokens, positions, segments), -1))
  grads = jax.jit(jax.grad(loss))(params)
  assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
  assert float(jnp.abs(grads["layers_0"]["self_attn"]["q_proj"]["kernel"]).max()) > 0
  # scanned layers get the FP8 attention too (the scan's uniform factory passes it on)
  import dataclasses
  scanned = lambda **kw: Qwen2(dataclasses.replace(cfg, scan_layers=True),
                               make_dot_general_factory(PrecisionConfig(backend="xla", **kw)))
  np.testing.assert_allclose(np.asarray(logits(scanned(recipe="infir2_fp8attn"), params)), fp8,
                             rtol=0, atol=1e-5 * np.abs(fp8).max())
  np.testing.assert_allclose(np.asarray(logits(scanned(recipe="infir2"), params)), base,
                             rtol=0, atol=1e-5 * np.abs(base).max())


def test_long_rows_warn_that_the_scores_are_dense(caplog, monkeypatch):
  """Above the threshold the (trace-time) warning names the dense scores and their size."""
  from infir2_jax.precision import fp8_attention as module
  monkeypatch.setattr(module, "DENSE_SCORES_WARN_BYTES", 1 << 20)   # 2 x 4 x 256^2 x 4 = 2 MiB
  q, k, v, segments = make_inputs()
  with caplog.at_level("WARNING"):
    jax.eval_shape(lambda q, k, v: fp8_attention(q, k, v, segments, SPEC), q, k, v)
  assert "dense scores" in caplog.text and "[2, 4, 256, 256]" in caplog.text
  caplog.clear()
  monkeypatch.setattr(module, "DENSE_SCORES_WARN_BYTES", 4 << 20)
  with caplog.at_level("WARNING"):
    jax.eval_shape(lambda q, k, v: fp8_attention(q, k, v, segments, SPEC), q, k, v)
  assert "dense scores" not in caplog.text
