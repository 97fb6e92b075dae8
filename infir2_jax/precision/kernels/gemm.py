"""Block-scaled FP8 GEMM for Hopper (Pallas Mosaic GPU), with its pure-jnp reference.

Shape legend: M rows of A / out, N rows of B (columns of out), K contraction,
Kb = ceil(K / 128) scale blocks along K, Nb = ceil(N / 128).

  out[m, n] = sum_kb (sum_{k in kb} f32(a_q[m, k]) * f32(b_q[n, k]))
                     * a_scale[m, kb] * b_scale[r(n), kb]

with r(n) = n // 128 for 128x128 weight blocks (b_scale [Nb, Kb]) and r(n) = n
for 1x128 tiles (b_scale [N, Kb], the wgrad case). Partial sums are promoted to
the f32 accumulator with their scales at every 128-wide K block, as DeepSeek-V3.

Kernel layout: a persistent grid of one CTA per SM; each CTA has two or three
compute warpgroups (WGs), each owning `tile_m` rows x `tile_n` columns of the CTA
tile, and one memory WG that streams A, B and the scale vectors with TMA. Per K block
a WG runs wgmma into a fresh partial accumulator, then folds it into the main
accumulator with its per-row (and per-column or per-block) scale
(TuningConfig.promotion says how that overlaps the next wgmma).
"""
import dataclasses
import functools
import re

import jax
from jax import lax
import jax.numpy as jnp

from infir2_jax.precision.kernels.tuning import BLOCK
from infir2_jax.precision.kernels.tuning import HOPPER_SMS
from infir2_jax.precision.kernels.tuning import DEFAULT_CONFIG  # noqa: F401 (re-exported)
from infir2_jax.precision.kernels.tuning import TuningConfig
from infir2_jax.precision.kernels.tuning import check_epi_buffers
from infir2_jax.precision.kernels.tuning import choose_split_k
from infir2_jax.precision.kernels.tuning import default_config
from infir2_jax.precision.kernels.tuning import fit_stages
from infir2_jax.precision.kernels.tuning import resolve_cross_tile
from infir2_jax.precision.kernels.tuning import split_k_blocks

FP8_DTYPES = (jnp.float8_e4m3fn, jnp.float8_e5m2)
OUT_DTYPES = (jnp.bfloat16, jnp.float32)


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


def _round_up(a: int, b: int) -> int:
  return _cdiv(a, b) * b


def _check_matrices(a_q, b_q, out_dtype) -> None:
  """Validates the fp8 operands of an NT GEMM and its output dtype (not the scales)."""
  if a_q.ndim != 2 or b_q.ndim != 2:
    raise ValueError(f"a_q {a_q.shape} and b_q {b_q.shape} must be 2-D [M, K] and [N, K]"
                     " (flatten batch dims first)")
  if a_q.shape[1] != b_q.shape[1]:
    raise ValueError(f"contraction mismatch: a_q {a_q.shape} vs b_q {b_q.shape} (both K-last)")
  for name, x in (("a_q", a_q), ("b_q", b_q)):
    if x.dtype not in FP8_DTYPES:
      raise ValueError(f"{name}.dtype={x.dtype}: must be float8_e4m3fn or float8_e5m2")
  if jnp.dtype(out_dtype) not in OUT_DTYPES:
    raise ValueError(f"out_dtype={out_dtype}: must be bfloat16 or float32")


def check_operands(a_q, a_scale, b_q, b_scale, out_dtype) -> str:
  """Validates the canonical NT operands; returns "block" or "row" (b_scale kind)."""
  _check_matrices(a_q, b_q, out_dtype)
  (m, k), n = a_q.shape, b_q.shape[0]
  kb = _cdiv(k, BLOCK)
  if a_scale.shape != (m, kb):
    raise ValueError(f"a_scale.shape={a_scale.shape}: expected {(m, kb)} (1x128 tiles)")
  if b_scale.shape == (_cdiv(n, BLOCK), kb) and b_scale.shape != (n, kb):
    kind = "block"
  elif b_scale.shape == (n, kb):
    # N <= 128 makes the two layouts coincide; a [N, Kb] grid is then read per row,
    # which equals the block reading only when N == 1; per row is the safe choice.
    kind = "row"
  else:
    raise ValueError(f"b_scale.shape={b_scale.shape}: expected {(_cdiv(n, BLOCK), kb)}"
                     f" (128x128 blocks) or {(n, kb)} (1x128 tiles)")
  for name, s in (("a_scale", a_scale), ("b_scale", b_scale)):
    if s.dtype != jnp.float32:
      raise ValueError(f"{name}.dtype={s.dtype}: must be float32")
  return kind


