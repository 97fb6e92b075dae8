"""The device mesh, the logical-axis rules that map the model's axes onto it, batch placement."""

import dataclasses
import logging
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from infir2_jax.errors import ConfigError

MESH_AXES = ("data", "fsdp", "tensor")
FP8_ALIGNMENT_MODES = ("error", "warn", "off")

Rules = tuple[tuple[str, Any], ...]

# Parallelism is JAX's own SPMD: params carry logical axis names (vocab, embed, heads,
# kv_heads, mlp, norm), key activations (batch, length, act_embed, act_heads, act_mlp), and
# these rules map them onto the mesh axes; jit + NamedSharding does the rest.
#   data    batch rows split, params replicated.
#   fsdp    batch rows split AND params / grads / Adam moments split along the model width
#           (each kernel gathered right before its GEMM: compute_axes).
#   tensor  Megatron-style: attention heads, the MLP hidden width and the vocabulary split;
#           KV heads replicated when the degree does not divide them (logical_rules).
# jax.make_mesh puts the innermost axis (tensor) on neighbouring devices: with 8 GPUs per node,
# tensor x fsdp <= 8 stays on NVLink and data spreads over nodes.
DEFAULT_RULES: Rules = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("norm", None),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),  # K and V activations; follows kv_heads
    ("act_mlp", "tensor"),
)


