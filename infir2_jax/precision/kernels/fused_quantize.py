"""FP8 quantization fused into the elementwise op that makes the operand (Mosaic GPU), with
pure-jnp references: the SwiGLU forward (-> down_proj's input) and backward (-> gate/up's
output gradients), each written straight to 1x128 tiles along K and along tokens.

Semantics (the contract both the kernel and the reference compute, bit for bit on CPU):
  value = bf16(f(inputs in f32))       the producer in float32, rounded once to bf16
  (q, s, qT, sT) = quantize_tiles_reference(value, with_transpose=True)
so the FP8 operand is exactly the quantization of the bf16 tensor the BF16 recipe would feed
its GEMM (the producers are the functions below, which the model uses in every recipe).
On a GPU the producer's exp and division may round differently from XLA's in the last f32
bit, which moves `value` by one bf16 ulp in a few elements per million (tests/
test_kernels_gpu.py measures it); the quantization of whatever value the kernel made is exact.

Shape legend: M tokens, F the MLP width (a multiple of 128), gu [M, 2F] the gate and up
projections side by side (gate in columns [0, F), up in [F, 2F)), dh [M, F] the gradient of
SwiGLU's output, dgu [M, 2F] the gradients of gate and up side by side.

Kernel: one CTA per 128x128 block of the output, one warpgroup. Every input block is read
once by TMA into shared memory; the producer runs on [64, FusedConfig.producer_cols] pieces
in registers and leaves its bf16 outputs in shared memory (over the input buffers it no
longer needs); then each output is quantized as quantize.py does (rows from a register load,
token tiles from a transposed load) and written by TMA, its scales K-block-major as the GEMM
reads them. With FusedConfig.alias_outputs the fp8 staging buffers share the memory of the
last input, dead once the producer has run, so more CTAs fit on an SM. With several outputs
(FusedConfig.loop_outputs) the producer's pieces and the outputs' quantization are loops, so
the code stays within the SM's instruction cache.
"""
import dataclasses
import functools

import jax
from jax import lax
import jax.numpy as jnp

from infir2_jax.precision import formats
from infir2_jax.precision.kernels.quantize import (
    HALF, TILE, RowQuantize, load_half, quantize_block_tiles, row_quantize,
    quantize_tiles_reference, smem_transforms)

FUSED_KERNEL_NAME = "infir2_fused_quantize"


@dataclasses.dataclass(frozen=True)
class FusedConfig:
  """How the fused kernels run (the numbers are the same whatever is chosen).

  Attributes:
    producer_cols: width of the [64, cols] pieces the producer computes at a time (128 or
      64): narrower pieces hold fewer registers per thread (the backward reads three inputs).
    alias_outputs: put the fp8 staging buffers in the last input's shared memory (a
      RefUnion), which leaves room for more CTAs per SM.
    loop_outputs: quantize the outputs in a loop (scf.for) over one [n_out, 128, 128]
      buffer instead of unrolled, one copy of the code per output. The unrolled backward
      (two outputs) is ~9,400 SASS instructions, ~150 KB: more than the SM's instruction
      cache, so its few warps stall on instruction fetch and it ran 5x slower than every
      variant under ~6,700 (benchmarks/NOTES_kernels.md, session 18).
    programs: 0 (the default) runs one CTA per 128x128 block. N > 0 runs a persistent grid
      of min(N, blocks) CTAs; each makes blocks p, p + N, ... and loads the next block's
      inputs (a second stage of input buffers) while it computes and stores the current
      one. Each stage's fp8 staging lies over its own last input and the outputs are always
      looped (alias_outputs must be off: it names the other kernel's aliasing): 2 x 96 KB of
      shared memory for the backward, 2 x 64 KB for the forward, one CTA per SM; 132 is
      one per H200 SM. Measured slower (session 22, one H200, 16384 x 8960): forward 518.6
      us against 330.5 for programs=0, backward 895.7 against 573.0, and the same structure
      with the arithmetic taken out (a pure copy) 714.0 against 449.2: one CTA per SM with
      two stages hides less latency than the several CTAs per SM of the default grid.
      Kept, bit-identical and tested, for the record and for shapes with few blocks.
  """
  producer_cols: int = 64
  alias_outputs: bool = True
  loop_outputs: bool = True
  programs: int = 0

  def __post_init__(self):
    if self.producer_cols not in (64, 128):
      raise ValueError(f"FusedConfig.producer_cols={self.producer_cols}: must be 64 or 128")
    if self.programs < 0:
      raise ValueError(f"FusedConfig.programs={self.programs}: must be >= 0")
    if self.programs and self.alias_outputs:
      raise ValueError("FusedConfig.programs > 0 (the pipelined kernel) places its staging "
                       "per stage itself: set alias_outputs=False")


