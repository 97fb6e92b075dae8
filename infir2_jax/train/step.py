"""The pure training and evaluation steps: (state, batch) -> (state, metrics)."""

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from infir2_jax.train.loss import chunked_cross_entropy_sums, cross_entropy_sums
from infir2_jax.precision import telemetry

Batch = dict[str, jax.Array]   # inputs, targets, segment_ids, positions, loss_mask: [B, L]
State = dict[str, Any]         # step, params, opt_state


def loss_sums(model: nn.Module, params, batch: Batch) -> tuple[jax.Array, jax.Array]:
  """(sum of token losses, number of loss tokens) of one (micro-)batch."""
  chunk = model.config.loss_chunk
  if chunk and chunk < batch["inputs"].shape[-1]:  # the head and loss a chunk at a time
    hidden_BxLxD = model.apply({"params": params}, batch["inputs"], batch["positions"],
                               batch["segment_ids"], return_hidden=True)
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
    (loss_sum, (tokens, fwd_stats)), (grads, sink_grads) = jax.value_and_grad(
        loss_fn, argnums=(0, 1), has_aux=True)(params, sinks, batch)
    return (loss_sum, tokens), grads, {"fwd": fwd_stats, "bwd": sink_grads}
  return grad_fn


def make_train_step(model: nn.Module, optimizer: optax.GradientTransformation,
                    schedule: optax.Schedule, grad_accum_steps: int = 1,
                    telemetry_model: nn.Module | None = None) -> Callable:
  """Builds train_step(state, batch) -> (state, metrics). Jit it with donated state.

  Gradients are of the summed token loss, divided once by the total number of loss tokens
  over all micro-batches: exact per-token averaging however the mask falls (SFT), which
  averaging per-micro-batch means (optax.MultiSteps) would not give.

  With `telemetry_model` (the same model built with a telemetry dot_general factory) the step
  is train_step(state, batch, sinks) and metrics["fp8"] holds the FP8 numerics of the first
  micro-batch (precision.telemetry.summarize turns it into scalars). Use it every N steps.
  """
  grad_fn = jax.value_and_grad(lambda p, b: loss_sums(model, p, b), has_aux=True)
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
    if grad_accum_steps > 1:
      def accumulate(carry, microbatch):
        (loss_sum, num_tokens), grads = grad_fn(params, microbatch)
        acc_loss, acc_tokens, acc_grads = carry
        return (acc_loss + loss_sum, acc_tokens + num_tokens,
                jax.tree.map(jnp.add, acc_grads, grads)), None
      rest = jax.tree.map(lambda x: x[1:], microbatches)
      (loss_sum, num_tokens, grad_sums), _ = jax.lax.scan(
          accumulate, (loss_sum, num_tokens, grad_sums), rest)
    denom = jnp.maximum(num_tokens, 1.0)
    grads = jax.tree.map(lambda g: g / denom, grad_sums)
    updates, opt_state = optimizer.update(grads, state["opt_state"], params)
    new_state = {"step": state["step"] + 1, "params": optax.apply_updates(params, updates),
                 "opt_state": opt_state}
    metrics = {"loss": loss_sum / denom, "grad_norm": optax.global_norm(grads),
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
