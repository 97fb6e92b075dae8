"""The Pallas Mosaic GPU body of the block-scaled GEMM; gemm.py builds and calls it.

Layout: a persistent grid of one CTA per SM walks the output tiles (x K splits). Each CTA
has config.compute_wgs compute warpgroups (WGs), each owning tile_m rows x tile_n columns of
the CTA tile, and one memory WG that streams A, B and the scale vectors with TMA.

Per K block a compute WG runs wgmma into a fresh partial accumulator, waits for it, and folds
it into its f32 accumulator with the block's per-row (and per-column) scale: serial
promotion. While one WG folds, the other WGs' wgmma keep the tensor core busy, which is why
a CTA has two or three compute WGs. Overlapping the fold with the WG's own next wgmma, or
splitting the tile into several accumulators, measured slower (benchmarks/NOTES_kernels.md,
"Removed from the kernel").

Tiles may overhang the arrays: TMA fills out-of-bounds reads with zeros (which add exact
zeros to the sums) and drops out-of-bounds writes.
"""
import functools

from jax import lax
import jax.numpy as jnp

from infir2_jax.precision.kernels.tuning import BLOCK
from infir2_jax.precision.kernels.tuning import TuningConfig
from infir2_jax.precision.kernels.tuning import split_k_blocks


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


def _pipeline(config: TuningConfig, k_iters: int, body, compute_context, pipeline_state=None):
  """The warp-specialized TMA pipeline over one work item's k_iters K blocks."""
  import jax.experimental.pallas.mosaic_gpu as plgpu
  fp8_transforms = (plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(128))
  spec = functools.partial(plgpu.BlockSpec, memory_space=plgpu.SMEM)
  return plgpu.emit_pipeline_warp_specialized(
      body,
      grid=(k_iters,),
      memory_registers=config.memory_registers,
      in_specs=[
          spec((config.cta_m, BLOCK), lambda kk: (0, kk), transforms=fp8_transforms),
          spec((config.tile_n, BLOCK), lambda kk: (0, kk), transforms=fp8_transforms),
          spec((1, config.cta_m), lambda kk: (kk, 0)),
          spec((1, config.tile_n), lambda kk: (kk, 0)),
      ],
      wg_axis="wg",
      num_compute_wgs=config.compute_wgs,
      max_concurrent_steps=config.max_concurrent_steps,
      compute_context=compute_context,
      pipeline_state=pipeline_state,
  )


def _out_smem_type(config: TuningConfig, epi_n: int, out_dtype):
  """One epilogue staging buffer [tile_m, epi_n] per compute warpgroup."""
  import jax.experimental.pallas.mosaic_gpu as plgpu
  itemsize = jnp.dtype(out_dtype).itemsize
  swizzle = plgpu.find_swizzle(epi_n * itemsize * 8)
  transforms = (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))
  return plgpu.SMEM((config.compute_wgs, config.tile_m, epi_n), out_dtype, transforms=transforms)


def _block_scales(sa_smem, sb_smem, wg_rows, per_column: bool):
  """The K block's scale vectors: per row of A (times B's block scale), [per column of B]."""
  import jax.experimental.pallas.mosaic_gpu as plgpu
  sa = plgpu.load(sa_smem.at[0, wg_rows], layout=plgpu.Layout.WGMMA.reduce(1))
  if per_column:
    return sa, plgpu.load(sb_smem.at[0], layout=plgpu.Layout.WGMMA.reduce(0))
  return (sa * sb_smem[0, 0],)  # 128-wide tile, 128x128 B blocks: one B scale per block


def _promote(acc, part, scales, per_column: bool):
  """acc + part * scale, the scale broadcast from its row (and column) vectors."""
  s = lax.broadcast_in_dim(scales[0], acc.shape, (0,))
  if per_column:
    s = s * lax.broadcast_in_dim(scales[1], acc.shape, (1,))
  return acc + part * s


def _mainloop_step(_, a_smem, b_smem, sa_smem, sb_smem, acc, *, config: TuningConfig, wg_rows,
                   per_column: bool):
  """One K block of one compute warpgroup: wgmma into a fresh partial, wait, promote."""
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu

  def wgmma(part_ref):
    # ptxas issues the block's first wgmma with scale-d = 0 (read in SASS), so the fresh
    # accumulator costs no zeroing.
    plgpu.wgmma(part_ref, a_smem.at[wg_rows], b_smem.T)
    return plgpu.wgmma_accumulator_load(part_ref, wait_n=0)

  if config.scales_first:   # in registers while the tensor core works (TuningConfig)
    scales = _block_scales(sa_smem, sb_smem, wg_rows, per_column)
    part = pl.run_scoped(wgmma, plgpu.ACC((config.tile_m, config.tile_n), jnp.float32))
  else:
    part = pl.run_scoped(wgmma, plgpu.ACC((config.tile_m, config.tile_n), jnp.float32))
    scales = _block_scales(sa_smem, sb_smem, wg_rows, per_column)
  return _promote(acc, part, scales, per_column)


