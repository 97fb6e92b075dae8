"""Start-up check that FP8 tile/block scales never straddle a shard boundary."""

import dataclasses
import logging
import re
from collections.abc import Sequence

from jax.sharding import Mesh

from infir2_jax.errors import ConfigError
from infir2_jax.parallel import mesh as mesh_lib
from infir2_jax.precision.config import PrecisionConfig, resolve_recipe
from infir2_jax.precision.quantize import resolve_tile

# One projection y = x W of the model: (path, (K, N), (K axis, N axis)), the axes being the
# logical axes of W's compute copy (infir2_jax.model.params.projections lists them).
Projection = tuple[str, tuple[int, int], tuple[str | None, str | None]]

# With block/tile scaling (1x128 activation and gradient tiles, 128x128 weight blocks) each
# device can quantize its own shard, with no cross-shard amax, only when every sharded
# dimension of a quantized GEMM operand splits on multiples of the tile. Otherwise XLA has to
# gather the operand before quantizing it (the numbers stay right under jit, but the
# communication and memory grow). Whole-axis scales (per row, per tensor) need one small
# cross-shard max and are always accepted.
#
# Weights are checked in their compute layout: the model gathers a kernel over fsdp (in bf16)
# before the dot_general quantizes it (model.axes.compute_axes), so FSDP never splits a block;
# the tensor-parallel splits of heads / MLP hidden / vocab and the token split remain.
#
# The three GEMMs of a projection Y = X W (X [M, K] tokens x in, W [K, N]) in the recipes'
# NT form (recipes.py): fprop X [M, K] . W^T [N, K]; dgrad dY [M, N] . W [K, N];
# wgrad X^T [K, M] . dY^T [N, M]. M (tokens = rows x seq_len) splits like the batch, K and N of
# W, X and dY like the activation (compute) axes of the weight's logical axes.

# (gemm, operand) -> (the tensor it quantizes, its two dims in NT order).
_OPERANDS = {
    ("fprop", "lhs"): ("activation X", ("M", "K")),
    ("fprop", "rhs"): ("weight W", ("N", "K")),
    ("dgrad", "lhs"): ("gradient dY", ("M", "N")),
    ("dgrad", "rhs"): ("weight W", ("K", "N")),
    ("wgrad", "lhs"): ("activation X", ("K", "M")),
    ("wgrad", "rhs"): ("gradient dY", ("N", "M")),
}


@dataclasses.dataclass(frozen=True)
class _Dim:
  """One dimension of a GEMM operand as laid out on the mesh."""
  label: str          # e.g. "K=1536 (embed)"
  size: int
  axes: tuple[str, ...]
  ways: int
  block: int | None   # length of each device's contiguous run (None: unknown)


