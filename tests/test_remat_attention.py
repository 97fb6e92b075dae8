"""Remat policies and cuDNN attention: the backward pass must not rerun the attention forward.

cuDNN's fused attention is a custom call, not a dot_general, so a dots-only policy keeps
neither its output nor its softmax statistics, and the backward pass runs the forward kernel
again to rebuild them (on the H200 at 8k tokens: 78 of the step's 535 ms were attention
forward, half of it this recompute). Here jax.nn.dot_product_attention is replaced by a
stand-in with the same structure as JAX's cuDNN path (a custom_vjp whose forward binds a
primitive of that name and returns output and statistics), and the forward calls in the
gradient's jaxpr are counted.
"""

import collections
import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.cudnn import fused_attention_stablehlo as cudnn_fa

from infir2_jax.model import ModelConfig, Qwen2, init_params, packed_attention
from infir2_jax.model.remat import CUDNN_ATTENTION_FWD
from test_remat_fp8 import _count_primitives, _opaque

CFG = ModelConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_layers=2,
                  num_heads=2, num_kv_heads=1, head_dim=128, dtype="float32",
                  attention="cudnn")
_real_attention = jax.nn.dot_product_attention


def test_the_policy_names_jax_cudnn_forward_primitive():
  assert cudnn_fa._dot_product_attention_fwd_p_wrapper.name == CUDNN_ATTENTION_FWD


def _reference(q, k, v, mask):
  return _real_attention(q, k, v, mask=mask, is_causal=True, implementation="xla")


def _with_stats(q, k, v, mask):
  out = _reference(q, k, v, mask)
  stats = jnp.zeros(out.shape[:-1], jnp.float32)  # stands for the softmax statistics
  return out, stats


_fwd_prim = _opaque(_with_stats, CUDNN_ATTENTION_FWD)
_bwd_prim = _opaque(lambda q, k, v, mask, dout: jax.vjp(
    lambda q, k, v: _reference(q, k, v, mask), q, k, v)[1](dout), "fake_attention_bwd")


@jax.custom_vjp
def _fake_cudnn(q, k, v, mask):
  return _fwd_prim(q, k, v, mask)[0]


def _fake_fwd(q, k, v, mask):
  out, stats = _fwd_prim(q, k, v, mask)
  return out, (q, k, v, mask, out, stats)


def _fake_bwd(res, dout):
  q, k, v, mask, _, _ = res
  return (*_bwd_prim(q, k, v, mask, dout), None)


_fake_cudnn.defvjp(_fake_fwd, _fake_bwd)


def _fake_attention(q, k, v, bias=None, mask=None, *, is_causal=False, implementation=None,
                    **kw):
  assert implementation == "cudnn" and is_causal and bias is None and not kw
  if mask is None:
    mask = jnp.ones((q.shape[0], 1, q.shape[1], k.shape[1]), bool)
  return _fake_cudnn(q, k, v, mask)


def _fake_packed(q, k, v, segment_ids, max_documents, runs=None):
  # as cuDNN's packed call: the runs it is given (attention.document_runs), else its own
  lengths, _ = runs if runs is not None else packed_attention.segment_runs(segment_ids,
                                                                           max_documents)
  assert lengths.shape == (segment_ids.shape[0], max_documents), lengths.shape
  same = segment_ids[:, :, None] == segment_ids[:, None, :]
  return _fake_cudnn(q, k, v, same[:, None])


@pytest.fixture
def fake_cudnn(monkeypatch):
  """cuDNN attention (dense-mask and packed-document calls) as an opaque stand-in on CPU."""
  monkeypatch.setattr(jax.nn, "dot_product_attention", _fake_attention)
  monkeypatch.setattr(packed_attention, "cudnn_packed", _fake_packed)


def _grad(remat: str):
  model = Qwen2(dataclasses.replace(CFG, remat=remat))
  tokens = jax.random.randint(jax.random.key(1), (2, 128), 0, CFG.vocab_size)
  params = nn.unbox(init_params(Qwen2(CFG), jax.random.key(0)))
  loss = lambda p, t: jnp.mean(model.apply({"params": p}, t).astype(jnp.float32) ** 2)
  return jax.grad(loss), params, tokens


@pytest.mark.parametrize("remat,forwards_per_layer", [
    ("none", 1), ("save_dots", 1), ("save_dots_fp8", 1), ("full", 2)])
def test_attention_forward_runs_once_per_layer(fake_cudnn, remat, forwards_per_layer):
  grad, params, tokens = _grad(remat)
  counts = _count_primitives(jax.make_jaxpr(grad)(params, tokens).jaxpr, collections.Counter())
  assert counts["fake_attention_bwd"] == CFG.num_layers, counts
  assert counts[CUDNN_ATTENTION_FWD] == forwards_per_layer * CFG.num_layers, counts


