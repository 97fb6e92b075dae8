"""Tuning of the block-scaled GEMM: the frozen TuningConfig, measured defaults, fitting.

The measurements behind every default and constant here are in benchmarks/NOTES_kernels.md.
"""
import dataclasses

import jax.numpy as jnp

BLOCK = 128  # Scale block along K (and along N for 128x128 weight blocks).


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


@dataclasses.dataclass(frozen=True)
class TuningConfig:
  """Tile sizes and schedule of the kernel.

  Attributes:
    tile_m: rows per compute warpgroup; the CTA covers compute_wgs * tile_m rows.
    tile_n: columns per CTA (the compute warpgroups share the B tile).
    max_concurrent_steps: pipeline depth (shared-memory stages); an upper bound,
      lowered to what fits in shared memory.
    grid_minor_dim: "m" or "n": which output axis the persistent loop walks first.
    grid_tile_width: width of the snake-order tiles of the persistent loop.
    memory_registers: registers per thread of the TMA warpgroup.
    split_k: K splits (f32 partial outputs summed by XLA) for grids with too few
      tiles to fill the GPU, e.g. wgrad; None picks one by a cost model. Any split
      works: each takes ceil(K blocks / split_k) blocks, and the last one's overhang
      past K is read as zeros by TMA (its scales are zero-padded).
    epi_n: columns per epilogue store (None: tile_n, or narrower when that buys
      a deeper pipeline).
    cross_tile: one TMA pipeline across all tiles of a persistent CTA, so the
      memory warpgroup loads the next tile's first K blocks while the compute
      warpgroups finish (and store) the current one. Without it every tile
      starts with an empty pipeline, which costs most on short K (2 K blocks
      for the 1.5B's k/v dgrad). Needs a pipeline depth dividing the K blocks
      per tile and >= 2 tiles per CTA; None: on where that holds without a
      shallower pipeline (or K blocks per tile <= CROSS_TILE_MAX_K_STEPS).
    compute_wgs: compute warpgroups per CTA (1-3), each on its own tile_m rows. Each
      warpgroup waits for its wgmma before folding the partial sums in (serial
      promotion), so the tensor core idles unless another warpgroup's wgmma is queued:
      three keep it busier than two, at 2/3 of the registers each (enough for 64x128
      tiles, not for 192-wide ones).
    scales_first: load the K block's scale vectors from shared memory before issuing its
      wgmma rather than after waiting for it. With per-column (1x128 B) scales the loads
      and the products of row and column scales otherwise sit between the wgmma wait and
      the stage's release (183 of the wgrad loop's 263 SASS instructions,
      benchmarks/gemm_sass.py); the numbers are the same either way.
  """
  tile_m: int = 64
  tile_n: int = 128
  max_concurrent_steps: int = 4
  grid_minor_dim: str = "n"
  grid_tile_width: int = 8
  memory_registers: int = 40
  split_k: int | None = None
  epi_n: int | None = None
  cross_tile: bool | None = None
  compute_wgs: int = 2
  scales_first: bool = False

  def __post_init__(self):
    if self.tile_m != 64:
      raise ValueError(f"tile_m={self.tile_m}: only 64 (one wgmma M group) is supported")
    if self.tile_n % 64 or not 64 <= self.tile_n <= 256:
      raise ValueError(f"tile_n={self.tile_n}: must be 64, 128, 192 or 256")
    if self.max_concurrent_steps < 2:
      raise ValueError(f"max_concurrent_steps={self.max_concurrent_steps}: must be >= 2")
    if self.grid_minor_dim not in ("m", "n"):
      raise ValueError(f"grid_minor_dim={self.grid_minor_dim!r}: must be 'm' or 'n'")
    if self.split_k is not None and self.split_k < 1:
      raise ValueError(f"split_k={self.split_k}: must be None or >= 1")
    if self.epi_n is not None and (self.epi_n % 32 or self.tile_n % self.epi_n):
      raise ValueError(f"epi_n={self.epi_n}: must be a multiple of 32 dividing tile_n")
    if self.compute_wgs not in (1, 2, 3):
      raise ValueError(f"compute_wgs={self.compute_wgs}: must be 1, 2 or 3")

  @property
  def cta_m(self) -> int:
    return self.compute_wgs * self.tile_m