DEFAULT_FUSED_CONFIG = FusedConfig()


def sigmoid_f32(x):
  """1 / (1 + exp(-x)) in float32, the form both the kernel and XLA lower."""
  return 1.0 / (1.0 + jnp.exp(-x))


def swiglu_f32(g, u):
  """SwiGLU silu(g) * u = g * sigmoid(g) * u, in float32."""
  return (g * sigmoid_f32(g) * u,)


def swiglu_bwd_f32(dh, g, u):
  """Gradients of swiglu_f32 w.r.t. (g, u) for the output gradient dh, in float32:
  dg = dh * u * s * (1 + g * (1 - s)) and du = dh * g * s, with s = sigmoid(g)."""
  s = sigmoid_f32(g)
  dsilu = s * (1.0 + g * (1.0 - s))
  return dh * u * dsilu, dh * (g * s)


def swiglu_reference(gu_Mx2F):
  """h [M, F] = swiglu_f32(gate, up) of gu = [gate | up], rounded to gu's dtype (bf16)."""
  f = _half_width(gu_Mx2F)
  g, u = gu_Mx2F[:, :f].astype(jnp.float32), gu_Mx2F[:, f:].astype(jnp.float32)
  return swiglu_f32(g, u)[0].astype(gu_Mx2F.dtype)


def swiglu_bwd_reference(dh_MxF, gu_Mx2F):
  """dgu [M, 2F] = [dgate | dup] for SwiGLU's output gradient dh, in gu's dtype (bf16)."""
  f = _half_width(gu_Mx2F)
  g, u = gu_Mx2F[:, :f].astype(jnp.float32), gu_Mx2F[:, f:].astype(jnp.float32)
  dg, du = swiglu_bwd_f32(dh_MxF.astype(jnp.float32), g, u)
  return jnp.concatenate([dg, du], axis=1).astype(gu_Mx2F.dtype)


def swiglu_quantize_reference(gu_Mx2F, *, fmt="e4m3", scale_format="ue8m0"):
  """(q [M, F], s [M, Fb], qT [F, M], sT [F, Mb]) of swiglu_reference(gu)."""
  return quantize_tiles_reference(swiglu_reference(gu_Mx2F), fmt=fmt,
                                  scale_format=scale_format, with_transpose=True)


def swiglu_bwd_quantize_reference(dh_MxF, gu_Mx2F, *, fmt="e4m3", scale_format="ue8m0"):
  """(q [M, 2F], s [M, 2Fb], qT [2F, M], sT [2F, Mb]) of swiglu_bwd_reference(dh, gu)."""
  return quantize_tiles_reference(swiglu_bwd_reference(dh_MxF, gu_Mx2F), fmt=fmt,
                                  scale_format=scale_format, with_transpose=True)


def _half_width(gu):
  if gu.ndim != 2 or gu.shape[1] % 2:
    raise ValueError(f"gu.shape={gu.shape}: expected [M, 2F], gate and up side by side")
  return gu.shape[1] // 2


def check_swiglu_bwd_shapes(dh_MxF, gu_Mx2F) -> int:
  """F of gu = [gate | up] [M, 2F], checking that dh is [M, F]."""
  f = _half_width(gu_Mx2F)
  if dh_MxF.shape != (gu_Mx2F.shape[0], f):
    raise ValueError(f"dh.shape={dh_MxF.shape} does not match gu.shape={gu_Mx2F.shape} "
                     f"(expected {(gu_Mx2F.shape[0], f)})")
  return f


def _produce_piece(bufs, producer, h, c, cols: int):
  """The producer on rows [64h, 64h + 64) x columns [c cols, (c + 1) cols) of its input
  blocks (bf16 in shared memory), in float32; its bf16 outputs replace the first inputs."""
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu
  aligned = lambda i, n: i * n if isinstance(i, int) else pl.multiple_of(i * n, n)
  piece = (pl.ds(aligned(h, HALF), HALF), pl.ds(aligned(c, cols), cols))
  xs = [plgpu.load(b.at[piece], layout=plgpu.Layout.WGMMA).astype(jnp.float32) for b in bufs]
  for b, y in zip(bufs, producer(*xs)):
    b[piece] = y.astype(jnp.bfloat16)