def test_saving_attention_changes_no_gradient(fake_cudnn):
  grads = {}
  for remat in ("none", "save_dots", "full"):
    grad, params, tokens = _grad(remat)
    grads[remat] = jax.jit(grad)(params, tokens)
  for remat in ("save_dots", "full"):
    for a, b in zip(jax.tree.leaves(grads["none"]), jax.tree.leaves(grads[remat])):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _rope_counts(remat: str, scan_layers: bool) -> collections.Counter:
  model = Qwen2(dataclasses.replace(CFG, remat=remat, scan_layers=scan_layers))
  tokens = jnp.zeros((2, 128), jnp.int32)
  params = jax.eval_shape(lambda: nn.unbox(model.init(jax.random.key(0), tokens)["params"]))
  loss = lambda p, t: jnp.mean(model.apply({"params": p}, t).astype(jnp.float32) ** 2)
  return _count_primitives(jax.make_jaxpr(jax.grad(loss))(params, tokens).jaxpr,
                           collections.Counter())


@pytest.mark.parametrize("scan_layers", [False, True])
def test_backward_recomputes_no_rope(fake_cudnn, scan_layers):
  """RoPE's sin and cos are made once per step, not in each remat'd layer's backward, and the
  save-dots policies keep the attention's inputs (q, k after RoPE, v): their backward pass
  rotates nothing again. Counted in the gradient's jaxpr: rotate-half is a concatenate."""
  counts = {}
  for remat in ("none", "save_dots", "save_dots_fp8", "full"):
    c = _rope_counts(remat, scan_layers)
    assert c["sin"] == c["cos"] == 1, (remat, c["sin"], c["cos"])
    counts[remat] = c["concatenate"]
  assert counts["save_dots"] == counts["save_dots_fp8"] == counts["none"], counts
  assert counts["full"] > counts["none"], counts   # full remat recomputes RoPE, as it should


def test_rope_per_layer_is_the_earlier_form(fake_cudnn, monkeypatch):
  """INFIR2_ROPE=per_layer (A/B runs): each layer makes its tables, and its remat'd backward
  makes them and rotates q and k again; the gradients are those of the default form."""
  from infir2_jax.model import layers
  monkeypatch.setattr(layers, "ROPE", "per_layer")
  c = _rope_counts("save_dots", scan_layers=False)
  assert c["sin"] == c["cos"] == 2 * CFG.num_layers, (c["sin"], c["cos"])
  grad, params, tokens = _grad("save_dots")
  per_layer = jax.jit(grad)(params, tokens)
  monkeypatch.setattr(layers, "ROPE", "once")
  grad, params, tokens = _grad("save_dots")   # traced anew (jit caches by function)
  once = jax.jit(grad)(params, tokens)
  for a, b in zip(jax.tree.leaves(once), jax.tree.leaves(per_layer)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-7)
  monkeypatch.setattr(layers, "ROPE", "sometimes")
  with pytest.raises(ValueError, match="INFIR2_ROPE"):
    _rope_counts("save_dots", scan_layers=False)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_document_runs_are_made_once_per_step(fake_cudnn, scan_layers):
  """The packed attention's runs of the segment ids (segment_runs: a nonzero, whose cumsum
  is counted) are made once per model call and handed to every layer, not made in each
  layer and again in each remat'd layer's backward (nine small kernels a layer on the
  H200, session 32)."""
  ids = jnp.zeros((2, 128), jnp.int32)
  once = _count_primitives(jax.make_jaxpr(
      lambda s: packed_attention.segment_runs(s, CFG.max_documents))(ids).jaxpr,
                           collections.Counter())["cumsum"]
  assert once > 0
  for remat in ("none", "save_dots", "full"):
    assert _rope_counts(remat, scan_layers)["cumsum"] == once, remat


def test_document_runs_are_segment_runs():
  """document_runs gives the ids with segment_runs' (lengths, offsets) where the packed
  layout runs, FA3's cu_seqlens for model.document_kernel=fa3_varlen, and the ids alone
  where the attention takes a dense mask."""
  from infir2_jax.model.attention import document_runs
  ids = jnp.asarray([[1, 1, 2, 2, 2, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]], jnp.int32)
  got = document_runs(CFG, ids)
  assert isinstance(got, packed_attention.DocumentRuns)
  want = packed_attention.segment_runs(ids, CFG.max_documents)
  np.testing.assert_array_equal(got.segment_ids_BxL, ids)
  for a, b in zip(got.runs, want):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(got.runs[0][0, :4], [2, 3, 3, -1])
  fa3 = document_runs(dataclasses.replace(CFG, document_kernel="fa3_varlen"), ids)
  np.testing.assert_array_equal(
      fa3.runs[0], packed_attention.cu_seqlens(ids, 2 * CFG.max_documents))
  assert document_runs(dataclasses.replace(CFG, attention="xla"), ids) is ids
  assert document_runs(dataclasses.replace(CFG, attention_mask="causal"), ids) is ids