def block_scaled_matmul_reference(a_q, a_scale, b_q, b_scale, *, out_dtype=jnp.bfloat16):
  """Pure-jnp reference of the contract: f32 partial sums per 128-K block, scaled."""
  kind = check_operands(a_q, a_scale, b_q, b_scale, out_dtype)
  (m, k), n = a_q.shape, b_q.shape[0]
  kb = _cdiv(k, BLOCK)
  pad = kb * BLOCK - k
  a = jnp.pad(a_q.astype(jnp.float32), ((0, 0), (0, pad))).reshape(m, kb, BLOCK)
  b = jnp.pad(b_q.astype(jnp.float32), ((0, 0), (0, pad))).reshape(n, kb, BLOCK)
  part_KbxMxN = jnp.einsum("mkc,nkc->kmn", a, b, precision=lax.Precision.HIGHEST)
  sb_NxKb = b_scale if kind == "row" else jnp.repeat(b_scale, BLOCK, axis=0)[:n]
  scale_KbxMxN = a_scale.T[:, :, None] * sb_NxKb.T[:, None, :]
  return jnp.sum(part_KbxMxN * scale_KbxMxN, axis=0).astype(out_dtype)


def _kernel_body(a_gmem, b_gmem, sa_gmem, sb_gmem, out_gmem, *, config: TuningConfig,
                 per_column: bool, split_k: int):
  """Kernel body. a [M, K], b [N, K] fp8; sa [Kb, M], sb [Kb, N] f32; out [S, M, N]
  (one slice per K split), or with split_reduce "tma_add" a zeroed f32 [M, N] ref that
  every split adds its tiles into.

  Tiles may overhang the arrays: TMA fills out-of-bounds reads with zeros (which
  add exact zeros to the sums) and drops out-of-bounds writes.
  """
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu

  m, k = a_gmem.shape
  n = b_gmem.shape[0]
  tm, tn, cta_m = config.tile_m, config.tile_n, config.cta_m
  cm = 2 if config.cluster == "m" else 1  # CTAs of a cluster along M
  cn = 2 if config.cluster == "n" else 1  # and along N
  m_iters, n_iters = _cdiv(m, cm * cta_m), _cdiv(n, cn * tn)
  k_iters = split_k_blocks(_cdiv(k, BLOCK), split_k)  # K blocks per split (last may overhang)
  kps = 2 if config.promotion == "paired" else 1  # K blocks per pipeline step
  k_steps = k_iters // kps
  out_dtype = out_gmem.dtype
  epi_n = config.epi_n or tn
  bufs = config.epi_buffers  # output staging buffers per warpgroup
  reduce_add = config.split_reduce == "tma_add" and split_k > 1
  fp8_transforms = (plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(128))
  out_swizzle = plgpu.find_swizzle(epi_n * jnp.dtype(out_dtype).itemsize * 8)
  out_elems = out_swizzle // jnp.dtype(out_dtype).itemsize
  out_transforms = (plgpu.TilingTransform((8, out_elems)), plgpu.SwizzleTransform(out_swizzle))
  row_layout = plgpu.Layout.WGMMA.reduce(1)
  col_layout = plgpu.Layout.WGMMA.reduce(0)

  def get_pipeline(body, compute_context, pipeline_state=None):
    # "paired" keeps a step's second wgmma in flight into the next step, so its
    # buffers are released one step late.
    spec = functools.partial(plgpu.BlockSpec, memory_space=plgpu.SMEM,
                             delay_release=1 if kps == 2 else 0)
    return plgpu.emit_pipeline_warp_specialized(
        body,
        grid=(k_steps,),
        memory_registers=config.memory_registers,
        in_specs=[
            spec((cta_m, kps * BLOCK), lambda kk: (0, kk), transforms=fp8_transforms,
                 collective_axes=("cluster",) if cn == 2 else ()),
            spec((tn, kps * BLOCK), lambda kk: (0, kk), transforms=fp8_transforms,
                 collective_axes=("cluster",) if cm == 2 else ()),
            spec((kps, cta_m), lambda kk: (kk, 0)),
            spec((kps, tn), lambda kk: (kk, 0)),
        ],
        wg_axis="wg",
        num_compute_wgs=config.compute_wgs,
        max_concurrent_steps=config.max_concurrent_steps,
        compute_context=compute_context,
        pipeline_state=pipeline_state,
    )

  ignore = lambda *_, **__: None
  allocs = get_pipeline(ignore, ignore).get_allocations(a_gmem, b_gmem, sa_gmem, sb_gmem)

  @functools.partial(
      pl.run_scoped,
      pipeline_allocs=allocs,
      out_smem=plgpu.SMEM((config.compute_wgs * bufs, tm, epi_n), out_dtype,
                          transforms=out_transforms),
      collective_axes="wg",
  )
  def _scope(pipeline_allocs, out_smem):
    wg = lax.axis_index("wg")
    minor = 0 if config.grid_minor_dim == "m" else 1

    cta = lax.axis_index("cluster")

    @plgpu.nd_loop((m_iters * n_iters * split_k,), collective_axes="sm")
    def _mn_loop(loop_info):
      (lin,) = loop_info.index
      si = lax.rem(lin, split_k)  # K split of this work item
      lin = lax.div(lin, split_k)
      mi, ni = plgpu.planar_snake(lin, (m_iters, n_iters), minor, config.grid_tile_width)
      if cm == 2:
        mi = mi * 2 + cta
      if cn == 2:
        ni = ni * 2 + cta
      cta_m_slice = pl.ds(mi * cta_m, cta_m)
      n_slice = pl.ds(ni * tn, tn)
      wg_rows = pl.ds(wg * tm, tm)

      def scales_of(sa_smem, sb_smem, j):
        """Row (and column) scale vectors of K block j of this step."""
        sa = plgpu.load(sa_smem.at[j, wg_rows], layout=row_layout)
        if per_column:
          return sa, plgpu.load(sb_smem.at[j], layout=col_layout)
        return (sa * sb_smem[j, 0],)

      def promote(acc, part, scales):
        """acc + part * scale, the scale broadcast from its row/column vectors."""
        s = lax.broadcast_in_dim(scales[0], (tm, tn), (0,))
        if per_column:
          s = s * lax.broadcast_in_dim(scales[1], (tm, tn), (1,))
        return acc + part * s

      def zero_scales():
        sa = plgpu.layout_cast(jnp.zeros((tm,), jnp.float32), row_layout)
        if per_column:
          return sa, plgpu.layout_cast(jnp.zeros((tn,), jnp.float32), col_layout)
        return (sa,)

      zeros = lambda: plgpu.layout_cast(jnp.zeros((tm, tn), jnp.float32), plgpu.Layout.WGMMA)
      part1_ref = []  # "paired": the accumulator of each step's second K block

      def compute_context(eval_pipeline):
        if config.promotion == "carried":
          acc, part, scales = eval_pipeline((zeros(), zeros(), zero_scales()))
          acc = promote(acc, part, scales)
        elif config.promotion == "paired":
          def run(part1):
            part1_ref.append(part1)
            acc, scales = eval_pipeline((zeros(), zero_scales()))
            return promote(acc, plgpu.wgmma_accumulator_load(part1, wait_n=0), scales)
          acc = pl.run_scoped(run, plgpu.ACC((tm, tn), jnp.float32))
        else:
          acc = eval_pipeline(zeros())
        if reduce_add:
          out_tile = out_gmem.at[cta_m_slice, n_slice].at[wg_rows]
        else:
          out_tile = out_gmem.at[si, cta_m_slice, n_slice].at[wg_rows]
        # Chunk c goes through buffer c % bufs (chunks per tile are a multiple of bufs, so
        # the alternation runs on across tiles); waiting until <= bufs - 1 stores are
        # still reading shared memory frees the buffer that this chunk reuses.
        for c in range(tn // epi_n):
          cols = slice(c * epi_n, (c + 1) * epi_n)
          buf = wg * bufs + c % bufs
          plgpu.wait_smem_to_gmem(bufs - 1, wait_read_only=True)
          out_smem[buf] = acc[:, cols].astype(out_dtype)
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(out_smem.at[buf], out_tile.at[:, cols],
                                  reduction_op="add" if reduce_add else None)

      def body(_, a_smem, b_smem, sa_smem, sb_smem, carry):
        def step(part_ref):
          plgpu.wgmma(part_ref, a_smem.at[wg_rows], b_smem.T)
          if config.promotion == "carried":
            # Fold in the previous block while this block's wgmma runs.
            acc, prev_part, prev_scales = carry
            acc = promote(acc, prev_part, prev_scales)
            return acc, plgpu.wgmma_accumulator_load(part_ref, wait_n=0)
          return carry, plgpu.wgmma_accumulator_load(part_ref, wait_n=0)
        acc, part = pl.run_scoped(step, plgpu.ACC((tm, tn), jnp.float32))
        scales = scales_of(sa_smem, sb_smem, 0)
        if config.promotion == "carried":
          return acc, part, scales
        return promote(acc, part, scales)

      def body_paired(_, a_smem, b_smem, sa_smem, sb_smem, carry):
        acc, prev_scales = carry
        (part1,) = part1_ref
        halves = [(a_smem.at[wg_rows, pl.ds(j * BLOCK, BLOCK)],
                   b_smem.at[:, pl.ds(j * BLOCK, BLOCK)].T) for j in range(2)]

        def step(part0):
          plgpu.wgmma(part0, *halves[0])
          # <= 1 wgmma in flight: the previous step's second block is done.
          acc1 = promote(acc, plgpu.wgmma_accumulator_load(part1, wait_n=1), prev_scales)
          part1[...] = zeros()
          plgpu.wgmma(part1, *halves[1])
          part0_val = plgpu.wgmma_accumulator_load(part0, wait_n=1)
          return promote(acc1, part0_val, scales_of(sa_smem, sb_smem, 0))
        acc = pl.run_scoped(step, plgpu.ACC((tm, tn), jnp.float32))
        return acc, scales_of(sa_smem, sb_smem, 1)

      pipeline_state = None
      if config.cross_tile:  # this CTA's first tile fills the pipeline, its last drains it
        stage = plgpu.PipelinePipeline
        last = loop_info.num_local_steps - 1
        pipeline_state = jnp.where(
            loop_info.local_index == 0, int(stage.START),
            jnp.where(loop_info.local_index == last, int(stage.STOP), int(stage.STEADY)))
      k_slice, kb_slice = pl.ds(si * k_iters * BLOCK, k_iters * BLOCK), pl.ds(si * k_iters, k_iters)
      get_pipeline(body_paired if kps == 2 else body, compute_context, pipeline_state)(
          a_gmem.at[cta_m_slice, k_slice], b_gmem.at[n_slice, k_slice],
          sa_gmem.at[kb_slice, cta_m_slice], sb_gmem.at[kb_slice, n_slice],
          allocations=pipeline_allocs)

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _num_sms() -> int:
  """SMs of the GPU the kernel is built for: the mesh's device, else the default device.

  Traced with neither a GPU mesh nor a GPU attached (a deviceless compile for Hopper on a
  CPU host, shape-only init traces): an H100 SXM / H200's count; only the size of the
  persistent grid depends on it.
  """
  abstract = jax.sharding.get_abstract_mesh().abstract_device
  if abstract is not None:
    return abstract.num_cores
  return getattr(jax.devices()[0], "core_count", None) or HOPPER_SMS


KERNEL_NAME = "infir2_fp8_gemm"
_NAME_RE = re.compile(KERNEL_NAME + r"_(\d+)x(\d+)x(\d+)_n(\d+)_split(\d+)")


def gemm_kernel_name(m: int, n: int, k: int, tile_n: int, split_k: int) -> str:
  """The kernel's name in profiles: its (padded) problem and config, so that a trace's
  per-kernel times give in-step TFLOP/s per GEMM shape (benchmarks/train_step.py)."""
  return f"{KERNEL_NAME}_{m}x{n}x{k}_n{tile_n}_split{split_k}"


def parse_gemm_kernel_name(name: str) -> dict | None:
  """Inverse of gemm_kernel_name (within a longer profiler name); None if it is not ours."""
  match = _NAME_RE.search(name)
  if not match:
    return None
  m, n, k, tile_n, split_k = map(int, match.groups())
  return {"m": m, "n": n, "k": k, "tile_n": tile_n, "split_k": split_k}


@functools.lru_cache(maxsize=None)
def _gemm_kernel(config: TuningConfig, per_column: bool, split_k: int, out_shape, k: int,
                 part_dtype, ctas: int, interpret: bool):
  """The jitted kernel of one static signature, built once.

  A model calls the same GEMM shape many times (every layer, fprop/dgrad/wgrad); as one
  jitted function, JAX lowers its Mosaic GPU module once per program, not at every call
  (the default model's FP8 step made 168 kernel calls and spent 49 s lowering them)."""
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu
  body = functools.partial(_kernel_body, config=config, per_column=per_column, split_k=split_k)
  mesh = dict(
      grid=(ctas,),
      grid_names=("sm",),
      cluster=(1 + (config.cluster is not None),),
      cluster_names=("cluster",),
      num_threads=config.compute_wgs + 1,
      thread_name="wg",
      kernel_name=gemm_kernel_name(out_shape[1], out_shape[2], k, config.tile_n, split_k),
  )
  params = dict(
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      interpret=plgpu.InterpretGPUParams() if interpret else None,
  )
  if config.split_reduce == "xla" or split_k == 1:
    return jax.jit(plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(out_shape, part_dtype),
                                **mesh, **params))
  # The splits add into one zeroed f32 output, passed as a mutable ref (aliased in place).
  kernel = pl.kernel(body, out_type=(), mesh=plgpu.Mesh(**mesh), name=mesh["kernel_name"],
                     **params)

  def reduce_added(a, b, sa, sb):
    out = jax.new_ref(jnp.zeros(out_shape[1:], jnp.float32))
    kernel(a, b, sa, sb, out)
    return out[...][None]
  return jax.jit(reduce_added)


