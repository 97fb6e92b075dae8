"""The pure training and evaluation steps: (state, batch) -> (state, metrics)."""

from collections.abc import Callable
import os
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from infir2_jax.train import grads as grads_lib
from infir2_jax.train import optim
from infir2_jax.train.loss import (chunked_cross_entropy_sums, cross_entropy_sums,
                                   fused_head_cross_entropy_sums)
from infir2_jax.precision import telemetry

Batch = dict[str, jax.Array]   # inputs, targets, segment_ids, positions, loss_mask: [B, L]
State = dict[str, Any]         # step, params, opt_state


def loss_sums(model: nn.Module, params, batch: Batch) -> tuple[jax.Array, jax.Array]:
  """(sum of token losses, number of loss tokens) of one (micro-)batch."""
  chunk = model.config.loss_chunk
  if chunk and chunk < batch["inputs"].shape[-1]:  # the head and loss a chunk at a time
    hidden_BxLxD = model.apply({"params": params}, batch["inputs"], batch["positions"],
                               batch["segment_ids"], return_hidden=True)
    if model.config.loss_fused:   # each chunk's gradients made in the forward pass
      weight, vocab_axis = model.head_weight(params)
      return fused_head_cross_entropy_sums(hidden_BxLxD.astype(weight.dtype), weight,
                                           batch["targets"], batch["loss_mask"], chunk,
                                           vocab_axis)
    return chunked_cross_entropy_sums(lambda h: model.head_logits(params, h), hidden_BxLxD,
                                      batch["targets"], batch["loss_mask"], chunk)
  logits_BxLxV = model.apply({"params": params}, batch["inputs"], batch["positions"],
                             batch["segment_ids"])
  return cross_entropy_sums(logits_BxLxV, batch["targets"], batch["loss_mask"])


