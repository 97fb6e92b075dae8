"""Document-masked attention without a mask tensor: segment runs, the host-side bound, and
the model's cuDNN packed-layout call (traced on CPU; its numerics on the GPU)."""

import collections
import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.cudnn import fused_attention_stablehlo as cudnn_fa

from infir2_jax.model import ModelConfig, Qwen2, init_params, packed_attention
from infir2_jax.model.attention import check_documents
from infir2_jax.model.remat import CUDNN_ATTENTION_FWD

CFG = ModelConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_layers=2,
                  num_heads=2, num_kv_heads=1, head_dim=128, attention="cudnn",
                  max_documents=4)


def _random_segments(rng, rows, length, max_docs):
  """Rows of packed documents numbered from 1, with a padding run (0) at the end of some."""
  out = np.zeros((rows, length), np.int32)
  for r in range(rows):
    cuts = np.sort(rng.choice(np.arange(1, length), rng.integers(0, max_docs), replace=False))
    for i, (a, b) in enumerate(zip([0, *cuts], [*cuts, length])):
      out[r, a:b] = i + 1
    if r % 2:
      out[r, length - rng.integers(1, 8):] = 0
  return out


def _runs_numpy(row):
  """(starts, lengths) of the runs of equal values in a 1-D array."""
  starts = [0] + [t for t in range(1, len(row)) if row[t] != row[t - 1]]
  ends = starts[1:] + [len(row)]
  return starts, [e - s for s, e in zip(starts, ends)]


def test_segment_runs_match_a_numpy_reference():
  rng = np.random.default_rng(0)
  seg = _random_segments(rng, 6, 64, 7)
  counts = packed_attention.runs_per_row_np(seg)
  np.testing.assert_array_equal(np.asarray(packed_attention.runs_per_row(jnp.asarray(seg))),
                                counts)
  for m in (int(counts.max()), int(counts.max()) + 3):
    lengths, offsets = (np.asarray(a) for a in packed_attention.segment_runs(jnp.asarray(seg), m))
    assert lengths.shape == (6, m) and offsets.shape == (6, m + 1)
    for r in range(6):
      starts, sizes = _runs_numpy(seg[r])
      n = len(starts)
      assert counts[r] == n
      np.testing.assert_array_equal(lengths[r], sizes + [-1] * (m - n))
      np.testing.assert_array_equal(offsets[r], starts + [-1] * (m + 1 - n))


def test_cu_seqlens_flatten_the_rows():
  seg = jnp.asarray([[1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1]])
  np.testing.assert_array_equal(np.asarray(packed_attention.cu_seqlens(seg, 6)),
                                [0, 2, 5, 6, 12, 12, 12])


def test_a_row_with_too_many_documents_is_an_error_naming_the_key():
  seg = np.array([[1, 1, 2, 3, 4, 5, 0, 0]])  # 6 runs, the padding run included
  check_documents(seg, dataclasses.replace(CFG, max_documents=6))
  with pytest.raises(ValueError, match="6 documents.*model.max_documents=5"):
    check_documents(seg, dataclasses.replace(CFG, max_documents=5))


@pytest.fixture
def cudnn_traceable(monkeypatch):
  """Lets JAX trace (not run) its cuDNN attention on a CPU host: no GPU to ask for versions."""
  monkeypatch.setattr(cudnn_fa, "check_cudnn_version", lambda: 91000)
  monkeypatch.setattr(cudnn_fa, "check_compute_capability", lambda *a: True)


def _attention_calls(cfg, remat="none"):
  """(name, operand shapes) of each cuDNN attention primitive in the model's gradient."""
  model = Qwen2(dataclasses.replace(cfg, remat=remat))
  tokens = jnp.zeros((2, 128), jnp.int32)
  segments = jnp.asarray(np.repeat([[1] * 60 + [2] * 40 + [0] * 28], 2, axis=0))
  params = jax.eval_shape(lambda: nn.unbox(model.init(jax.random.key(0), tokens)["params"]))
  loss = lambda p: jnp.sum(model.apply({"params": p}, tokens, None, segments)
                           .astype(jnp.float32))
  jaxpr = jax.make_jaxpr(jax.grad(loss))(params).jaxpr
  calls = []

  def walk(j):
    for e in j.eqns:
      if "dot_product_attention" in e.primitive.name:
        calls.append((e.primitive.name, [tuple(v.aval.shape) for v in e.invars]))
      for p in e.params.values():
        for sub in p if isinstance(p, (list, tuple)) else [p]:
          inner = getattr(sub, "jaxpr", sub)
          if hasattr(inner, "eqns"):
            walk(inner)
  walk(jaxpr)
  return calls


def test_document_mask_runs_the_packed_layout_without_a_mask(cudnn_traceable):
  calls = _attention_calls(CFG)
  forwards = [shapes for name, shapes in calls if name == CUDNN_ATTENTION_FWD]
  assert len(forwards) == CFG.num_layers
  for shapes in forwards:
    assert (2, CFG.max_documents + 1) in shapes      # the runs' offsets
    assert not any(len(s) == 4 and s[-2:] == (128, 128) for s in shapes)  # no [B,1,L,L] mask
  causal = _attention_calls(dataclasses.replace(CFG, attention_mask="causal"))
  assert all((2, CFG.max_documents + 1) not in s for _, s in causal)


@pytest.mark.parametrize("remat,forwards_per_layer", [("save_dots", 1), ("full", 2)])
def test_remat_keeps_the_packed_attention_forward(cudnn_traceable, remat, forwards_per_layer):
  counts = collections.Counter(name for name, _ in _attention_calls(CFG, remat))
  assert counts[CUDNN_ATTENTION_FWD] == forwards_per_layer * CFG.num_layers, counts


def test_an_unknown_document_kernel_is_refused():
  with pytest.raises(ValueError, match="model.document_kernel='fa2'.*'fa3_varlen'"):
    dataclasses.replace(CFG, document_kernel="fa2")


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["cudnn_packed", "fa3_varlen"])
def test_packed_attention_equals_the_dense_reference_on_gpu(kernel):
  """The model with cuDNN's packed layout or FA3's varlen kernel against XLA's dense
  segment mask."""
  if kernel == "fa3_varlen":
    pytest.importorskip("flash_attn3_jax")
  cfg = dataclasses.replace(CFG, dtype="bfloat16", max_documents=8, document_kernel=kernel)
  tokens = jax.random.randint(jax.random.key(1), (2, 256), 0, cfg.vocab_size)
  seg = jnp.asarray(_random_segments(np.random.default_rng(3), 2, 256, 7))
  params = nn.unbox(init_params(Qwen2(cfg), jax.random.key(0)))
  outs = {}
  for impl in ("cudnn", "xla"):
    model = Qwen2(dataclasses.replace(cfg, attention=impl))
    loss = lambda p: jnp.mean(model.apply({"params": p}, tokens, None, seg) ** 2)
    outs[impl] = jax.jit(jax.value_and_grad(loss))(params)
  np.testing.assert_allclose(outs["cudnn"][0], outs["xla"][0], rtol=2e-2)
  for a, b in zip(jax.tree.leaves(outs["cudnn"][1]), jax.tree.leaves(outs["xla"][1])):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.linalg.norm(a - b) <= 5e-2 * np.linalg.norm(b) + 1e-6
