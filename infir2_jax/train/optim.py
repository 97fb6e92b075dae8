"""optax AdamW on the float32 master parameters, with WSD / cosine / constant schedules.

Adam's moments are stored as opt.moments says: float32 (optax.adamw itself), or bf16 / FP8
through train/moments.py; the update is float32 either way.

make_optimizer is the optax transform (its init makes the state; checkpoints hold it).
make_apply is how the train step applies it: (grad_sums, denom, opt_state, params) ->
(new params, new opt_state, grad norm). Generically that is the gradients divided by denom in
float32, optimizer.update and optax.apply_updates; with opt.moments=fp8 and the Pallas kernel
(opt.moments_kernel pallas or auto) it is train/fp8_adam.py's fused step instead, which reads
the raw gradient sums and writes the params and moments in one pass: the same state tree,
the same numbers on the CPU.
"""

import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from infir2_jax.config import OptConfig
from infir2_jax.train import fp8_adam
from infir2_jax.train.moments import scale_by_adam_stored


def _decay_steps(cfg: OptConfig, total_steps: int) -> int:
  return max(int(round(total_steps * cfg.decay_fraction)), 1)


def schedule_length(cfg: OptConfig, total_steps: int) -> int:
  """The steps the schedule is laid out over: opt.schedule_steps, else the run's steps."""
  return cfg.schedule_steps or total_steps


def stable_end(cfg: OptConfig, total_steps: int) -> int | None:
  """The last step trained before the decay lowers the lr (wsd: warm-up + stable; cosine:
  the warm-up), None for the constant schedule. Steps are 1-based: step N trains with
  schedule(N - 1)."""
  length = schedule_length(cfg, total_steps)
  if cfg.schedule == "constant":
    return None
  if cfg.schedule == "cosine":
    return warmup_steps(cfg, length, warn=False) + 1
  return length - _decay_steps(cfg, length) + 1


def final_lr(cfg: OptConfig) -> float:
  return cfg.lr if cfg.schedule == "constant" else cfg.lr * cfg.min_lr_ratio


def warmup_steps(cfg: OptConfig, total_steps: int, warn: bool = True) -> int:
  """opt.warmup_steps, shortened (with a warning) where the run would not leave warm-up.

  The warm-up may take at most the steps before the decay: wsd keeps its last
  decay_fraction of the steps to decay, cosine keeps half the run to decay and constant half
  the run at its lr. Without this a run shorter than its warm-up (configs/default.py:smoke,
  20 steps against 30) ended at the peak lr.
  """
  limit = (total_steps - _decay_steps(cfg, total_steps) if cfg.schedule == "wsd"
           else total_steps // 2)
  limit = max(limit, 0)
  if cfg.warmup_steps <= limit or not warn:
    return min(cfg.warmup_steps, limit)
  warnings.warn(
      f"opt.warmup_steps={cfg.warmup_steps} does not fit a {total_steps}-step run with the "
      f"{cfg.schedule!r} schedule; warming up over {limit} steps instead (set "
      f"opt.warmup_steps <= {limit} to silence this)", UserWarning, stacklevel=2)
  return limit


def make_schedule(cfg: OptConfig, total_steps: int, warn: bool = True) -> optax.Schedule:
  """Learning rate as a function of the optimizer step (0-based: step N trains with
  schedule(N - 1)), laid out over schedule_length(); later steps keep the final lr."""
  total_steps = schedule_length(cfg, total_steps)
  warmup = warmup_steps(cfg, total_steps, warn)
  final_lr = cfg.lr * cfg.min_lr_ratio
  if cfg.schedule == "cosine":
    return optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, warmup, max(total_steps, warmup + 1), end_value=final_lr)
  warmup_fn = optax.linear_schedule(0.0, cfg.lr, max(warmup, 1))
  if cfg.schedule == "constant":
    return optax.join_schedules([warmup_fn, optax.constant_schedule(cfg.lr)], [warmup])
  decay_steps = _decay_steps(cfg, total_steps)
  stable_steps = max(total_steps - warmup - decay_steps, 0)
  return optax.join_schedules(
      [warmup_fn, optax.constant_schedule(cfg.lr),
       optax.linear_schedule(cfg.lr, final_lr, decay_steps)],
      [warmup, warmup + stable_steps])