def _parse_rule(entry: str) -> tuple[str, Any]:
  """'logical=axis[+axis]' (or 'logical=' for replicated) -> (logical, mesh axes)."""
  if not isinstance(entry, str) or "=" not in entry:
    raise ConfigError(f"mesh.rules entry {entry!r} must look like 'logical=axis[+axis]' "
                      "(e.g. 'embed=fsdp', 'batch=data+fsdp', 'vocab=' to replicate)")
  name, axes = (s.strip() for s in entry.split("=", 1))
  mesh_axes = tuple(a.strip() for a in axes.split("+") if a.strip())
  for a in mesh_axes:
    if a not in MESH_AXES:
      raise ConfigError(f"mesh.rules entry {entry!r}: unknown mesh axis {a!r}; valid: {MESH_AXES}")
  if name not in dict(DEFAULT_RULES):
    raise ConfigError(f"mesh.rules entry {entry!r}: unknown logical axis {name!r}; valid: "
                      f"{[n for n, _ in DEFAULT_RULES]}")
  return name, None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  data: int = -1     # data-parallel degree; -1 fills the remaining devices
  fsdp: int = 1      # fully-sharded data parallel degree (params, grads, optimizer state)
  tensor: int = 1    # tensor-parallel degree (heads / MLP hidden / vocab)
  rules: tuple[str, ...] = ()  # overrides of DEFAULT_RULES: "logical=axis[+axis]" or "logical="
  # FP8 block/tile scaling with a sharded GEMM operand whose shards do not split on tile
  # boundaries (128): "error" at start-up, "warn" (XLA then gathers before quantizing), "off".
  fp8_alignment: str = "error"

  def __post_init__(self):
    sizes = (self.data, self.fsdp, self.tensor)
    if sum(s == -1 for s in sizes) > 1:
      raise ConfigError(f"at most one of mesh.data/fsdp/tensor may be -1, got {sizes}")
    if any(s == 0 or s < -1 for s in sizes):
      raise ConfigError(f"mesh sizes must be positive or -1, got {sizes}")
    if isinstance(self.rules, str):
      raise ConfigError(f"mesh.rules={self.rules!r} must be a tuple of 'logical=axis' strings")
    object.__setattr__(self, "rules", tuple(self.rules))
    for entry in self.rules:
      _parse_rule(entry)
    if self.fp8_alignment not in FP8_ALIGNMENT_MODES:
      raise ConfigError(f"mesh.fp8_alignment={self.fp8_alignment!r}; valid: {FP8_ALIGNMENT_MODES}")

  def shape(self, num_devices: int) -> tuple[int, int, int]:
    sizes = [self.data, self.fsdp, self.tensor]
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
      if num_devices % known:
        raise ConfigError(f"mesh {dict(zip(MESH_AXES, sizes))} cannot fill {num_devices} devices")
      sizes[sizes.index(-1)] = num_devices // known
    if math.prod(sizes) != num_devices:
      raise ConfigError(f"mesh {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices, "
                        f"but {num_devices} are available")
    return tuple(sizes)


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A (data, fsdp, tensor) mesh with Auto axes: shardings come from the logical rules and the
  compiler propagates the rest (GSPMD), rather than JAX's explicit-sharding mode.

  `devices` may be compile-only devices (jax.experimental.topologies) for AOT compilation.
  """
  devices = list(jax.devices() if devices is None else devices)
  try:
    shape = cfg.shape(len(devices))
  except ConfigError as e:
    if devices[0].platform != "cpu":
      raise
    raise ConfigError(f"{e}; on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N in "
                      "the environment of the command gives it N CPU devices") from None
  auto = (AxisType.Auto,) * len(MESH_AXES)
  if devices == list(jax.devices()):
    return jax.make_mesh(shape, MESH_AXES, axis_types=auto, devices=devices)
  return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=auto)


def as_axes(axes: "str | Sequence[str] | None") -> tuple[str, ...]:
  """A rule's or PartitionSpec entry's mesh axes as a tuple (() = replicated)."""
  if axes is None:
    return ()
  return (axes,) if isinstance(axes, str) else tuple(axes)


def mesh_axes_of(rules: Rules, logical: str) -> tuple[str, ...]:
  """The mesh axes a logical axis maps to under `rules` (() = replicated)."""
  return as_axes(dict(rules).get(logical))


def ways(mesh: Mesh, axes: Sequence[str]) -> int:
  """Number of shards along mesh `axes`."""
  return math.prod(mesh.shape[a] for a in axes)


def logical_rules(cfg: MeshConfig, model_cfg=None, mesh: Mesh | None = None) -> Rules:
  """DEFAULT_RULES with the config's overrides, adapted to the model when it is given.

  With `model_cfg` and `mesh`: KV heads are replicated (rule dropped) when their mesh degree
  does not divide model.num_kv_heads (grouped-query attention with fewer KV heads than the
  tensor degree, Megatron's choice); query heads that do not split evenly are an error.
  """
  rules = dict(DEFAULT_RULES)
  rules.update(_parse_rule(entry) for entry in cfg.rules)
  if model_cfg is not None and mesh is not None:
    kv_ways = ways(mesh, mesh_axes_of(tuple(rules.items()), "kv_heads"))
    if model_cfg.num_kv_heads % kv_ways:
      logging.info("replicating the %d KV heads over the %d-way %s axis (not divisible)",
                   model_cfg.num_kv_heads, kv_ways, rules["kv_heads"])
      rules["kv_heads"] = rules["act_kv_heads"] = None
    head_ways = ways(mesh, mesh_axes_of(tuple(rules.items()), "heads"))
    if model_cfg.num_heads % head_ways:
      raise ConfigError(
          f"model.num_heads={model_cfg.num_heads} does not split over the {head_ways}-way "
          f"mesh axes {rules['heads']} (tensor parallelism splits whole heads); choose "
          f"mesh.tensor among the divisors of {model_cfg.num_heads}")
  return tuple(rules.items())


def batch_sharding(mesh: Mesh, rules: Rules | None = None) -> NamedSharding:
  """Sharding of [B, L] batch arrays: rows over the rules' batch axes (data, fsdp)."""
  rules = DEFAULT_RULES if rules is None else rules
  batch = mesh_axes_of(rules, "batch") or None
  length = mesh_axes_of(rules, "length") or None
  return NamedSharding(mesh, P(batch, length))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def data_process_index(mesh: Mesh, rules: Rules | None = None) -> tuple[int, int]:
  """(index, count) to give the data pipeline: which slice of the global batch rows this
  process must load, out of how many distinct slices.

  Equals (jax.process_index(), jax.process_count()) when every process holds different rows;
  processes whose devices hold the same rows (e.g. tensor parallelism across processes, one
  process per GPU) get the same index and must load the same rows.
  """
  rules = DEFAULT_RULES if rules is None else rules
  spec = P(mesh_axes_of(rules, "batch") or None)
  shards = ways(mesh, mesh_axes_of(rules, "batch"))
  index_map = NamedSharding(mesh, spec).devices_indices_map((shards,))
  shards_of_process: dict[int, set[int]] = {}
  for device, (rows,) in index_map.items():
    shards_of_process.setdefault(device.process_index, set()).update(
        range(*rows.indices(shards)))
  return process_slice(shards_of_process, shards, jax.process_index())


def process_slice(shards_of_process: dict[int, set[int]], num_shards: int,
                  process: int) -> tuple[int, int]:
  """`process`'s (index, count) given which batch shards each process's devices hold."""
  mine = sorted(shards_of_process[process])
  per = len(mine)
  if mine != list(range(mine[0], mine[0] + per)) or mine[0] % per:
    raise ValueError(f"process {process} holds batch shards {mine} of {num_shards}: not an "
                     "aligned contiguous block; order the mesh so each process's devices "
                     "hold neighbouring rows")
  for p, shards in shards_of_process.items():
    if len(shards) != per or (shards != set(mine) and shards & set(mine)):
      raise ValueError(f"processes {process} and {p} hold overlapping but different batch "
                       f"shards ({mine} vs {sorted(shards)}); the data pipeline cannot split "
                       "rows this way")
  return mine[0] // per, num_shards // per
