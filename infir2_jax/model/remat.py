"""Activation recomputation per decoder layer: which values the backward pass keeps."""

import functools

import jax

from infir2_jax.precision.dot_general import FP8_GEMM_OUT, FP8_RESIDUALS

_cp = jax.checkpoint_policies
# The attention's inputs after RoPE (q, k, v), named in model/attention.py. Saving them in
# place of the q/k/v projections' outputs costs the same memory (the backward then needs
# nothing else of those outputs) and spares the backward RoPE's recomputation per layer.
ATTENTION_INPUTS = "attention_inputs"
# The primitive of cuDNN's fused attention forward (jax.nn.dot_product_attention with
# implementation="cudnn"): its outputs are the attention output and the softmax statistics
# that cuDNN's backward kernel takes.
CUDNN_ATTENTION_FWD = "dot_product_attention_fwd_wrapper"


def cudnn_attention_saveable(prim, *_, **__) -> bool:
  """Remat policy: keep cuDNN attention's forward outputs (a custom call, no dot_general).

  Without it every save-dots policy runs the attention forward twice per step, once more in
  the backward pass to rebuild the softmax statistics (counted in the compiled HLO by
  tests/test_remat_attention.py). Costs B x L x H x Dh in the compute dtype per layer."""
  return prim.name == CUDNN_ATTENTION_FWD


def _save_any(*policies):
  """Logical OR of remat policies (JAX's save_from_both_policies, for any number)."""
  return functools.reduce(_cp.save_from_both_policies, policies)


POLICIES = {
    "full": None,  # save nothing: recompute the whole layer in the backward pass
    # matmul outputs, XLA's and our FP8 GEMMs' (a Pallas call is no dot_general), cuDNN
    # attention's output and softmax statistics, and the attention's inputs
    "save_dots": _save_any(
        _cp.dots_with_no_batch_dims_saveable,
        _cp.save_only_these_names(FP8_GEMM_OUT, ATTENTION_INPUTS), cudnn_attention_saveable),
    # ... and the FP8 operands of the backward GEMMs (no re-quantization, more memory)
    "save_dots_fp8": _save_any(
        _cp.dots_with_no_batch_dims_saveable,
        _cp.save_only_these_names(FP8_GEMM_OUT, FP8_RESIDUALS, ATTENTION_INPUTS),
        cudnn_attention_saveable),
}