def _quantize_and_store(src, staging, outs, *, rows, mi, kb, fmt, scale_format, with_values,
                        body: RowQuantize):
  """The bf16 block `src` (shared memory) as 1x128 tiles along K and along tokens, stored as
  column block kb of token block mi (rows) of the outputs; with_values also stores src.

  staging: (q, s, qT, sT) in shared memory; outs: (q, s, qT, sT[, values]) in global memory.
  The stores are asynchronous (TMA): before the staging is written again, the previous
  output's (or block's) stores must have read it, which is waited for here first.
  """
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu
  q_smem, s_smem, qt_smem, st_smem = staging
  q_gmem, s_gmem, qt_gmem, st_gmem, *v_gmem = outs
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  quantize_block_tiles(src, q_smem, s_smem, transposed=False, fmt=fmt,
                       scale_format=scale_format, body=body)
  quantize_block_tiles(src, qt_smem, st_smem, transposed=True, fmt=fmt,
                       scale_format=scale_format, body=body)
  plgpu.commit_smem()
  cols = pl.ds(kb * TILE, TILE)
  plgpu.copy_smem_to_gmem(q_smem, q_gmem.at[rows, cols])
  plgpu.copy_smem_to_gmem(s_smem, s_gmem.at[pl.ds(kb, 1), rows])
  plgpu.copy_smem_to_gmem(qt_smem, qt_gmem.at[cols, rows])
  plgpu.copy_smem_to_gmem(st_smem, st_gmem.at[pl.ds(mi, 1), cols])
  if with_values:
    plgpu.copy_smem_to_gmem(src, v_gmem[0].at[rows, cols])


