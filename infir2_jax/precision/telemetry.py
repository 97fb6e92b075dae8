"""FP8 numerics telemetry inside a pure jitted train step: per layer and GEMM role, the amax,
flush-to-zero fraction and quantization SNR of every quantized operand, forward AND backward.

How it works, with no host callbacks:
- fprop stats: the telemetry dot_general is a linen Module that `sow`s a [2, 3] array
  ((x, w) x (amax, flush_frac, snr_db)) into the STATS collection ("fp8_stats").
- dgrad/wgrad stats: each such Module owns a zero "sink" variable [2, 2, 3] in the SINKS
  collection ("fp8_sinks"), fed to the custom_vjp as an extra input; its backward pass
  returns the stats as the sink's cotangent, so `jax.grad` w.r.t. the sinks yields
  ((dgrad: dy, w), (wgrad: x, dy)) x (amax, flush_frac, snr_db).
Telemetry off = the plain factory: no Module, no variable, no extra op in the jaxpr.

Train step (the lead's side):
    model_t = Qwen2(cfg, make_dot_general_factory(precision_cfg, telemetry=True))
    sinks = telemetry.init_sinks(model_t, rng, tokens)            # once, zeros
    def loss_fn(params, sinks):
      logits, state = model_t.apply({"params": params, SINKS: sinks}, tokens,
                                    mutable=[STATS])
      return loss(logits), state[STATS]
    (loss, fstats), (grads, sink_grads) = jax.value_and_grad(
        loss_fn, argnums=(0, 1), has_aux=True)(params, sinks)
    ... later, on the host: metrics |= telemetry.summarize(fstats, sink_grads)
Run this variant (a second jitted step) only every telemetry_every_steps steps. With gradient
accumulation the sink cotangents add up over microbatches: divide, or take one microbatch.
"""

from collections.abc import Mapping
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from infir2_jax.precision import fp8_attention, quant_error
from infir2_jax.precision.dot_general import FPROP_STATS_SHAPE, SINK_SHAPE, quantized_dot_general
from infir2_jax.precision.recipes import AttentionSpec, Recipe

STATS = "fp8_stats"
SINKS = "fp8_sinks"
MODULE_PREFIX = "fp8_"
ROLES = {"fprop": ("x", "w"), "dgrad": ("dy", "w"), "wgrad": ("x", "dy"),
         "attention": fp8_attention.OPERANDS}
ATTENTION_STATS_SHAPE = (len(fp8_attention.OPERANDS), len(quant_error.STAT_NAMES))


def module_name(path: str) -> str:
  """Name of the telemetry Module made for the projection at `path` ("fp8_q_proj")."""
  return MODULE_PREFIX + (path.rstrip("/").rsplit("/", 1)[-1] or "dot")


class TelemetryDotGeneral(nn.Module):
  """lax.dot_general-compatible Module running `recipe` and recording its numerics."""
  recipe: Recipe
  backend: str = "auto"

  @nn.compact
  def __call__(self, lhs, rhs, dimension_numbers, precision=None,
               preferred_element_type=None, **unused_kwargs):
    del precision, unused_kwargs
    sink = None
    if self.has_variable(SINKS, "bwd") or self.is_mutable_collection(SINKS):
      sink = self.variable(SINKS, "bwd", jnp.zeros, SINK_SHAPE, jnp.float32).value
    y, fstats = quantized_dot_general(lhs, rhs, dimension_numbers, preferred_element_type,
                                      recipe=self.recipe, backend=self.backend,
                                      telemetry=True, sink=sink)
    self.sow(STATS, "fprop", fstats, init_fn=lambda: None, reduce_fn=lambda _, new: new)
    return y


class TelemetryAttention(nn.Module):
  """fp8_attention.fp8_attention recording its forward's numerics: sows a [4, 3] array
  ((q, k, p, v) x (amax, flush_frac, snr_db)) into STATS as "attention". Its backward is
  BF16, so it has no sink."""
  spec: AttentionSpec

  def __call__(self, q_BxLxHxDh, k_BxLxKxDh, v_BxLxKxDh, segment_ids_BxL, backward=None):
    inputs = [jax.lax.stop_gradient(x) for x in (q_BxLxHxDh, k_BxLxKxDh, v_BxLxKxDh)]
    stats = fp8_attention.operand_stats(*inputs, segment_ids_BxL, self.spec)
    self.sow(STATS, "attention", stats, init_fn=lambda: None, reduce_fn=lambda _, new: new)
    return fp8_attention.fp8_attention(q_BxLxHxDh, k_BxLxKxDh, v_BxLxKxDh, segment_ids_BxL,
                                       self.spec, False, backward)


