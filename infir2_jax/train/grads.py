"""Gradients in the compute dtype where that is exact: which params the model only casts.

The model keeps float32 master params but uses each one as p.astype(bfloat16). JAX then
returns the float32 gradient as a converted bfloat16 cotangent, and XLA materializes that
float32 copy: at 7B (scanned layers, one H200) it unstacks the layers' bf16 gradients into
float32 buffers, 4 bytes per parameter, all live until the optimizer has them (the global
norm needs every gradient before the first update).

`compute_dtypes(fn, params)` finds, from fn's jaxpr, the params whose gradient is a bf16
buffer by construction: used only through one cast to a narrower float, and that cast value
used once, through layout ops only, as an operand of a dot_general (its cotangent is a GEMM
output) or as a scanned-over input (model.scan_layers: the loop writes each layer's bf16
gradient). For those, differentiating with respect to the cast copy gives the same bits and
the float32 conversion can wait for the optimizer's fused update. Any other use keeps the
float32 gradient: a second cast (the LM head inside model.loss_chunk's scan), a sum of
contributions (the tied embedding), an elementwise or gather use (norm scales, biases and
the embedding outside a scan, whose bf16 cotangents XLA may keep in excess precision), or a
custom derivative, unless its backward is marked `cotangent_is_buffer`
(precision/cotangents.py: the FP8 projections, the fused FP8 MLP, the BF16 LM head with its
float32 logits, the fused LM head and loss).

A value that enters a shard_map (the FP8 projections per shard, precision/per_shard.py) is
followed into its body: the transpose sums each device's cotangent over the mesh axes the
value is replicated on in the cotangent's own dtype, so the bf16 gradient is that bf16 sum
whether or not it is converted to float32 afterwards (the same bits either way).
"""

from typing import Any

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np

from infir2_jax.precision import cotangents

# Call-like primitives whose derivative is their body's: follow a value into the body.
_CALLS = ("jit", "pjit", "closed_call", "core_call", "remat", "remat2", "checkpoint",
          "shard_map")
# Ops whose transpose moves a cotangent without summing or rounding it (a layout, a
# placement, or a slice of a stack).
_LAYOUT = ("sharding_constraint", "mesh_cast", "copy", "copy_p", "reshape", "squeeze",
           "expand_dims", "transpose", "stack", "concatenate")


def _uses(jaxpr) -> dict:
  uses: dict = {}
  for eqn in jaxpr.eqns:
    for i, v in enumerate(eqn.invars):
      if isinstance(v, jex.core.Var):
        uses.setdefault(v, []).append((eqn, i))
  for v in jaxpr.outvars:
    if isinstance(v, jex.core.Var):
      uses.setdefault(v, []).append((None, -1))
  return uses


def _scan_consts_and_carry(eqn) -> int:
  """How many of a scan's inputs are consts or carry (the rest are scanned over)."""
  if "num_consts" in eqn.params:
    return eqn.params["num_consts"] + eqn.params["num_carry"]
  consts, carry, _ = eqn.params["ft_in"].update(list(range(len(eqn.invars)))).unpack()
  return len(list(consts)) + len(list(carry))


def _body(eqn):
  body = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
  return getattr(body, "jaxpr", body)