# The best two-warpgroup config of the sweep at 8192^3; default_config runs it with three
# compute warpgroups where the cost model says.
DEFAULT_CONFIG = TuningConfig(max_concurrent_steps=6, epi_n=64)
SMEM_BYTES = 232448  # Per-block shared memory on H100/H200 (227 KiB).


def split_k_blocks(k_blocks: int, split_k: int) -> int:
  """K blocks per split: ceil, the last split's overhang past K is read as zeros."""
  per = _cdiv(k_blocks, split_k)
  if (split_k - 1) * per >= k_blocks:
    raise ValueError(f"split_k={split_k} leaves the last split empty for {k_blocks} K blocks"
                     f" ({per} per split)")
  return per


def choose_split_k(m, n, k, config: TuningConfig, num_sms: int) -> int:
  """Split-K that minimizes modeled_time: waves of tiles plus the partials' traffic.

  Only splits dividing the K blocks are considered: a ragged split that the model preferred
  (one round of CTAs instead of two) measured no faster on the 1.5B's kv wgrad; ragged splits
  stay available as an explicit split_k.
  """
  return _best_split(m, n, k, config, num_sms)[0]


def modeled_time(m, n, k, config: TuningConfig, num_sms: int) -> float:
  """Seconds the cost model gives config on an [m, k] x [n, k] problem (best split-K)."""
  return _best_split(m, n, k, config, num_sms)[1]


# Mainloop speed per FLOP of three compute warpgroups over two (64x128 tiles each), fit to
# side-by-side runs on large shapes (1.13-1.17x).
COMPUTE_WGS_GAIN = {3: 1.15}


def _best_split(m, n, k, config: TuningConfig, num_sms: int,
                flops_per_s=1.1e15, bytes_per_s=3.5e12) -> tuple[int, float]:
  tiles = _cdiv(m, config.cta_m) * _cdiv(n, config.tile_n)
  kb = _cdiv(k, BLOCK)
  per_sm = flops_per_s * COMPUTE_WGS_GAIN.get(config.compute_wgs, 1.0) / num_sms
  best, best_t = 1, None
  for s in range(1, 17):
    per = _cdiv(kb, s)
    if s > 1 and (per < 4 or kb % s):
      continue
    rounds = _cdiv(tiles * s, num_sms)  # persistent CTAs: each takes this many items
    t = rounds * (2.0 * config.cta_m * config.tile_n * per * BLOCK) / per_sm
    if s > 1:
      t += 3 * s * m * n * 4 / bytes_per_s  # f32 partials: written, read, summed
    if best_t is None or t < best_t:
      best, best_t = s, t
  return best, best_t


HOPPER_SMS = 132  # H100 SXM and H200
WIDE_TILE_GAIN = 1.15  # long-K (wgrad) speed per FLOP of 64x192 warpgroup tiles over 64x128


def default_config(m: int, n: int, k: int, num_sms: int = HOPPER_SMS,
                   b_scale: str = "block", max_compute_wgs: int = 3) -> TuningConfig:
  """The measured-best config for an [m, k] x [n, k] problem on an H200.

  Short K (<= SHORT_K) stages the output in one 128-wide chunk per warpgroup (SHORT_K_CONFIG).

  Three compute warpgroups (192-row CTA tiles) run the mainloop faster per FLOP than two
  (COMPUTE_WGS_GAIN) but make 1.5x larger tiles, so the cost model (modeled_time: rounds of
  persistent tiles, split-K) picks between them: e.g. two on 16384x256x1536, where 172 tiles
  of 192 rows need as many rounds as 256 of 128 rows do. max_compute_wgs=2 keeps two
  (block_scaled_matmul's interpret mode does).

  64x192 warpgroup tiles win only on the wgrad GEMMs (b_scale "row": 1x128 tiles on both
  operands, K = tokens), and there only where their rounds of persistent tiles do not cost
  more than they gain: 192 is picked when 1.5 x its rounds < WIDE_TILE_GAIN x those of 128.
  With 128x128 weight blocks ("block") a 128-wide tile promotes with one scale per row while
  192 needs per-column scales, and 128 won every such shape. Grids with fewer 128-wide tiles
  than SMs keep 128 and split K. tests/test_kernels.py checks the rule against every shape
  where both widths were timed (benchmarks/results/gemm_h200_run1.json and
  gemm_h200_s8_variants.json).
  """
  if b_scale == "row" and k >= 16384:
    tiles_128 = _cdiv(m, 128) * _cdiv(n, 128)
    rounds_128 = _cdiv(tiles_128, num_sms)
    rounds_192 = _cdiv(_cdiv(m, 128) * _cdiv(n, 192), num_sms)
    if tiles_128 >= num_sms and 1.5 * rounds_192 < WIDE_TILE_GAIN * rounds_128:
      return TuningConfig(tile_n=192, max_concurrent_steps=4)
  two = SHORT_K_CONFIG if k <= SHORT_K else DEFAULT_CONFIG
  if max_compute_wgs < 3:
    return two
  three = dataclasses.replace(two, compute_wgs=3)  # fit_stages caps its depth (4 stages)
  return min((two, three), key=lambda c: modeled_time(m, n, k, c, num_sms))