@dataclasses.dataclass(frozen=True)
class KernelScales:
  """Scales in the layout the kernel reads: K-block-major, one per row of A and of B.

  Attributes:
    sa_KbxM: [Kb, M] float32, A's 1x128 tile scales transposed.
    sb_KbxN: [Kb, N] float32, B's scale of each row (a 128x128 block's scale repeated
      over its 128 rows, or a 1x128 tile's own).
    kind: "block" (sb constant over each 128 rows of B: a 128-wide tile promotes with one
      scale per row) or "row".

  cuBLAS's block-scaled GEMM reads the same layout (its "M-major" scales). A producer that
  writes it directly saves the XLA ops kernel_scales() builds it with (a transpose per
  operand, and for 128x128 blocks a broadcast: 1-2 us each on the H200, 14% of the 1.5B's
  16384x256x1536 GEMM; benchmarks/NOTES_kernels.md, session 9).
  """
  sa_KbxM: jax.Array
  sb_KbxN: jax.Array
  kind: str = dataclasses.field(metadata=dict(static=True))


jax.tree_util.register_dataclass(KernelScales, data_fields=["sa_KbxM", "sb_KbxN"],
                                 meta_fields=["kind"])


def kernel_scales(a_q, a_scale, b_q, b_scale) -> KernelScales:
  """The canonical scales ([M, Kb], and [Nb, Kb] or [N, Kb]) in the kernel's layout."""
  kind = check_operands(a_q, a_scale, b_q, b_scale, jnp.float32)
  n = b_q.shape[0]
  sb_NxKb = b_scale if kind == "row" else jnp.repeat(b_scale, BLOCK, axis=0)[:n]
  return KernelScales(a_scale.T, sb_NxKb.T, kind)