class _Analysis:
  """The test on a jaxpr and its sub-jaxprs (their use maps built once)."""

  def __init__(self):
    self._uses: dict[int, tuple[Any, dict]] = {}

  def single_use(self, jaxpr, var):
    """(eqn, operand index) of var's only use, or None (unused, used twice, or returned)."""
    if id(jaxpr) not in self._uses:
      self._uses[id(jaxpr)] = (jaxpr, _uses(jaxpr))  # keep jaxpr alive: ids stay unique
    uses = self._uses[id(jaxpr)][1].get(var, [])
    return uses[0] if len(uses) == 1 and uses[0][0] is not None else None

  def _follow(self, jaxpr, var, at_use):
    """at_use(jaxpr, eqn, i) at var's single use, seen through calls; None if it has none."""
    use = self.single_use(jaxpr, var)
    if use is None:
      return None
    eqn, i = use
    body = _body(eqn) if eqn.primitive.name in _CALLS else None
    if body is not None and len(body.invars) == len(eqn.invars):
      return self._follow(body, body.invars[i], at_use)
    return at_use(jaxpr, eqn, i)

  def cast_dtype(self, jaxpr, var, dtype):
    """The dtype `var` is cast to if its single use is one cast to a float narrower than
    `dtype` and the cast value's gradient is a buffer of that dtype; else None."""
    def at_use(jaxpr, eqn, i):
      if eqn.primitive.name != "convert_element_type":
        return None
      new = jnp.dtype(eqn.params["new_dtype"])
      if not (jnp.issubdtype(new, jnp.floating) and new.itemsize < jnp.dtype(dtype).itemsize):
        return None
      return new if self.gradient_is_buffer(jaxpr, eqn.outvars[0]) else None
    return self._follow(jaxpr, var, at_use)

  def gradient_is_buffer(self, jaxpr, var) -> bool:
    """var's cotangent is written whole by one op: var is used once, through layout ops, as
    a dot_general operand, a scan's scanned-over input or an input of a custom derivative
    marked with cotangent_is_buffer."""
    def at_use(jaxpr, eqn, i):
      name = eqn.primitive.name
      if name == "dot_general":
        return True
      if name == "custom_vjp_call":
        return cotangents.is_marked(eqn)
      if name == "scan":   # a const or carry is read every iteration: a summed gradient
        return i >= _scan_consts_and_carry(eqn)
      size_kept = (name == "broadcast_in_dim" and
                   np.prod(eqn.outvars[0].aval.shape) == np.prod(eqn.invars[i].aval.shape))
      if name in _LAYOUT or size_kept:
        return self.gradient_is_buffer(jaxpr, eqn.outvars[0])
      return False
    return bool(self._follow(jaxpr, var, at_use))


def compute_dtypes(fn, params, *args) -> Any:
  """A tree like params: for each float leaf, the narrower float dtype its gradient is exact
  in (the module docstring's test on fn(params, *args)), else None. Traces fn once,
  abstractly (nothing runs)."""
  abstract = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
  closed = jax.make_jaxpr(fn)(abstract(params), *abstract(args))
  leaves, treedef = jax.tree.flatten(params)
  analysis = _Analysis()
  found = [analysis.cast_dtype(closed.jaxpr, var, leaf.dtype)
           if jnp.issubdtype(leaf.dtype, jnp.floating) else None
           for var, leaf in zip(closed.jaxpr.invars[:len(leaves)], leaves)]
  return treedef.unflatten(found)


def cast_to(params, dtypes) -> Any:
  """params with each leaf whose entry in `dtypes` is not None cast to it."""
  return jax.tree.map(lambda p, d: p if d is None else p.astype(d), params, dtypes,
                      is_leaf=lambda x: x is None)


@jax.custom_vjp
def _master_with_cast_gradient(p, delta):
  """p itself (the float32 master); its cotangent goes to delta, in delta's dtype."""
  del delta
  return p


def _master_fwd(p, delta):
  return p, jnp.zeros((), delta.dtype)   # only the dtype is kept


def _master_bwd(dtype_of_delta, ct):
  return None, ct.astype(dtype_of_delta.dtype)


_master_with_cast_gradient.defvjp(_master_fwd, _master_bwd)


def masters_with_cast_gradients(params, dtypes):
  """(inputs, rebuild): differentiate rebuild(inputs) instead of cast_to(params, dtypes).

  inputs holds, for each leaf with a dtype in `dtypes`, a zero "delta" of that dtype, whose
  value nothing reads (else the param itself); rebuild(inputs) gives back the float32
  masters themselves, each one's cotangent routed to its delta in the delta's dtype. The
  model casts each master where it uses it, as it does today, so values, losses and
  gradients are cast_to's bit for bit (the cast's transpose is convert(ct_bf16, float32),
  routed back as ct_bf16).

  Memory: with cast_to the whole tree's bf16 copy is the differentiated input, live from the
  forward's first use to the backward's last (under full remat the recomputed forward reads
  it again): 13.2 GiB at the 7B's peak. Here no copy outlives the layer that makes it, and
  the remat'd layers save the masters' own buffers. A plain `p + delta` does not do it: it is
  a new float32 value per param, which remat saves (session 30, NOTES_e2e)."""
  inputs = jax.tree.map(lambda p, d: p if d is None else jnp.zeros(p.shape, d), params,
                        dtypes, is_leaf=lambda x: x is None)

  def rebuild(inputs):
    return jax.tree.map(lambda p, d, x: x if d is None else _master_with_cast_gradient(p, x),
                        params, dtypes, inputs, is_leaf=lambda x: x is None)
  return inputs, rebuild
