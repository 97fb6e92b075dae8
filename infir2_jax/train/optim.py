"""optax AdamW on the float32 master parameters, with WSD / cosine / constant schedules."""

import jax
import jax.numpy as jnp
import optax

from infir2_jax.config import OptConfig


def make_schedule(cfg: OptConfig, total_steps: int) -> optax.Schedule:
  """Learning rate as a function of the optimizer step."""
  warmup = min(cfg.warmup_steps, total_steps)
  final_lr = cfg.lr * cfg.min_lr_ratio
  if cfg.schedule == "cosine":
    return optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, warmup, max(total_steps, warmup + 1), end_value=final_lr)
  warmup_fn = optax.linear_schedule(0.0, cfg.lr, max(warmup, 1))
  if cfg.schedule == "constant":
    return optax.join_schedules([warmup_fn, optax.constant_schedule(cfg.lr)], [warmup])
  decay_steps = max(int(round(total_steps * cfg.decay_fraction)), 1)
  stable_steps = max(total_steps - warmup - decay_steps, 0)
  return optax.join_schedules(
      [warmup_fn, optax.constant_schedule(cfg.lr),
       optax.linear_schedule(cfg.lr, final_lr, decay_steps)],
      [warmup, warmup + stable_steps])


def decay_mask(params):
  """Weight decay on matrices only: norms' scales and biases (1-D) are left alone."""
  return jax.tree.map(lambda p: jnp.ndim(p) >= 2, params)


def make_optimizer(cfg: OptConfig, total_steps: int) -> optax.GradientTransformation:
  """Global-norm clipping then AdamW; all state float32 like the master parameters."""
  schedule = make_schedule(cfg, total_steps)
  adamw = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                      weight_decay=cfg.weight_decay, mask=decay_mask)
  if cfg.clip_norm > 0:
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), adamw)
  return adamw