def _feature_dim(letter, size, logical, mesh, rules) -> _Dim:
  axes = mesh_lib.mesh_axes_of(rules, logical) if logical else ()
  n = mesh_lib.ways(mesh, axes)
  return _Dim(f"{letter}={size} ({logical})", size, axes, n, size // n if size % n == 0 else None)


def _token_dim(mesh, rules, batch_rows, seq_len) -> _Dim | None:
  if not batch_rows or not seq_len:
    return None
  batch_axes = mesh_lib.mesh_axes_of(rules, "batch")
  length_axes = mesh_lib.mesh_axes_of(rules, "length")
  nb, nl = mesh_lib.ways(mesh, batch_axes), mesh_lib.ways(mesh, length_axes)
  size = batch_rows * seq_len
  # Tokens are rows x positions flattened: a device holds runs of seq_len/nl tokens when the
  # sequence is split, else (rows/nb) whole rows.
  if batch_rows % nb or seq_len % nl:
    block = None
  else:
    block = seq_len // nl if nl > 1 else (batch_rows // nb) * seq_len
  return _Dim(f"M={size} (tokens: {batch_rows} rows x {seq_len})", size,
              batch_axes + length_axes, nb * nl, block)


def fp8_alignment_problems(projections: Sequence[Projection], mesh: Mesh, rules,
                           precision: PrecisionConfig, *, batch_rows: int | None = None,
                           seq_len: int | None = None) -> list[str]:
  """Every (projection, GEMM operand, dimension) whose FP8 tiles straddle shards.

  Args:
    projections: the model's projections with their weights' compute axes.
    mesh, rules: the mesh and logical rules of the run.
    precision: which recipe runs where (precision.resolve_recipe decides per path).
    batch_rows, seq_len: rows per (micro-)batch and tokens per row; the token dimension M is
      checked only when both are given.

  Returns:
    One line per problem, layers with identical problems merged ("layers_*/mlp/down_proj").
  """
  token = _token_dim(mesh, rules, batch_rows, seq_len)
  problems: dict[tuple[str, str], dict[str, None]] = {}  # (problem, path) -> gemms
  for path, (k, n), (k_axis, n_axis) in projections:
    recipe = resolve_recipe(precision, path)
    if recipe.is_bf16:
      continue
    dims = {"K": _feature_dim("K", k, k_axis, mesh, rules),
            "N": _feature_dim("N", n, n_axis, mesh, rules), "M": token}
    for (gemm, side), (tensor, dim_keys) in _OPERANDS.items():
      spec = getattr(recipe.gemms()[gemm], side)
      operand_dims = [dims[key] for key in dim_keys]
      if not spec.quantized or spec.tile is None or None in operand_dims:
        continue
      tile = resolve_tile(spec.tile, tuple(d.size for d in operand_dims))
      for dim, extent in zip(operand_dims, tile):
        if dim.ways == 1 or extent == dim.size:  # unsplit, or one scale over the whole axis
          continue
        if dim.block is None or dim.block % extent:
          shards = "uneven shards" if dim.block is None else f"shards of {dim.block}"
          t0, t1 = spec.tile
          problem = (f"{tensor} ({recipe.name}, {t0}x{t1} tiles: {extent} along {dim.label}) "
                     f"splits {dim.ways} ways over mesh axes {dim.axes} into {shards}, not "
                     f"a multiple of {extent}")
          problems.setdefault((problem, path), {})[gemm] = None
  merged: dict[tuple[str, str], list[str]] = {}
  for (problem, path), gemms in problems.items():
    where = re.sub(r"layers_\d+/", "layers_*/", path)
    merged.setdefault((problem, "+".join(gemms)), [])
    if where not in merged[(problem, "+".join(gemms))]:
      merged[(problem, "+".join(gemms))].append(where)
  return [f"{', '.join(paths)} [{gemms}]: {problem}"
          for (problem, gemms), paths in merged.items()]


def check_fp8_alignment(projections: Sequence[Projection], mesh: Mesh, rules,
                        precision: PrecisionConfig, *, batch_rows: int | None = None,
                        seq_len: int | None = None, mode: str = "error") -> list[str]:
  """Raises ValueError (mode "error"), logs a warning ("warn") or does nothing ("off") when
  an FP8 tile would straddle a shard boundary; returns the problems found."""
  if mode not in mesh_lib.FP8_ALIGNMENT_MODES:
    raise ConfigError(f"mode={mode!r}; valid: {mesh_lib.FP8_ALIGNMENT_MODES}")
  if mode == "off":
    return []
  problems = fp8_alignment_problems(projections, mesh, rules, precision,
                                    batch_rows=batch_rows, seq_len=seq_len)
  if not problems:
    return []
  message = (f"FP8 block/tile scaling needs every sharded dimension of a quantized GEMM "
             f"operand to split on tile boundaries, but with mesh {dict(mesh.shape)}:\n  "
             + "\n  ".join(problems)
             + "\nFix: pick mesh.* sizes that give multiples of 128 per shard, keep those "
             "layers in bf16 (precision.overrides), or set mesh.fp8_alignment='warn' to let "
             "XLA gather the operands before quantizing (slower, same numbers).")
  if mode == "error":
    raise ConfigError(message)
  logging.warning("%s", message)
  return problems