def split_microbatches(batch: Batch, num: int) -> Batch:
  """[B, L] -> [num, B/num, L], micro-batch a taking rows a, a+num, ... so that each device's
  contiguous block of rows stays on that device (no resharding)."""
  def split(x):
    rows = x.shape[0]
    return x.reshape(rows // num, num, *x.shape[1:]).swapaxes(0, 1)
  return jax.tree.map(split, batch)


# What the backward differentiates for the params the model only casts (train/grads.py):
# "cast" their bf16 copies (the default, as every step so far was measured); "master" the
# float32 masters with the gradient routed to bf16 (grads.masters_with_cast_gradients: the
# same bits, no tree-wide bf16 copy live across the step; deviceless 7B candidate 54.8 GiB
# live at the peak against 66.9, its time not yet measured). INFIR2_GRAD_INPUTS, for A/B runs.
GRAD_INPUTS = os.environ.get("INFIR2_GRAD_INPUTS", "cast")
GRAD_INPUTS_CHOICES = ("cast", "master")


def _differentiable(params, dtypes):
  """(inputs, rebuild) of the params to differentiate, per GRAD_INPUTS."""
  if GRAD_INPUTS not in GRAD_INPUTS_CHOICES:
    raise ValueError(f"INFIR2_GRAD_INPUTS={GRAD_INPUTS!r}: one of {GRAD_INPUTS_CHOICES}")
  if GRAD_INPUTS == "master":
    return grads_lib.masters_with_cast_gradients(params, dtypes)
  return grads_lib.cast_to(params, dtypes), lambda inputs: inputs


def _telemetry_grad_fn(model: nn.Module):
  """(params, sinks, batch) -> ((loss_sum, tokens), grads, fp8 stats): one fwd+bwd that also
  returns the FP8 numerics (forward stats sown, backward stats as the sinks' gradients)."""
  def loss_fn(params, sinks, batch):
    logits, variables = model.apply(
        {"params": params, telemetry.SINKS: sinks}, batch["inputs"], batch["positions"],
        batch["segment_ids"], mutable=[telemetry.STATS])
    loss_sum, tokens = cross_entropy_sums(logits, batch["targets"], batch["loss_mask"])
    return loss_sum, (tokens, variables[telemetry.STATS])

  def grad_fn(params, sinks, batch):
    inputs, rebuild = _differentiable(
        params, grads_lib.compute_dtypes(lambda p: loss_fn(p, sinks, batch), params))
    (loss_sum, (tokens, fwd_stats)), (grads, sink_grads) = jax.value_and_grad(
        lambda x, s, b: loss_fn(rebuild(x), s, b), argnums=(0, 1), has_aux=True)(
            inputs, sinks, batch)
    grads = jax.lax.optimization_barrier(grads)   # see compute_dtype_grad_fn
    return (loss_sum, tokens), grads, {"fwd": fwd_stats, "bwd": sink_grads}
  return grad_fn


# Whether the gradients leave the backward through an optimization barrier: "auto" (the
# default) where the layers are scanned, "always", "never". INFIR2_GRAD_BARRIER, for A/B runs.
GRAD_BARRIER = os.environ.get("INFIR2_GRAD_BARRIER", "auto")
GRAD_BARRIERS = ("auto", "always", "never")


def _grad_barrier(model: nn.Module) -> bool:
  if GRAD_BARRIER not in GRAD_BARRIERS:
    raise ValueError(f"INFIR2_GRAD_BARRIER={GRAD_BARRIER!r}: one of {GRAD_BARRIERS}")
  if GRAD_BARRIER != "auto":
    return GRAD_BARRIER == "always"
  return getattr(getattr(model, "config", None), "scan_layers", True)


def compute_dtype_grad_fn(model: nn.Module) -> Callable:
  """(params, batch) -> ((loss_sum, tokens), grads), each gradient in the dtype the model
  casts its param to where that is exact (train/grads.py), else in the param's dtype.

  Scanned layers' gradients leave through an optimization barrier: without it XLA fuses the
  later conversion to float32 into the fusions that unstack them (the 7B's), and the float32
  copies are back. Unrolled layers' gradients leave without one, so that XLA fuses into the
  optimizer's update what the barrier made a pass of its own (session 32, deviceless at 1.5B:
  309 kernels and 4.5 GB fewer, the same allocation): the gate | up wgrad's slicing into
  the two params' gradients, the q/k/v wgrad's, the sum of the tied embedding's two
  gradients (a float32 [V, D] written and read again), the global norm's 112 reductions.
  """
  loss_fn = lambda p, b: loss_sums(model, p, b)
  barrier = _grad_barrier(model)

  def grad_fn(params, batch):
    inputs, rebuild = _differentiable(params, grads_lib.compute_dtypes(loss_fn, params, batch))
    sums, grads = jax.value_and_grad(lambda x, b: loss_fn(rebuild(x), b), has_aux=True)(
        inputs, batch)
    return sums, (jax.lax.optimization_barrier(grads) if barrier else grads)
  return grad_fn


def make_train_step(model: nn.Module, optimizer: optax.GradientTransformation,
                    schedule: optax.Schedule, grad_accum_steps: int = 1,
                    telemetry_model: nn.Module | None = None,
                    apply: optim.Apply | None = None) -> Callable:
  """Builds train_step(state, batch) -> (state, metrics). Jit it with donated state.

  Gradients are of the summed token loss, divided once by the total number of loss tokens
  over all micro-batches: exact per-token averaging however the mask falls (SFT), which
  averaging per-micro-batch means (optax.MultiSteps) would not give.

  Memory: each gradient comes out of the backward pass in the dtype the model computes with
  (bf16) wherever its float32 value would only be that bf16 value converted (train/grads.py),
  and becomes float32 inside the optimizer's update. Before, XLA kept a float32 copy of every
  gradient until the global norm had seen them all (4 bytes per parameter; the 7B's
  scanned layers unstack theirs into float32 buffers). Micro-batches still accumulate in
  float32 (a bf16 sum would round): one float32 sum plus one micro-batch's bf16 gradients.

  With `telemetry_model` (the same model built with a telemetry dot_general factory) the step
  is train_step(state, batch, sinks) and metrics["fp8"] holds the FP8 numerics of the first
  micro-batch (precision.telemetry.summarize turns it into scalars). Use it every N steps.

  `apply` takes the gradient sums to new params and optimizer state (optim.make_apply: the
  fused fp8 step reads the sums as they are, with no float32 gradients in memory); by
  default optim.generic_apply(optimizer).
  """
  apply = apply or optim.generic_apply(optimizer)
  grad_fn = compute_dtype_grad_fn(model)
  telemetry_grad_fn = telemetry_model and _telemetry_grad_fn(telemetry_model)

  def train_step(state: State, batch: Batch, sinks=None):
    params = state["params"]
    microbatches = split_microbatches(batch, grad_accum_steps)
    first = jax.tree.map(lambda x: x[0], microbatches)
    fp8_stats = None
    if telemetry_grad_fn is not None:
      (loss_sum, num_tokens), grad_sums, fp8_stats = telemetry_grad_fn(params, sinks, first)
    else:
      (loss_sum, num_tokens), grad_sums = grad_fn(params, first)
    as_param = lambda g, p: g.astype(p.dtype)
    if grad_accum_steps > 1:
      def accumulate(carry, microbatch):
        (loss_sum, num_tokens), grads = grad_fn(params, microbatch)
        acc_loss, acc_tokens, acc_grads = carry
        return (acc_loss + loss_sum, acc_tokens + num_tokens,
                jax.tree.map(lambda a, g: a + g.astype(a.dtype), acc_grads, grads)), None
      rest = jax.tree.map(lambda x: x[1:], microbatches)
      (loss_sum, num_tokens, grad_sums), _ = jax.lax.scan(
          accumulate, (loss_sum, num_tokens, jax.tree.map(as_param, grad_sums, params)), rest)
    denom = jnp.maximum(num_tokens, 1.0)
    new_params, opt_state, grad_norm = apply(grad_sums, denom, state["opt_state"], params)
    new_state = {"step": state["step"] + 1, "params": new_params, "opt_state": opt_state}
    metrics = {"loss": loss_sum / denom, "grad_norm": grad_norm,
               "lr": schedule(state["step"]), "loss_tokens": num_tokens}
    if fp8_stats is not None:
      metrics["fp8"] = fp8_stats
    return new_state, metrics

  return train_step


def make_eval_step(model: nn.Module) -> Callable:
  """eval_step(params, batch) -> (loss_sum, num_tokens); sum over batches, then divide."""
  def eval_step(params, batch: Batch):
    return loss_sums(model, params, batch)
  return eval_step