# K <= 512 (2-4 K blocks per tile): the epilogue is a large share of each tile, and one
# 128-wide store per warpgroup beat two 64-wide ones on the 1.5B's k/v dgrad (K=256). The
# pipeline is as deep as the K blocks anyway (cross_tile), so the wider staging buffer
# costs no stage.
SHORT_K = 512
SHORT_K_CONFIG = TuningConfig(max_concurrent_steps=6, epi_n=128)


CROSS_TILE_MAX_K_STEPS = 24  # Short K: worth a shallower pipeline to carry it across tiles.


def _largest_divisor_at_most(n: int, cap: int) -> int:
  return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)


def resolve_cross_tile(config: TuningConfig, work_items: int, ctas: int,
                       k_steps: int) -> TuningConfig:
  """Decides config.cross_tile (None: auto) and sets a pipeline depth dividing k_steps.

  A pipeline carried from tile to tile needs (Pallas Mosaic GPU's pipeline_state) a depth
  that divides the steps of each tile; a CTA's first tile starts it and its last tile drains
  it, so each CTA needs two tiles or more.
  """
  depth = _largest_divisor_at_most(k_steps, config.max_concurrent_steps)
  possible = work_items >= 2 * ctas and depth >= 2
  if config.cross_tile is None:
    on = possible and (depth == min(config.max_concurrent_steps, k_steps)
                       or k_steps <= CROSS_TILE_MAX_K_STEPS)
  elif config.cross_tile and not possible:
    raise ValueError(f"{config}: cross_tile needs >= 2 tiles per CTA ({work_items} tiles for"
                     f" {ctas} CTAs) and a pipeline depth >= 2 dividing the {k_steps} K"
                     " steps per tile")
  else:
    on = config.cross_tile
  if not on:
    return dataclasses.replace(config, cross_tile=False)
  return dataclasses.replace(config, cross_tile=True, max_concurrent_steps=depth)


def _stage_bytes(config: TuningConfig) -> int:
  return (config.cta_m + config.tile_n) * (BLOCK + 4)  # fp8 A, B tiles + f32 scales


def _out_bytes(config: TuningConfig, epi_n: int, out_dtype) -> int:
  return config.compute_wgs * config.tile_m * epi_n * jnp.dtype(out_dtype).itemsize


SMEM_RESERVED = 2048  # barriers and alignment


def fit_stages(config: TuningConfig, out_dtype) -> TuningConfig:
  """Caps max_concurrent_steps (and narrows the epilogue) to fit shared memory."""
  stage = _stage_bytes(config)
  want = min(config.max_concurrent_steps, 5)
  widths = [config.epi_n] if config.epi_n else [config.tile_n, 64, 32]
  for epi_n in widths:
    fit = (SMEM_BYTES - SMEM_RESERVED - _out_bytes(config, epi_n, out_dtype)) // stage
    if fit >= want or epi_n == widths[-1]:
      break
  if fit < 2:
    raise ValueError(f"{config} does not fit in shared memory with out_dtype={out_dtype}")
  return dataclasses.replace(config, max_concurrent_steps=min(config.max_concurrent_steps, fit),
                             epi_n=epi_n)
