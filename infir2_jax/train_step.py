"""The pure training and evaluation steps: (state, batch) -> (state, metrics)."""

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from infir2_jax.loss import cross_entropy_sums

Batch = dict[str, jax.Array]   # inputs, targets, segment_ids, positions, loss_mask: [B, L]
State = dict[str, Any]         # step, params, opt_state


def loss_sums(model: nn.Module, params, batch: Batch) -> tuple[jax.Array, jax.Array]:
  """(sum of token losses, number of loss tokens) of one (micro-)batch."""
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


def make_train_step(model: nn.Module, optimizer: optax.GradientTransformation,
                    schedule: optax.Schedule, grad_accum_steps: int = 1) -> Callable:
  """Builds train_step(state, batch) -> (state, metrics). Jit it with donated state.

  Gradients are of the summed token loss, divided once by the total number of loss tokens
  over all micro-batches: exact per-token averaging however the mask falls (SFT), which
  averaging per-micro-batch means (optax.MultiSteps) would not give.
  """
  grad_fn = jax.value_and_grad(lambda p, b: loss_sums(model, p, b), has_aux=True)

  def train_step(state: State, batch: Batch):
    params = state["params"]
    if grad_accum_steps == 1:
      (loss_sum, num_tokens), grad_sums = grad_fn(params, batch)
    else:
      def accumulate(carry, microbatch):
        (loss_sum, num_tokens), grads = grad_fn(params, microbatch)
        acc_loss, acc_tokens, acc_grads = carry
        return (acc_loss + loss_sum, acc_tokens + num_tokens,
                jax.tree.map(jnp.add, acc_grads, grads)), None
      zeros = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32),
               jax.tree.map(jnp.zeros_like, params))
      (loss_sum, num_tokens, grad_sums), _ = jax.lax.scan(
          accumulate, zeros, split_microbatches(batch, grad_accum_steps))
    denom = jnp.maximum(num_tokens, 1.0)
    grads = jax.tree.map(lambda g: g / denom, grad_sums)
    updates, opt_state = optimizer.update(grads, state["opt_state"], params)
    new_state = {"step": state["step"] + 1, "params": optax.apply_updates(params, updates),
                 "opt_state": opt_state}
    metrics = {"loss": loss_sum / denom, "grad_norm": optax.global_norm(grads),
               "lr": schedule(state["step"]), "loss_tokens": num_tokens}
    return new_state, metrics

  return train_step


def make_eval_step(model: nn.Module) -> Callable:
  """eval_step(params, batch) -> (loss_sum, num_tokens); sum over batches, then divide."""
  def eval_step(params, batch: Batch):
    return loss_sums(model, params, batch)
  return eval_step