def _fused_body(*refs, producer, sources, n_arrays, n_out, fb, fmt, scale_format,
                with_values, config: FusedConfig, row: RowQuantize):
  """One CTA makes one 128x128 block of each of the producer's n_out outputs, quantized.

  sources: (input array index, column-block offset) of each producer argument's block.
  Output j of block (mi, ki) is written at column block j * fb + ki of the outputs;
  with_values also writes the bf16 values it quantized (for tests).
  """
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu

  in_gmem, outs = refs[:n_arrays], refs[n_arrays:]
  mi, ki = lax.axis_index("m"), lax.axis_index("k")
  rows = pl.ds(mi * TILE, TILE)
  dtype = formats.get_format(fmt).dtype

  looped = config.loop_outputs and n_out > 1

  def scoped(*scratch):
    if looped:  # the first n_out inputs (then outputs) in one buffer, indexable in a loop
      out_bufs, *scratch = scratch
    if config.alias_outputs:
      *bufs, union, s_smem, st_smem, bar = scratch
      last, (q_smem, qt_smem) = union  # the last input, then (q, qT) over its memory
      bufs = (*bufs, last)
    else:
      n_rest = len(sources) - (n_out if looped else 0)
      bufs, (q_smem, qt_smem, s_smem, st_smem, bar) = scratch[:n_rest], scratch[n_rest:]
    if looped:
      bufs = (*(out_bufs.at[j] for j in range(n_out)), *bufs)
    for i, (array, offset) in enumerate(sources):
      plgpu.copy_gmem_to_smem(in_gmem[array].at[rows, pl.ds((offset + ki) * TILE, TILE)],
                              bufs[i], bar.at[i])
    for i in range(len(sources)):
      plgpu.barrier_wait(bar.at[i])
    cols = config.producer_cols
    per_row = TILE // cols

    produce = lambda h, c: _produce_piece(bufs, producer, h, c, cols)

    if looped:  # one copy of the producer's code, as of the quantization's
      lax.fori_loop(0, 2 * per_row,
                    lambda p, carry: produce(p // per_row, p % per_row) or carry, 0)
    else:
      for h in range(2):
        for c in range(per_row):
          produce(h, c)
    plgpu.commit_smem()

    def quantize_output(j, src):
      _quantize_and_store(src, (q_smem, s_smem, qt_smem, st_smem), outs, rows=rows, mi=mi,
                          kb=j * fb + ki, fmt=fmt, scale_format=scale_format,
                          with_values=with_values, body=row)

    if looped:
      lax.fori_loop(0, n_out, lambda j, carry: quantize_output(j, out_bufs.at[j]) or carry,
                    0)
    else:
      for j in range(n_out):
        quantize_output(j, bufs[j])
    plgpu.wait_smem_to_gmem(0)

  bf16 = jnp.bfloat16
  block = lambda t: plgpu.SMEM((TILE, TILE), t, transforms=smem_transforms(t))
  staging = [block(dtype), block(dtype)]
  inputs = [block(bf16) for _ in sources]
  if looped:  # one [n_out, 128, 128] buffer for the first n_out inputs
    inputs[:n_out] = [plgpu.SMEM((n_out, TILE, TILE), bf16, transforms=smem_transforms(bf16))]
  if config.alias_outputs:
    inputs[-1] = plgpu.RefUnion(inputs[-1], staging)
    staging = []
  pl.run_scoped(
      scoped, *inputs, *staging,
      plgpu.SMEM((1, TILE), jnp.float32),
      plgpu.SMEM((1, TILE), jnp.float32),
      plgpu.Barrier(num_barriers=len(sources)),
  )


def _pipelined_body(*refs, producer, sources, n_arrays, n_out, fb, mb, programs, fmt,
                    scale_format, with_values, config: FusedConfig, row: RowQuantize):
  """_fused_body as a persistent kernel: CTA p of `programs` makes blocks p, p + programs,
  ... of the [mb, fb] grid (block b is (b // fb, b % fb)), the same work per block, and
  issues the next block's input loads (into the other of two stages) before it waits for
  the current block's: the loads overlap the producer, the quantization and the stores.

  Stage s holds the inputs in buffers [s * n_src, (s + 1) * n_src) of one shared array; the
  producer's outputs replace the first n_out of them, as in _fused_body (looped), and the
  fp8 staging of the stage's outputs lies over its last input, dead once the producer has
  run (an fp8 view of the same memory). So before a stage is refilled, the stores that read
  its staging must have read it.
  """
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu

  in_gmem, outs = refs[:n_arrays], refs[n_arrays:]
  n_src = len(sources)
  pid = lax.axis_index("p")
  n_mine = (mb * fb - pid + programs - 1) // programs   # >= 1: programs <= blocks
  cols = config.producer_cols
  per_row = TILE // cols

  def block_of(step):
    b = pid + step * programs
    return b // fb, b % fb

  def scoped(union, s_smem, st_smem, bar):
    inputs, fp8_view = union   # fp8 block 2i and 2i + 1 lie over bf16 block i
    def load(step, stage):
      mi, ki = block_of(step)
      rows = pl.ds(pl.multiple_of(mi * TILE, TILE), TILE)
      for i, (array, offset) in enumerate(sources):
        start = pl.multiple_of((offset + ki) * TILE, TILE)
        plgpu.copy_gmem_to_smem(in_gmem[array].at[rows, pl.ds(start, TILE)],
                                inputs.at[stage * n_src + i], bar.at[stage * n_src + i])

    load(0, 0)

    def one_block(step, carry):
      stage = step % 2

      @pl.when(step + 1 < n_mine)
      def _():
        # The last block's stores read the stage about to be refilled (its staging).
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        load(step + 1, 1 - stage)

      for i in range(n_src):
        plgpu.barrier_wait(bar.at[stage * n_src + i])
      bufs = [inputs.at[stage * n_src + i] for i in range(n_src)]

      lax.fori_loop(0, 2 * per_row, lambda p, carry: _produce_piece(
          bufs, producer, p // per_row, p % per_row, cols) or carry, 0)
      plgpu.commit_smem()
      mi, ki = block_of(step)
      rows = pl.ds(pl.multiple_of(mi * TILE, TILE), TILE)
      last = 2 * (stage * n_src + n_src - 1)
      q_smem, qt_smem = fp8_view.at[last], fp8_view.at[last + 1]

      def quantize_output(j, c):
        _quantize_and_store(inputs.at[stage * n_src + j], (q_smem, s_smem, qt_smem, st_smem),
                            outs, rows=rows, mi=mi, kb=j * fb + ki, fmt=fmt,
                            scale_format=scale_format, with_values=with_values, body=row)
        return c

      lax.fori_loop(0, n_out, quantize_output, 0)
      return carry

    lax.fori_loop(0, n_mine, one_block, 0)
    plgpu.wait_smem_to_gmem(0)

  dtype = formats.get_format(fmt).dtype
  pl.run_scoped(
      scoped,
      plgpu.RefUnion(
          plgpu.SMEM((2 * n_src, TILE, TILE), jnp.bfloat16,
                     transforms=smem_transforms(jnp.bfloat16)),
          plgpu.SMEM((4 * n_src, TILE, TILE), dtype, transforms=smem_transforms(dtype))),
      plgpu.SMEM((1, TILE), jnp.float32),
      plgpu.SMEM((1, TILE), jnp.float32),
      plgpu.Barrier(num_barriers=2 * n_src),
  )


def fused_kernel_name(producer: str, m: int, f: int) -> str:
  """The kernel's name in profiles, e.g. infir2_fused_quantize_swiglu_16384x8960."""
  return f"{FUSED_KERNEL_NAME}_{producer}_{m}x{f}"


PRODUCERS = {"swiglu": (swiglu_f32, 1), "swiglu_bwd": (swiglu_bwd_f32, 2)}


@functools.lru_cache(maxsize=None)
def _fused_kernel(producer: str, in_shapes, sources, m: int, f: int, fmt, scale_format,
                  interpret, with_values, config: FusedConfig, row: RowQuantize):
  """The jitted kernel of one static signature, built once (lowered once per program)."""
  import jax.experimental.pallas.mosaic_gpu as plgpu
  fn, n_out = PRODUCERS[producer]
  dtype = formats.get_format(fmt).dtype
  fb, mb, width = f // TILE, m // TILE, n_out * f
  out_type = (jax.ShapeDtypeStruct((m, width), dtype),
              jax.ShapeDtypeStruct((width // TILE, m), jnp.float32),
              jax.ShapeDtypeStruct((width, m), dtype),
              jax.ShapeDtypeStruct((mb, width), jnp.float32))
  if with_values:
    out_type += (jax.ShapeDtypeStruct((m, width), jnp.bfloat16),)
  common = dict(producer=fn, sources=sources, n_arrays=len(in_shapes), n_out=n_out, fb=fb,
                fmt=fmt, scale_format=scale_format, with_values=with_values, config=config,
                row=row)   # quantize.row_quantize: how each row is quantized
  if config.programs:
    programs = min(config.programs, mb * fb)
    body = functools.partial(_pipelined_body, mb=mb, programs=programs, **common)
    grid, grid_names = (programs,), ("p",)
  else:
    body = functools.partial(_fused_body, **common)
    grid, grid_names = (mb, fb), ("m", "k")
  return jax.jit(plgpu.kernel(
      body, out_type=out_type, grid=grid, grid_names=grid_names,
      kernel_name=fused_kernel_name(producer, m, f),
      interpret=plgpu.InterpretGPUParams() if interpret else None,
  ))


def _run(producer, arrays, sources, f, fmt, scale_format, interpret, with_values, config):
  """Pads the token axis to whole tiles, runs the kernel, returns the contract's layouts
  (and, with_values, the bf16 values it quantized)."""
  formats.get_format(fmt)
  formats.check_scale_format(scale_format)
  m = arrays[0].shape[0]
  for a in arrays:
    if a.dtype != jnp.bfloat16:
      raise ValueError(f"fused quantization takes bfloat16 inputs, got {a.dtype}{a.shape}")
  if f % TILE:
    raise ValueError(f"fused quantization needs the MLP width F={f} to be a multiple of "
                     f"{TILE} (whole 1x128 tiles in each of gate and up)")
  mp = -(-m // TILE) * TILE
  if mp != m:  # zero rows quantize to zero and are sliced off
    arrays = [jnp.pad(a, ((0, mp - m), (0, 0))) for a in arrays]
  if len(sources) <= PRODUCERS[producer][1] and (config.alias_outputs or config.programs):
    raise ValueError(f"{producer}: alias_outputs and programs put the fp8 staging over an "
                     "input that dies with the producer; this producer has none")
  kernel = _fused_kernel(producer, tuple(a.shape for a in arrays), sources, mp, f, fmt,
                         scale_format, interpret, with_values, config,
                         row_quantize(interpret))
  q, s_KbxM, qt, st_MbxK, *values = kernel(*arrays)
  return (q[:m], s_KbxM.T[:m], qt[:, :m], st_MbxK.T, *(v[:m] for v in values))


def swiglu_quantize(gu_Mx2F, *, fmt="e4m3", scale_format="ue8m0", interpret=False,
                    with_values=False, config: FusedConfig = DEFAULT_FUSED_CONFIG):
  """swiglu_quantize_reference(gu) in one pass over gu: (q, s, qT, sT) of h [M, F]
  (with_values: and h itself, as the kernel computed it)."""
  f = _half_width(gu_Mx2F)
  return _run("swiglu", [gu_Mx2F], ((0, 0), (0, f // TILE)), f, fmt, scale_format, interpret,
              with_values, config)


def swiglu_bwd_quantize(dh_MxF, gu_Mx2F, *, fmt="e4m3", scale_format="ue8m0",
                        interpret=False, with_values=False,
                        config: FusedConfig = DEFAULT_FUSED_CONFIG):
  """swiglu_bwd_quantize_reference(dh, gu) in one pass: (q, s, qT, sT) of dgu [M, 2F]
  (with_values: and dgu itself, as the kernel computed it)."""
  f = check_swiglu_bwd_shapes(dh_MxF, gu_Mx2F)
  return _run("swiglu_bwd", [dh_MxF, gu_Mx2F], ((0, 0), (1, 0), (1, f // TILE)), f, fmt,
              scale_format, interpret, with_values, config)