def block_scaled_matmul(a_q, a_scale, b_q, b_scale, *, out_dtype=jnp.bfloat16,
                        config: TuningConfig | None = None, interpret: bool = False):
  """Block-scaled FP8 GEMM out[M, N] = (a_q * a_scale) @ (b_q * b_scale)^T.

  Args:
    a_q: [M, K] float8_e4m3fn or float8_e5m2.
    a_scale: [M, ceil(K/128)] float32, 1x128 tiles along K.
    b_q: [N, K] fp8 (K-major).
    b_scale: [ceil(N/128), ceil(K/128)] (128x128 blocks) or [N, ceil(K/128)]
      (1x128 tiles) float32.
    out_dtype: bfloat16 or float32.
    config: tile sizes; None picks default_config(M, N, K, b_scale=kind of b_scale).
    interpret: run the Mosaic GPU interpreter (CPU) instead of compiling.

  Returns:
    [M, N] array of out_dtype.

  Any M, N, K works: K is zero-padded to a multiple of 128, N to 64 and M to 8, and
  either to one whole tile when smaller (a copy, only when unaligned); the tile
  remainders are masked by TMA. Grids with too few tiles for the GPU split K (see
  TuningConfig.split_k). The scales go to the kernel's layout first (kernel_scales);
  matmul_kernel_scales takes them in that layout directly.
  """
  return matmul_kernel_scales(a_q, b_q, kernel_scales(a_q, a_scale, b_q, b_scale),
                              out_dtype=out_dtype, config=config, interpret=interpret)


