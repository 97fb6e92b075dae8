"""optax AdamW on the float32 master parameters, with WSD / cosine / constant schedules."""

import dataclasses

import jax
import jax.numpy as jnp
import optax


@dataclasses.dataclass(frozen=True)
class OptConfig:
  lr: float = 3e-3                 # peak learning rate
  schedule: str = "wsd"            # "wsd" (warm-up, stable, decay) | "cosine" | "constant"
  warmup_steps: int = 30           # linear warm-up from 0 to lr
  decay_fraction: float = 0.2      # wsd: last fraction of the steps decays linearly
  min_lr_ratio: float = 0.1        # final lr = lr * min_lr_ratio (wsd and cosine)
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  weight_decay: float = 0.1        # decoupled; never applied to norms or biases
  clip_norm: float = 1.0           # global-norm clipping (0 = off)

  def __post_init__(self):
    if self.schedule not in ("wsd", "cosine", "constant"):
      raise ValueError(f"opt.schedule={self.schedule!r}; valid: 'wsd', 'cosine', 'constant'")
    if self.lr <= 0:
      raise ValueError(f"opt.lr must be positive, got {self.lr}")
    if not 0.0 <= self.decay_fraction <= 1.0:
      raise ValueError(f"opt.decay_fraction must be in [0, 1], got {self.decay_fraction}")
    if self.warmup_steps < 0:
      raise ValueError(f"opt.warmup_steps must be >= 0, got {self.warmup_steps}")


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