def init_sinks(model: nn.Module, *init_args, **init_kwargs):
  """Zero sinks for `model` (built with a telemetry factory), from an abstract init."""
  shapes = jax.eval_shape(lambda: model.init(*init_args, **init_kwargs))
  if SINKS not in shapes:
    raise ValueError(f"model has no {SINKS!r} collection: build it with "
                     "make_dot_general_factory(cfg, telemetry=True) and an FP8 recipe")
  return zeros_like_sinks(shapes[SINKS])


def zeros_like_sinks(tree):
  """Zeros with the shapes/dtypes of a sink tree (arrays or ShapeDtypeStructs)."""
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)


def _walk(tree, prefix=()):
  if isinstance(tree, Mapping):
    for key, value in tree.items():
      yield from _walk(value, prefix + (str(key),))
  elif tree is not None:
    yield prefix, tree


def _projection_path(keys: tuple[str, ...]) -> str:
  """(..., "q_proj", "fp8_q_proj", var) -> "…/q_proj"; a head at top level -> "lm_head"."""
  parents, module = list(keys[:-2]), keys[-2]
  label = module[len(MODULE_PREFIX):] if module.startswith(MODULE_PREFIX) else module
  if not parents or parents[-1] != label:
    parents.append(label)
  return "/".join(parents)


def _entries(tree, core_shape, roles, var):
  """Yields (path, role, [.., 3] stats) for every stats leaf named `var`, unstacking
  scanned layers."""
  for keys, value in _walk(tree):
    if keys[-1] != var:
      continue
    value = np.asarray(jax.device_get(value), np.float64)
    path = _projection_path(keys)
    lead = value.shape[:value.ndim - len(core_shape)]
    if value.shape[len(lead):] != core_shape:
      raise ValueError(f"telemetry leaf {'/'.join(keys)} has shape {value.shape}, "
                       f"expected (..., {core_shape})")
    for index in np.ndindex(*lead):
      # nn.scan stacks layers on a leading axis of the outermost module: "layers" -> layers_i.
      p = path
      if index:
        head, _, rest = path.partition("/")
        p = f"{head}_{'_'.join(map(str, index))}" + (f"/{rest}" if rest else "")
      v = value[index]
      for r, role in enumerate(roles):
        yield p, role, (v if len(roles) == 1 else v[r])


def summarize(fprop_stats, sink_grads=None, *, prefix: str = "fp8",
              worst: bool = True) -> dict[str, float]:
  """Host-side flat metrics from the STATS collection and the sinks' gradients.

  Keys: f"{prefix}/{path}/{role}/{operand}/{stat}", e.g.
  "fp8/layers_0/self_attn/q_proj/fprop/x/snr_db", "fp8/layers_0/mlp/down_proj/wgrad/dy/amax",
  and for FP8 attention "fp8/layers_0/self_attn/attention/p/flush_frac".
  With worst=True also f"{prefix}/worst/{role}/{operand}/{min_snr_db|max_flush_frac|max_amax}"
  over all layers.

  Args:
    fprop_stats: the "fp8_stats" collection (mutable output of apply), or None.
    sink_grads: the gradient w.r.t. the "fp8_sinks" collection, or None.
  """
  out: dict[str, float] = {}
  worst_acc: dict[tuple[str, str], list[np.ndarray]] = {}
  sources = [(fprop_stats, FPROP_STATS_SHAPE, ("fprop",), "fprop"),
             (fprop_stats, ATTENTION_STATS_SHAPE, ("attention",), "attention"),
             (sink_grads, SINK_SHAPE, ("dgrad", "wgrad"), "bwd")]
  for tree, shape, roles, var in sources:
    if tree is None:
      continue
    for path, role, v in _entries(tree, shape, roles, var):
      for o, operand in enumerate(ROLES[role]):
        for s, stat in enumerate(quant_error.STAT_NAMES):
          out[f"{prefix}/{path}/{role}/{operand}/{stat}"] = float(v[o, s])
        worst_acc.setdefault((role, operand), []).append(v[o])
  if worst:
    for (role, operand), rows in worst_acc.items():
      a = np.stack(rows)
      base = f"{prefix}/worst/{role}/{operand}"
      out[f"{base}/max_amax"] = float(np.max(a[:, 0]))
      out[f"{base}/max_flush_frac"] = float(np.max(a[:, 1]))
      out[f"{base}/min_snr_db"] = float(np.min(a[:, 2]))
  return out


def finite_only(metrics: Mapping[str, float]) -> dict[str, float]:
  """Drops +-inf entries (exact operands) for writers that reject them; NaN is kept."""
  return {k: v for k, v in metrics.items() if not math.isinf(v)}
