"""Sharded train state: NamedShardings from logical axes, abstract-first init, golden specs."""

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from infir2_jax.parallel.mesh import Rules, as_axes, mesh_axes_of, replicated, ways


def _param_spec_problems(abstract_boxed_params, mesh: Mesh, rules: Rules) -> list[str]:
  problems = []
  flat = jax.tree_util.tree_flatten_with_path(
      abstract_boxed_params, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))[0]
  for path, leaf in flat:
    if not isinstance(leaf, nn.LogicallyPartitioned):
      continue
    for dim, name in zip(leaf.value.shape, leaf.names):
      n = ways(mesh, mesh_axes_of(rules, name)) if name else 1
      if dim % n:
        problems.append(f"{path_str(path)} {tuple(leaf.value.shape)}: dimension {name!r} of "
                        f"size {dim} does not split {n} ways over mesh axes "
                        f"{mesh_axes_of(rules, name)}")
  return problems


def param_shardings(abstract_boxed_params, mesh: Mesh, rules: Rules) -> Any:
  """NamedShardings for params from their logical axis names (LogicallyPartitioned boxes).

  Raises ValueError naming each param whose sharded dimension does not split evenly.
  """
  problems = _param_spec_problems(abstract_boxed_params, mesh, rules)
  if problems:
    raise ValueError(f"mesh {dict(mesh.shape)} cannot shard these params evenly (change "
                     "mesh.* or override the rule with mesh.rules):\n  " + "\n  ".join(problems))
  specs = nn.get_partition_spec(abstract_boxed_params)
  return nn.logical_to_mesh_sharding(specs, mesh, rules)


def fit_sharding(leaf, sharding: NamedSharding) -> NamedSharding:
  """A param's sharding for an optimizer-state leaf at that param's place: as it is where the
  leaf splits evenly (Adam's moments, of the param's shape); another shape (the per-group
  scales of FP8 moments, train/moments.py) keeps the mesh axes on the dims they split
  evenly and is replicated on the others."""
  spec = tuple(sharding.spec)[:leaf.ndim]
  spec += (None,) * (leaf.ndim - len(spec))
  fitted = tuple(axes if dim % ways(sharding.mesh, as_axes(axes)) == 0 else None
                 for dim, axes in zip(leaf.shape, spec))
  return sharding if fitted == spec else NamedSharding(sharding.mesh, P(*fitted))


def state_shardings(abstract_boxed_params, optimizer: optax.GradientTransformation,
                    mesh: Mesh, rules: Rules) -> dict[str, Any]:
  """Shardings of {"step", "params", "opt_state"}: Adam moments follow their params."""
  params = param_shardings(abstract_boxed_params, mesh, rules)
  abstract_opt_state = jax.eval_shape(optimizer.init, nn.unbox(abstract_boxed_params))
  opt_state = optax.tree_map_params(
      optimizer, fit_sharding, abstract_opt_state, params,
      transform_non_params=lambda _: replicated(mesh))
  return {"step": replicated(mesh), "params": params, "opt_state": opt_state}


def _init_state_fn(init_params: Callable[[jax.Array], Any], optimizer):
  def init_state(rng):
    params = nn.unbox(init_params(rng))
    return {"step": np.int32(0), "params": params, "opt_state": optimizer.init(params)}
  return init_state


def abstract_state(init_params: Callable[[jax.Array], Any], optimizer, mesh: Mesh,
                   rules: Rules, rng: jax.Array | None = None):
  """(ShapeDtypeStructs with shardings of the train state, the shardings); no allocation.

  For golden partition specs, ahead-of-time compilation and restoring checkpoints.
  """
  rng = jax.random.key(0) if rng is None else rng
  shardings = state_shardings(jax.eval_shape(init_params, rng), optimizer, mesh, rules)
  shapes = jax.eval_shape(_init_state_fn(init_params, optimizer), rng)
  structs = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                         shapes, shardings)
  return structs, shardings


def sharded_init(init_params: Callable[[jax.Array], Any], optimizer, mesh: Mesh, rules: Rules,
                 rng: jax.Array):
  """Abstract-first init: shapes and shardings first, then one jit that builds state in place.

  `init_params(rng)` returns boxed (LogicallyPartitioned) params. Returns (state, shardings);
  no device ever holds an unsharded copy.
  """
  abstract_boxed = jax.eval_shape(init_params, rng)
  shardings = state_shardings(abstract_boxed, optimizer, mesh, rules)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    state = jax.jit(_init_state_fn(init_params, optimizer), out_shardings=shardings)(rng)
  return state, shardings


def path_str(path) -> str:
  """"a/b/0"-style name of a pytree key path."""
  parts = []
  for key in path:
    for attr in ("key", "name", "idx"):
      if hasattr(key, attr):
        parts.append(str(getattr(key, attr)))
        break
    else:
      parts.append(str(key))
  return "/".join(parts)


def spec_table(shardings, shapes=None) -> dict[str, dict[str, Any]]:
  """{path: {"spec": [...], "shape": [...], "dtype": str}} of a tree of NamedShardings, as
  JSON-able values (golden files). `shapes`: a matching tree of arrays / ShapeDtypeStructs."""
  table = {}
  flat = jax.tree_util.tree_flatten_with_path(shardings)[0]
  shape_leaves = [None] * len(flat) if shapes is None else jax.tree.leaves(shapes)
  for (path, sharding), shape in zip(flat, shape_leaves):
    spec = [list(a) if isinstance(a, tuple) else a for a in sharding.spec]
    entry = {"spec": spec}
    if shape is not None:
      spec += [None] * (len(shape.shape) - len(spec))  # P("x") == P("x", None)
      entry.update(shape=list(shape.shape), dtype=str(shape.dtype))
    table[path_str(path)] = entry
  return table