def _store_tile(acc, out_smem, wg, out_tile, epi_n: int):
  """Writes a warpgroup's f32 accumulator to out_tile in epi_n-wide chunks through its
  staging buffer."""
  import jax.experimental.pallas.mosaic_gpu as plgpu
  for c in range(acc.shape[1] // epi_n):
    cols = slice(c * epi_n, (c + 1) * epi_n)
    # The buffer is free once the previous chunk's (or tile's) store has read it; a second
    # buffer to overlap that store measured no faster (NOTES_kernels.md).
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    out_smem[wg] = acc[:, cols].astype(out_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem.at[wg], out_tile.at[:, cols])


def _cross_tile_state(loop_info):
  """pipeline_state of a pipeline carried across a CTA's tiles: the first fills, the last
  drains."""
  import jax.experimental.pallas.mosaic_gpu as plgpu
  stage = plgpu.PipelinePipeline
  last = loop_info.num_local_steps - 1
  return jnp.where(loop_info.local_index == 0, int(stage.START),
                   jnp.where(loop_info.local_index == last, int(stage.STOP), int(stage.STEADY)))


def _work_item(loop_info, refs, out_smem, pipeline_allocs, wg, *, config: TuningConfig,
               per_column: bool, split_k: int, grid_mn, k_iters: int, epi_n: int):
  """One output tile of one K split: the pipeline over its K blocks, then the epilogue."""
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu
  a_gmem, b_gmem, sa_gmem, sb_gmem, out_gmem = refs
  (lin,) = loop_info.index
  si = lax.rem(lin, split_k)  # K split of this work item
  minor = 0 if config.grid_minor_dim == "m" else 1
  mi, ni = plgpu.planar_snake(lax.div(lin, split_k), grid_mn, minor, config.grid_tile_width)
  cta_rows = pl.ds(mi * config.cta_m, config.cta_m)
  cols = pl.ds(ni * config.tile_n, config.tile_n)
  wg_rows = pl.ds(wg * config.tile_m, config.tile_m)

  def compute_context(eval_pipeline):
    zeros = jnp.zeros((config.tile_m, config.tile_n), jnp.float32)
    acc = eval_pipeline(plgpu.layout_cast(zeros, plgpu.Layout.WGMMA))
    _store_tile(acc, out_smem, wg, out_gmem.at[si, cta_rows, cols].at[wg_rows], epi_n)

  step = functools.partial(_mainloop_step, config=config, wg_rows=wg_rows, per_column=per_column)
  state = _cross_tile_state(loop_info) if config.cross_tile else None
  k_cols = pl.ds(si * k_iters * BLOCK, k_iters * BLOCK)
  k_blocks = pl.ds(si * k_iters, k_iters)
  _pipeline(config, k_iters, step, compute_context, state)(
      a_gmem.at[cta_rows, k_cols], b_gmem.at[cols, k_cols],
      sa_gmem.at[k_blocks, cta_rows], sb_gmem.at[k_blocks, cols],
      allocations=pipeline_allocs)


def kernel_body(a_gmem, b_gmem, sa_gmem, sb_gmem, out_gmem, *, config: TuningConfig,
                per_column: bool, split_k: int):
  """Kernel body. a [M, K], b [N, K] fp8; sa [Kb, M], sb [Kb, N] f32; out [S, M, N]
  (one slice per K split).

  per_column: B's scales vary along the tile's columns (1x128 B tiles, or tiles wider than
  one 128x128 block), so they are loaded as a vector rather than one scalar per K block.
  """
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu
  m, k = a_gmem.shape
  grid_mn = (_cdiv(m, config.cta_m), _cdiv(b_gmem.shape[0], config.tile_n))
  k_iters = split_k_blocks(_cdiv(k, BLOCK), split_k)  # K blocks per split (last may overhang)
  epi_n = config.epi_n or config.tile_n
  ignore = lambda *_, **__: None
  allocs = _pipeline(config, k_iters, ignore, ignore).get_allocations(
      a_gmem, b_gmem, sa_gmem, sb_gmem)
  item = functools.partial(_work_item, config=config, per_column=per_column, split_k=split_k,
                           grid_mn=grid_mn, k_iters=k_iters, epi_n=epi_n)

  @functools.partial(pl.run_scoped, pipeline_allocs=allocs,
                     out_smem=_out_smem_type(config, epi_n, out_gmem.dtype),
                     collective_axes="wg")
  def _scope(pipeline_allocs, out_smem):
    wg = lax.axis_index("wg")

    @plgpu.nd_loop((grid_mn[0] * grid_mn[1] * split_k,), collective_axes="sm")
    def _loop(loop_info):
      item(loop_info, (a_gmem, b_gmem, sa_gmem, sb_gmem, out_gmem), out_smem, pipeline_allocs, wg)

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