def decay_mask(params):
  """Weight decay on matrices only: norms' scales and biases (1-D) are left alone."""
  return jax.tree.map(lambda p: jnp.ndim(p) >= 2, params)


def _adamw(cfg: OptConfig, schedule: optax.Schedule) -> optax.GradientTransformation:
  """AdamW with its moments stored as cfg.moments says (optax.adamw's chain for fp32)."""
  if cfg.moments == "fp32":
    return optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                       weight_decay=cfg.weight_decay, mask=decay_mask)
  if cfg.moments == "fp8":
    adam = fp8_adam.scale_by_adam_fp8(cfg.b1, cfg.b2, cfg.eps, kernel=cfg.moments_kernel)
  else:
    adam = scale_by_adam_stored(cfg.b1, cfg.b2, cfg.eps, moments=cfg.moments)
  return optax.chain(
      adam,
      optax.add_decayed_weights(cfg.weight_decay, decay_mask),
      optax.scale_by_learning_rate(schedule))


def make_optimizer(cfg: OptConfig, total_steps: int) -> optax.GradientTransformation:
  """Global-norm clipping then AdamW; float32 updates of the master parameters."""
  adamw = _adamw(cfg, make_schedule(cfg, total_steps))
  if cfg.clip_norm > 0:
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), adamw)
  return adamw


# (grad_sums, denom, opt_state, params) -> (new params, new opt_state, grad norm)
Apply = Callable[[Any, jax.Array, Any, Any], tuple[Any, Any, jax.Array]]
FUSED_KERNELS = ("pallas", "auto")   # opt.moments_kernel values that make_apply fuses (fp8)


def generic_apply(optimizer: optax.GradientTransformation) -> Apply:
  """Any optax transform's step: float32 gradients (the sums cast to the params' dtype,
  divided by the loss tokens), optimizer.update, optax.apply_updates; the norm is theirs."""
  def apply(grad_sums, denom, opt_state, params):
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype) / denom, grad_sums, params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, optax.tree.norm(grads)
  return apply


def make_apply(cfg: OptConfig, total_steps: int,
               optimizer: optax.GradientTransformation | None = None) -> Apply:
  """How the train step applies make_optimizer(cfg, total_steps): fused for fp8 moments with
  the Pallas kernel (pallas, or auto: Triton where lowered for CUDA, the jnp form elsewhere),
  else generic_apply(optimizer) (the one given, or make_optimizer's)."""
  if cfg.moments == "fp8" and cfg.moments_kernel in FUSED_KERNELS:
    return _fused_fp8_apply(cfg, make_schedule(cfg, total_steps, warn=False))
  return generic_apply(optimizer or make_optimizer(cfg, total_steps))


def _fused_fp8_apply(cfg: OptConfig, schedule: optax.Schedule) -> Apply:
  """make_optimizer's chain for fp8 moments as one fp8_adam.apply_adamw pass per param. The
  state is the chain's: (clip's, (Adam's, the decay mask's, the schedule's)), or without the
  clip's; the clip and the decay keep none that changes, the schedule's count advances."""
  clip = cfg.clip_norm > 0

  def apply(grad_sums, denom, opt_state, params):
    grad_norm = optax.tree.norm(   # a reduction XLA fuses: no float32 gradients in memory
        jax.tree.map(lambda g, p: g.astype(p.dtype) / denom, grad_sums, params))
    clip_state, (adam_state, decay_state, lr_state) = (opt_state if clip
                                                       else (None, opt_state))
    lr = jnp.array(-1 * schedule(lr_state.count), jnp.float32)   # scale_by_learning_rate's
    new_params, adam_state = fp8_adam.apply_adamw(
        cfg.moments_kernel, grad_sums, params, adam_state, denom=denom, g_norm=grad_norm,
        lr=lr, max_norm=cfg.clip_norm if clip else 0.0, weight_decay=cfg.weight_decay,
        decay_mask=decay_mask(params), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps)
    adamw_state = (adam_state, decay_state,
                   optax.ScaleByScheduleState(optax.safe_increment(lr_state.count)))
    return new_params, (clip_state, adamw_state) if clip else adamw_state, grad_norm
  return apply