def matmul_kernel_scales(a_q, b_q, scales: KernelScales, *, out_dtype=jnp.bfloat16,
                         config: TuningConfig | None = None, interpret: bool = False):
  """block_scaled_matmul with its scales already in the kernel's layout (KernelScales)."""
  _check_matrices(a_q, b_q, out_dtype)
  (m, k), n = a_q.shape, b_q.shape[0]
  kb = _cdiv(k, BLOCK)
  for name, s, want in (("sa_KbxM", scales.sa_KbxM, (kb, m)), ("sb_KbxN", scales.sb_KbxN, (kb, n))):
    if s.shape != want or s.dtype != jnp.float32:
      raise ValueError(f"KernelScales.{name}: {s.dtype}{list(s.shape)}, expected float32"
                       f"{list(want)} for a_q {a_q.shape} and b_q {b_q.shape}")
  if scales.kind not in ("block", "row"):
    raise ValueError(f"KernelScales.kind={scales.kind!r}: must be 'block' or 'row'")
  kind = scales.kind
  out_dtype = jnp.dtype(out_dtype)
  num_sms = _num_sms() if not interpret else 4
  # The interpreter runs each warpgroup of a CTA as a thread executing its own XLA program;
  # inside a jitted train step, four per CTA deadlocked on a 2-core host (session 10), so its
  # default stays at two compute warpgroups (three run when a config asks for them).
  config = config or default_config(m, n, k, num_sms, b_scale=kind,
                                    max_compute_wgs=2 if interpret else 3)
  # Swizzled TMA needs whole (8, 128)-byte tiles in each array; tiles overhanging
  # that padding are read as zeros and dropped on write by TMA. An array smaller than
  # one tile is padded to a whole tile: on the H200 such a TMA box gave all-zero output.
  mp = max(_round_up(m, 8), config.cta_m)
  np_ = max(_round_up(n, 64), config.tile_n)
  kp = _round_up(k, BLOCK)
  a = jnp.pad(a_q, ((0, mp - m), (0, kp - k))) if (mp, kp) != (m, k) else a_q
  b = jnp.pad(b_q, ((0, np_ - n), (0, kp - k))) if (np_, kp) != (n, k) else b_q
  sa_KbxM, sb_KbxN = scales.sa_KbxM, scales.sb_KbxN
  per_column = kind == "row" or config.tile_n != BLOCK
  split_k = config.split_k or choose_split_k(mp, np_, kp, config, num_sms)
  k_per_split = split_k_blocks(kb, split_k)
  # Zero scales past M, N and (a ragged last split) K; no op where none is needed.
  kb_pad = split_k * k_per_split - kb
  if (kb_pad, mp - m) != (0, 0):
    sa_KbxM = jnp.pad(sa_KbxM, ((0, kb_pad), (0, mp - m)))
  if (kb_pad, np_ - n) != (0, 0):
    sb_KbxN = jnp.pad(sb_KbxN, ((0, kb_pad), (0, np_ - n)))
  if config.promotion == "paired" and k_per_split % 2:
    config = dataclasses.replace(config, promotion="serial")  # odd K blocks per split
  part_dtype = out_dtype if split_k == 1 else jnp.dtype(jnp.float32)
  config = fit_stages(config, part_dtype)
  clusters = 2 if config.cluster else 1
  work_items = (_cdiv(mp, (2 if config.cluster == "m" else 1) * config.cta_m)
                * _cdiv(np_, (2 if config.cluster == "n" else 1) * config.tile_n) * split_k)
  # As few persistent CTAs (clusters, if any) as give the same number of rounds: each gets an
  # equal share (+-1), e.g. 256 tiles -> 128 CTAs of 2, not 132 of which 8 have one.
  rounds = _cdiv(work_items, num_sms // clusters)
  ctas = _cdiv(work_items, rounds)
  config = resolve_cross_tile(config, work_items, ctas, k_per_split)
  config = check_epi_buffers(config)
  f = _gemm_kernel(config, per_column, split_k, (split_k, mp, np_), kp, part_dtype, ctas,
                   interpret)
  out = f(a, b, sa_KbxM, sb_KbxN)
  out = (out[0] if out.shape[0] == 1 else jnp.sum(out, axis=0)).astype(out_dtype)
  return out[:m, :n] if (mp, np_) != (m, n) else out
