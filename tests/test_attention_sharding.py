"""cuDNN attention under FSDP / tensor parallelism: q, k, v and the mask get shardings that
cuDNN's SPMD partitioner accepts, and the sharded step equals the single-device one.

cuDNN attention only compiles on a GPU. Its partitioner (jax._src.cudnn.
fused_attention_stablehlo) checks the operand shardings that propagation chose, with
`_check_qkv_bias_mask_spec`; the first 2-GPU run failed there ("Query, key and value should
have same sharding"). Here a stand-in attention has the same partitioning contract (JAX's
own check, Shardy factors for k, v and the bias independent of q's, as cuDNN declares them)
and computes with XLA, so the real SPMD partitioner runs it on 8 fake CPU devices.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P
from jax._src.cudnn import fused_attention_stablehlo as cudnn_fa  # the check cuDNN applies

from infir2_jax.model import packed_attention
from test_sharding_equivalence import run_step

XLA_ATTENTION = jax.nn.dot_product_attention
BTNH = cudnn_fa.AttentionLayout.BTNH.value
CHECKED = []  # operand specs each partition call saw


def _xla_causal(q, k, v, bias):
  return XLA_ATTENTION(q, k, v, bias=bias, is_causal=True)


def _checked_op(impl, rule):
  """`impl(q, k, v, bias, *rest)` partitioned under cuDNN's sharding contract."""
  op = custom_partitioning(impl)

  def partition(mesh, arg_shapes, result_shape):
    specs = [cudnn_fa._get_padded_spec(a) for a in arg_shapes]
    cudnn_fa._check_qkv_bias_mask_spec(*specs[:4], BTNH)  # raises as cuDNN's does
    CHECKED.append(specs[:4])
    shardings = tuple(NamedSharding(mesh, P(*s)) for s in specs)
    return mesh, impl, infer(mesh, arg_shapes, result_shape), shardings

  def infer(mesh, arg_shapes, result_shape):  # out like q; (dq, dk, dv) like (q, k, v)
    specs = [cudnn_fa._get_padded_spec(a) for a in arg_shapes]
    if isinstance(result_shape, (list, tuple)):
      return tuple(NamedSharding(mesh, P(*specs[i])) for i in range(len(result_shape)))
    return NamedSharding(mesh, P(*specs[0]))

  op.def_partition(partition=partition, infer_sharding_from_operands=infer,
                   sharding_rule=rule)
  return op


_fwd = _checked_op(_xla_causal, "q0 q1 q2 q3, k0 k1 k2 k3, v0 v1 v2 v3, b0 b1 b2 b3 "
                                "-> q0 q1 q2 q3")


def _bwd_impl(q, k, v, bias, g):
  _, vjp = jax.vjp(lambda q, k, v: _xla_causal(q, k, v, bias), q, k, v)
  return vjp(g)


_bwd = _checked_op(_bwd_impl, "q0 q1 q2 q3, k0 k1 k2 k3, v0 v1 v2 v3, b0 b1 b2 b3, "
                              "g0 g1 g2 g3 -> q0 q1 q2 q3, k0 k1 k2 k3, v0 v1 v2 v3")


@jax.custom_vjp
def _attention(q, k, v, bias):
  return _fwd(q, k, v, bias)


_attention.defvjp(lambda q, k, v, bias: (_fwd(q, k, v, bias), (q, k, v, bias)),
                  lambda res, g: (*_bwd(*res, g), jnp.zeros_like(res[3])))


def stand_in_cudnn(q, k, v, bias=None, mask=None, *, is_causal=False, implementation=None,
                   **kwargs):
  if implementation != "cudnn":
    return XLA_ATTENTION(q, k, v, bias, mask, is_causal=is_causal,
                         implementation=implementation, **kwargs)
  assert is_causal and bias is None and not kwargs
  # what cuDNN's dot_product_attention does with a boolean mask (combine_bias_and_mask, which
  # takes bf16/f16 only; this test computes in f32): an additive [B, 1, L, L] bias
  return _attention(q, k, v, jnp.where(mask, 0.0, -1e9).astype(q.dtype))


def stand_in_packed(q, k, v, segment_ids, max_documents, runs=None):
  """cuDNN's packed-document call (model.packed_attention.cudnn_packed) as the same stand-in:
  its q, k and v reach the partitioner as they would, the documents as a dense mask, built
  from the runs the model made once (attention.document_runs) where it hands them over,
  so that runs made wrong on a mesh would change the loss."""
  if runs is None:
    runs = packed_attention.segment_runs(segment_ids, max_documents)
  _, offsets_BxM1 = runs
  positions = jnp.arange(segment_ids.shape[1])
  started = offsets_BxM1[:, None, :] >= 0
  document_BxL = jnp.sum(started & (positions[None, :, None] >= offsets_BxM1[:, None, :]),
                         axis=-1)
  same = document_BxL[:, :, None] == document_BxL[:, None, :]
  return stand_in_cudnn(q, k, v, mask=same[:, None], is_causal=True, implementation="cudnn")


@pytest.fixture(scope="module")
def single_device():
  loss, _, grads, _ = run_step("bf16", (1, 1, 1), attention="xla")
  return loss, grads


# (1, 2, 1): FSDP, the failing 2-GPU case; (1, 1, 2): 2 KV heads split over tensor 2;
# (1, 2, 4): KV heads replicated (2 < tensor 4), repeated to one per query head.
@pytest.mark.parametrize("mesh_shape", [(1, 2, 1), (1, 1, 2), (1, 2, 4), (2, 2, 2)])
def test_cudnn_attention_shardings_pass_its_partitioner(mesh_shape, single_device,
                                                        monkeypatch):
  monkeypatch.setattr(jax.nn, "dot_product_attention", stand_in_cudnn)
  monkeypatch.setattr(packed_attention, "cudnn_packed", stand_in_packed)
  CHECKED.clear()
  loss, _, grads, _ = run_step("bf16", mesh_shape, attention="cudnn")
  assert len(CHECKED) >= 2, "the stand-in cuDNN attention was not partitioned (fwd and bwd)"
  for q_spec, k_spec, v_spec, bias_spec in CHECKED:
    assert q_spec == k_spec == v_spec
    assert q_spec[0] is not None or mesh_shape[:2] == (1, 1)  # batch stays split
    if mesh_shape[2] > 1:
      assert q_spec[2] is not None, "heads should be split over tensor"
  want_loss, want_grads = single_device
  assert abs(loss - want_loss) < 1e-5 * abs(want_loss)
  got, want = jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(want_grads)
  for g, w in zip(got, want):
    err = np.linalg.norm(np.asarray(g) - np.asarray(w)) / max(np.linalg.norm(np.asarray(w)),
                                                                1e-30)
    assert err < 1e-4, err
