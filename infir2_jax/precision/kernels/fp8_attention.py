"""FP8 attention forward for Hopper (Pallas Mosaic GPU), with its pure-jnp online reference.

The kernel computes `precision/fp8_attention.py`'s forward (issue 39, step 1) in one pass
over the keys, FlashAttention-3's structure (jax/experimental/pallas/ops/gpu/
attention_mgpu.py): a CTA holds 2 x block_q query rows of one head, two compute warpgroups
(block_q rows each) and one memory warpgroup that streams 128-key blocks of K and V through
a TMA pipeline of `max_concurrent_steps` stages. What is FP8:
  S   = (Q8 K8^T) * sq[row] * sk[col] * log2(e) / sqrt(Dh)   (QK^T: E4M3 WGMMA, f32 acc)
        Q8, K8: 1x128 tiles along the head dim, one scale per token and head.
  m   = running row max of S over the blocks so far; P~ = exp2(S - m), 0 where masked
  P8  = quantize(P~) per row of the block: the recipe's 1x128 tile along the keys is one row
        of one 128-key block, so its amax and UE8M0 scale sp come from the registers.
  O  += (P8 V8^T) * sp[row] * sv[col]   (PV: E4M3 WGMMA into a fresh accumulator, promoted
        like the GEMM kernel's row x column scales; V8^T: 1x128 tiles along the tokens,
        sv [Lb, Dh] one scale per 128 keys and head-dim column)
  out = O / l, l the row sum of the unquantized P~ (as the reference).
FP8 WGMMA operands must be K-major: Q8 and K8 are (the head dim is their contraction), and V
is quantized along the tokens into V8^T [B, K, Dh, L] by the pre-pass, which is the K-major
layout PV needs: no transpose inside the kernel. P8 goes to PV through shared memory (8 KB
per warpgroup and block): in jax 0.11.2 an FP8 A operand straight from the registers of the
S accumulator fails Mosaic GPU's layout inference (deviceless, session 23; FA3's FP8 kernel
permutes bytes for it), and the interpreter's wgmma reads only shared memory.

The reference (`precision/fp8_attention._forward`) measures P~ against the row's final max;
this kernel, like any one-pass kernel, against the running max. With power-of-two scales the
quantized P8 is the same either way except where the running max differs from the final one
by a non-power-of-two factor, so the kernel is tested against `online_reference` (the same
block order and running max, in jnp: equal up to float32 summation order and exp2's last
bit) and, within FP8 rounding of P, against the final-max reference.

Documents: segment ids [B, L] whose documents are contiguous runs (as packing makes them).
Keys before the CTA's first document start are skipped a block at a time
(`tile_document_starts`); inside the visited blocks a key is allowed when it is causal and
in the query's document. Blocks every key of which every row of a warpgroup may see (its
rows in one document, the block after the document's start and before the first row) skip
the mask, as FA3 skips it below the diagonal.
Shapes the kernel takes: head dim 128, L a multiple of 2 * block_q and of 128, bfloat16 q,
k, v; H a multiple of K (GQA). The backward stays BF16 (the custom_vjp in fp8_attention.py).
"""
import dataclasses
import functools
import math

import jax
from jax import lax
import jax.numpy as jnp

from infir2_jax.precision import formats
from infir2_jax.precision.formats import scale_from_amax
from infir2_jax.precision.kernels.quantize import quantize_tiles_reference
from infir2_jax.precision.kernels.quantize import quantize_values

BLOCK_KV = 128     # one P tile (1x128 along the keys) and one V token tile per KV block
HEAD_DIM = 128
KERNEL_NAME = "infir2_fp8_attention_fwd"
_LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """How the kernel runs (the numbers are the same whatever is chosen).

  Attributes:
    block_q: query rows per compute warpgroup (a multiple of 64); a CTA takes 2 x block_q.
    max_concurrent_steps: KV blocks in flight in the TMA pipeline (>= 2).
    approx_math: Mosaic GPU's approximate exp2 and division (the only field that may move
      a last bit of P~, hence an FP8 code of P).
    schedule_barrier: FA3's ping-pong of the two compute warpgroups (JAX's
      attention_mgpu.py `use_schedule_barrier`): a shared barrier offsets them by half a
      KV step, so one's softmax runs while the other's WGMMAs hold the tensor cores.
  """
  block_q: int = 64
  max_concurrent_steps: int = 2
  approx_math: bool = True
  schedule_barrier: bool = False

  def __post_init__(self):
    if self.block_q % 64 or self.block_q <= 0:
      raise ValueError(f"AttentionConfig.block_q={self.block_q}: must be a multiple of 64")
    if self.max_concurrent_steps < 2:
      raise ValueError(f"AttentionConfig.max_concurrent_steps={self.max_concurrent_steps}: "
                       "must be >= 2")


DEFAULT_CONFIG = AttentionConfig()


def check_shapes(q, k, v, segment_ids, config: AttentionConfig = DEFAULT_CONFIG) -> None:
  """Raises a ValueError naming what the kernel cannot take."""
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError(f"FP8 attention kernel: q {q.shape}, k {k.shape}, v {v.shape} must be "
                     "[B, L, heads, head_dim]")
  batch, length, heads, dh = q.shape
  if k.shape != v.shape or k.shape[:2] != (batch, length) or k.shape[3] != dh:
    raise ValueError(f"FP8 attention kernel: k {k.shape} and v {v.shape} must both be "
                     f"[{batch}, {length}, kv_heads, {dh}] for q {q.shape}")
  if heads % k.shape[2]:
    raise ValueError(f"FP8 attention kernel: {heads} query heads are not a multiple of "
                     f"{k.shape[2]} key/value heads")
  if dh != HEAD_DIM:
    raise ValueError(f"FP8 attention kernel: head_dim={dh}, only {HEAD_DIM} is supported")
  cta_rows = 2 * config.block_q
  if length % cta_rows or length % BLOCK_KV:
    raise ValueError(f"FP8 attention kernel: sequence length {length} must be a multiple of "
                     f"{max(cta_rows, BLOCK_KV)} (2 x block_q={config.block_q} query rows "
                     f"per CTA, {BLOCK_KV}-key blocks); pad the rows or use the XLA path")
  for name, x in (("q", q), ("k", k), ("v", v)):
    if x.dtype != jnp.bfloat16:
      raise ValueError(f"FP8 attention kernel: {name}.dtype={x.dtype}, expected bfloat16")
  if segment_ids is not None and segment_ids.shape != (batch, length):
    raise ValueError(f"FP8 attention kernel: segment_ids {segment_ids.shape} must be "
                     f"[{batch}, {length}]")


def supports(q, k, v, segment_ids, config: AttentionConfig = DEFAULT_CONFIG) -> bool:
  """Whether the kernel takes these operands (check_shapes without the error)."""
  try:
    check_shapes(q, k, v, segment_ids, config)
  except ValueError:
    return False
  return True


# ----------------------------------------------------------------------------------------
# Operands: the quantization pre-pass (the same tiles as the reference) and the masks' data.


def quantize_operands(q_BxLxHxDh, k_BxLxKxDh, v_BxLxKxDh, fmt: str, scale_format: str):
  """The kernel's FP8 operands and float32 scales, in the layouts it reads:
  q8 [B, L, H, Dh], sq [B, H, L]; k8 [B, L, K, Dh], sk [B, K, L]; v8t [B, K, Dh, L] (V^T,
  1x128 tiles along the tokens), sv [B, K, Lb, Dh]. The tiles are fp8_attention._forward's."""
  tiles = functools.partial(quantize_tiles_reference, fmt=fmt, scale_format=scale_format)
  q8, sq = tiles(q_BxLxHxDh)                                  # scale [B, L, H, 1]
  k8, sk = tiles(k_BxLxKxDh)
  v8t, sv = tiles(jnp.transpose(v_BxLxKxDh, (0, 2, 3, 1)))    # [B, K, Dh, L], [B, K, Dh, Lb]
  return (q8, jnp.transpose(sq[..., 0], (0, 2, 1)), k8, jnp.transpose(sk[..., 0], (0, 2, 1)),
          v8t, jnp.transpose(sv, (0, 1, 3, 2)))


def document_starts(segment_ids_BxL: jax.Array) -> jax.Array:
  """[B, L] int32: the index of the first token of each token's document (contiguous run).
  The runs begin where model/packed_attention.run_starts says; kernels import nothing of the
  model (tests/test_kernels.py), so the two lines are written again here."""
  length = segment_ids_BxL.shape[1]
  pos = jnp.arange(length, dtype=jnp.int32)
  new_run = jnp.concatenate([jnp.ones_like(segment_ids_BxL[:, :1], bool),
                             segment_ids_BxL[:, 1:] != segment_ids_BxL[:, :-1]], axis=1)
  return lax.cummax(jnp.where(new_run, pos, 0), axis=1)


def tile_document_starts(segment_ids_BxL: jax.Array, rows: int) -> jax.Array:
  """[B, T4] int32: per tile of `rows` query rows (a compute warpgroup's), the document start
  of its first row; T4 rounds the tile count up to a multiple of 4 (a TMA row of at least 16
  bytes). A CTA visits key blocks from its first tile's start // 128 on; a tile whose rows
  are one document needs no mask on the blocks from its start to its first row."""
  starts = document_starts(segment_ids_BxL)[:, ::rows]
  pad = -starts.shape[1] % 4
  return jnp.pad(starts, ((0, 0), (0, pad))).astype(jnp.int32)


# ----------------------------------------------------------------------------------------
# The reference of the kernel's arithmetic: one pass over 128-key blocks with a running max.


def online_reference(q_BxLxHxDh, k_BxLxKxDh, v_BxLxKxDh, segment_ids_BxL, *, fmt="e4m3",
                     scale_format="ue8m0"):
  """What the kernel computes, in jnp: [B, L, H, Dh] in q's dtype. Blocks of 128 keys in
  order, S in log2 units, P~ against the running max, P8 per block row, promotion with
  sp[row] * sv[col] (module doc). Skipped blocks hold no allowed key, so visiting every
  block gives the same numbers."""
  batch, length, heads, dh = q_BxLxHxDh.shape
  kv_heads = k_BxLxKxDh.shape[2]
  groups = heads // kv_heads
  q8, sq, k8, sk, v8t, sv = quantize_operands(q_BxLxHxDh, k_BxLxKxDh, v_BxLxKxDh, fmt,
                                              scale_format)
  f32 = jnp.float32
  seg = (jnp.zeros((batch, length), jnp.int32) if segment_ids_BxL is None
         else segment_ids_BxL.astype(jnp.int32))
  q8 = q8.astype(f32).reshape(batch, length, kv_heads, groups, dh)
  sq = sq.reshape(batch, kv_heads, groups, length) * f32(_LOG2E / math.sqrt(dh))
  rows = jnp.arange(length)
  acc = jnp.zeros((batch, kv_heads, groups, length, dh), f32)
  m = jnp.full((batch, kv_heads, groups, length), -jnp.inf, f32)
  l = jnp.zeros((batch, kv_heads, groups, length), f32)
  for j in range(length // BLOCK_KV):
    keys = slice(j * BLOCK_KV, (j + 1) * BLOCK_KV)
    raw = jnp.einsum("blkgd,bskd->bkgls", q8, k8[:, keys].astype(f32),
                     precision=lax.Precision.HIGHEST)
    s = raw * sq[..., None] * sk[:, :, None, None, keys]
    allowed = ((rows[:, None] >= rows[None, keys])[None]
               & (seg[:, :, None] == seg[:, None, keys]))[:, None, None]
    s = jnp.where(allowed, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(m - m_use)
    p = jnp.exp2(s - m_use[..., None])
    amax = jnp.max(p, axis=-1)
    sp = scale_from_amax(amax, fmt, scale_format)
    p8 = quantize_values(p, (1.0 / sp)[..., None], fmt).astype(f32)
    pv = jnp.einsum("bkgls,bkds->bkgld", p8, v8t[..., keys].astype(f32),
                    precision=lax.Precision.HIGHEST)
    acc = acc * alpha[..., None] + pv * (sp[..., None] * sv[:, :, None, None, j, :])
    l = l * alpha + jnp.sum(p, axis=-1)
    m = m_new
  out = acc / l[..., None]
  out = jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(batch, length, heads, dh)
  return out.astype(q_BxLxHxDh.dtype)


# ----------------------------------------------------------------------------------------
# The kernel.


def _kernel(q_gmem, sq_gmem, k_gmem, sk_gmem, vt_gmem, sv_gmem, seg_gmem, kvlo_gmem,
            out_gmem, scoped, *, config: AttentionConfig, groups: int, fmt: str,
            scale_format: str, qk_scale: float):
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu
  bq, bkv, steps = config.block_q, BLOCK_KV, config.max_concurrent_steps
  batch, q_head, q_tile = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("q")
  wg = lax.axis_index("wg")
  smem, barriers = scoped
  (q_smem2, o_smem2, sq_smem2, qseg_smem2, k_smem, vt_smem, sk_smem, sv_smem, kvseg_smem,
   kvlo_smem, p_smem2) = smem
  q_bars, lo_bar, k_bars, v_bars, k_consumed, v_consumed, schedule = barriers
  cta_base = q_tile * (2 * bq)
  i32 = jnp.int32

  def schedule_arrive():
    if config.schedule_barrier:
      plgpu.barrier_arrive(schedule)

  def schedule_wait():
    if config.schedule_barrier:
      plgpu.barrier_wait(schedule)

  def rendezvous():   # FA3's perform_schedule_barrier
    schedule_arrive()
    schedule_wait()

  def kv_range():
    """[lo, hi): the KV blocks this CTA visits (after its first row's document start, up to
    the causal end of its last row)."""
    plgpu.barrier_wait(lo_bar.at[0])
    lo = lax.div(kvlo_smem[2 * q_tile], i32(bkv))
    hi = lax.div(cta_base + 2 * bq + bkv - 1, i32(bkv))
    return lo, hi

  @pl.when(wg < 2)
  def _compute_wg():
    plgpu.set_max_registers(232, action="increase")
    q_smem, o_smem = q_smem2.at[wg], o_smem2.at[wg]
    sq_smem, qseg_smem, p_smem = sq_smem2.at[wg], qseg_smem2.at[wg], p_smem2.at[wg]
    q_base = cta_base + wg * bq
    plgpu.copy_gmem_to_smem(q_gmem.at[batch, pl.ds(q_base, bq), q_head], q_smem,
                            q_bars.at[wg])
    plgpu.copy_gmem_to_smem(sq_gmem.at[batch, q_head, pl.ds(q_base, bq)], sq_smem,
                            q_bars.at[wg])
    plgpu.copy_gmem_to_smem(seg_gmem.at[batch, pl.ds(q_base, bq)], qseg_smem, q_bars.at[wg])
    lo, cta_hi = kv_range()
    hi = lax.div(q_base + bq + bkv - 1, i32(bkv))   # this warpgroup's causal end
    plgpu.barrier_wait(q_bars.at[wg])
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    sq = plgpu.load(sq_smem, layout=row_layout) * jnp.float32(qk_scale)
    q_seg = plgpu.load(qseg_smem, layout=row_layout)
    acc = plgpu.layout_cast(jnp.zeros((bq, HEAD_DIM), jnp.float32), plgpu.Layout.WGMMA)
    m_i = plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32), row_layout)
    l_i = plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), row_layout)

    # Key blocks [u0, u1) need no mask: the rows are one document (contiguous runs), the
    # block starts at or after its start, and ends at or before the first row.
    one_doc = qseg_smem[0] == qseg_smem[bq - 1]
    first_full = lax.div(kvlo_smem[2 * q_tile + wg] + bkv - 1, i32(bkv))
    u0 = jnp.where(one_doc, jnp.clip(first_full, lo, hi), hi)
    u1 = jnp.clip(lax.div(q_base + 1, i32(bkv)), u0, hi)
    pl.when(wg == 1)(rendezvous)   # warpgroup 1 starts half a step behind

    def kv_step(r, carry):
      acc, m_i, l_i = carry
      slot = lax.rem(r, i32(steps))
      kv_block = lo + r
      plgpu.barrier_wait(k_bars.at[slot])

      def qk(acc_ref):
        plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].T)
        rendezvous()
        return plgpu.wgmma_accumulator_load(acc_ref, wait_n=0)
      raw = pl.run_scoped(qk, plgpu.ACC((bq, bkv), jnp.float32))
      sk = plgpu.load(sk_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
      s = (raw * lax.broadcast_in_dim(sq, raw.shape, (0,))
           * lax.broadcast_in_dim(sk, raw.shape, (1,)))

      def apply_mask(s):
        kv_seg = plgpu.load(kvseg_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
        q_ids = plgpu.broadcasted_iota(i32, s.shape, 0, layout=plgpu.Layout.WGMMA) + q_base
        kv_ids = (plgpu.broadcasted_iota(i32, s.shape, 1, layout=plgpu.Layout.WGMMA)
                  + kv_block * bkv)
        allowed = ((q_ids >= kv_ids)
                   & (lax.broadcast_in_dim(q_seg, s.shape, (0,))
                      == lax.broadcast_in_dim(kv_seg, s.shape, (1,))))
        return jnp.where(allowed, s, -jnp.inf)
      # one copy of the loop body (the SM's instruction cache: NOTES_kernels session 18),
      # the mask in a branch of its own
      s = lax.cond((kv_block < u0) | (kv_block >= u1), apply_mask, lambda s: s, s)
      plgpu.barrier_arrive(k_consumed.at[slot])
      m_new = jnp.maximum(m_i, s.max(axis=1))
      m_use = jnp.where(m_new == -jnp.inf, jnp.float32(0), m_new)
      alpha = jnp.exp2(m_i - m_use)
      p = jnp.exp2(s - lax.broadcast_in_dim(m_use, s.shape, (0,)))
      amax = p.max(axis=1)
      sp = scale_from_amax(amax, fmt, scale_format)
      p8 = quantize_values(p, lax.broadcast_in_dim(1.0 / sp, p.shape, (0,)), fmt)
      l_i = l_i * alpha + p.sum(axis=1)
      schedule_arrive()                      # done with the softmax
      plgpu.barrier_wait(v_bars.at[slot])
      schedule_wait()                        # the tensor cores are free

      p_smem[...] = p8      # PV's A operand goes through shared memory (module doc)
      plgpu.commit_smem()

      def pv(acc_ref):
        plgpu.wgmma(acc_ref, p_smem, vt_smem.at[slot].T)
        return plgpu.wgmma_accumulator_load(acc_ref, wait_n=0)
      part = pl.run_scoped(pv, plgpu.ACC((bq, HEAD_DIM), jnp.float32))
      sv = plgpu.load(sv_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
      plgpu.barrier_arrive(v_consumed.at[slot])
      acc = (acc * lax.broadcast_in_dim(alpha, acc.shape, (0,))
             + part * (lax.broadcast_in_dim(sp, acc.shape, (0,))
                       * lax.broadcast_in_dim(sv, acc.shape, (1,))))
      return acc, m_new, l_i

    acc, m_i, l_i = lax.fori_loop(0, hi - lo, kv_step, (acc, m_i, l_i))

    def release(r, _):  # blocks the other warpgroup still needs: consumed without use
      slot = lax.rem(r, i32(steps))
      plgpu.barrier_wait(k_bars.at[slot])   # every phase is observed by every waiter
      plgpu.barrier_wait(v_bars.at[slot])
      plgpu.barrier_arrive(k_consumed.at[slot])
      plgpu.barrier_arrive(v_consumed.at[slot])
      rendezvous()
      rendezvous()
    lax.fori_loop(hi - lo, cta_hi - lo, release, None)
    pl.when(wg == 0)(rendezvous)

    out = acc / lax.broadcast_in_dim(l_i, acc.shape, (0,))
    o_smem[...] = out.astype(o_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, out_gmem.at[batch, pl.ds(q_base, bq), q_head])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == 2)
  def _memory_wg():
    plgpu.set_max_registers(40, action="decrease")
    kv_head = lax.div(q_head, i32(groups))
    plgpu.copy_gmem_to_smem(kvlo_gmem.at[batch], kvlo_smem, lo_bar.at[0])
    lo, hi = kv_range()

    def load(r, slot):
      keys = pl.ds((lo + r) * bkv, bkv)
      plgpu.copy_gmem_to_smem(k_gmem.at[batch, keys, kv_head], k_smem.at[slot], k_bars.at[slot])
      plgpu.copy_gmem_to_smem(sk_gmem.at[batch, kv_head, keys], sk_smem.at[slot],
                              k_bars.at[slot])
      plgpu.copy_gmem_to_smem(seg_gmem.at[batch, keys], kvseg_smem.at[slot], k_bars.at[slot])
      plgpu.copy_gmem_to_smem(vt_gmem.at[batch, kv_head, :, keys], vt_smem.at[slot],
                              v_bars.at[slot])
      plgpu.copy_gmem_to_smem(sv_gmem.at[batch, kv_head, pl.ds(lo + r, 1)],
                              sv_smem.at[pl.ds(slot, 1)], v_bars.at[slot])

    for i in range(steps):
      pl.when(i < hi - lo)(functools.partial(load, i, i))

    @pl.loop(steps, jnp.maximum(hi - lo, steps))
    def _stream(r):
      slot = lax.rem(r, i32(steps))
      plgpu.barrier_wait(k_consumed.at[slot])
      plgpu.barrier_wait(v_consumed.at[slot])
      load(r, slot)

    @pl.loop(jnp.maximum(hi - lo - steps, 0), hi - lo)
    def _drain(r):  # the last blocks' release: every phase is observed by every waiter
      slot = lax.rem(r, i32(steps))
      plgpu.barrier_wait(k_consumed.at[slot])
      plgpu.barrier_wait(v_consumed.at[slot])


@functools.lru_cache(maxsize=None)
def _build(shapes, config: AttentionConfig, groups: int, fmt: str, scale_format: str,
           interpret: bool):
  """The jitted kernel of one static signature."""
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu
  (batch, length, heads, dh), kvlo_cols = shapes
  fp8 = formats.get_format(fmt).dtype
  bq, steps = config.block_q, config.max_concurrent_steps
  qk_scale = _LOG2E / math.sqrt(dh)

  def smem_fp8(shape):
    return plgpu.SMEM(shape, fp8, transforms=(plgpu.TilingTransform((8, 128)),
                                              plgpu.SwizzleTransform(128)))

  def entry(*refs):
    *ins, out_gmem = refs
    bf16_transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    smem = (
        smem_fp8((2, bq, dh)),                                         # Q8 per warpgroup
        plgpu.SMEM((2, bq, dh), jnp.bfloat16, transforms=bf16_transforms),   # the output
        plgpu.SMEM((2, bq), jnp.float32),                              # sq
        plgpu.SMEM((2, bq), jnp.int32),                                # query segment ids
        smem_fp8((steps, BLOCK_KV, dh)),                               # K8 blocks
        smem_fp8((steps, dh, BLOCK_KV)),                               # V8^T blocks
        plgpu.SMEM((steps, BLOCK_KV), jnp.float32),                    # sk
        plgpu.SMEM((steps, dh), jnp.float32),                          # sv
        plgpu.SMEM((steps, BLOCK_KV), jnp.int32),                      # key segment ids
        plgpu.SMEM((kvlo_cols,), jnp.int32),                           # tile document starts
        smem_fp8((2, bq, BLOCK_KV)),                                   # P8 per warpgroup
    )
    barriers = (
        plgpu.Barrier(num_arrivals=3, num_barriers=2),          # q8, sq, segments
        plgpu.Barrier(num_barriers=1),                          # tile document starts
        plgpu.Barrier(num_arrivals=3, num_barriers=steps),      # k8, sk, segments
        plgpu.Barrier(num_arrivals=2, num_barriers=steps),      # v8^T, sv
        plgpu.Barrier(num_arrivals=2, num_barriers=steps),      # K consumed by both WGs
        plgpu.Barrier(num_arrivals=2, num_barriers=steps),      # V consumed by both WGs
        plgpu.Barrier(num_arrivals=2),                          # the schedule (ping-pong)
    )
    pl.run_scoped(
        lambda *scoped: _kernel(*ins, out_gmem, (scoped[:len(smem)], scoped[len(smem):]),
                                config=config, groups=groups, fmt=fmt,
                                scale_format=scale_format, qk_scale=qk_scale),
        *smem, *barriers, collective_axes="wg")

  kernel = plgpu.kernel(
      entry,
      out_type=jax.ShapeDtypeStruct((batch, length, heads, dh), jnp.bfloat16),
      grid=(heads, length // (2 * bq), batch),
      grid_names=("heads", "q", "batch"),
      num_threads=3,
      thread_name="wg",
      kernel_name=KERNEL_NAME,
      compiler_params=(None if interpret
                       else plgpu.CompilerParams(approx_math=config.approx_math)),
      interpret=plgpu.InterpretGPUParams() if interpret else None,
  )
  return jax.jit(kernel)


def fp8_attention_forward(q_BxLxHxDh, k_BxLxKxDh, v_BxLxKxDh, segment_ids_BxL=None, *,
                          fmt="e4m3", scale_format="ue8m0",
                          config: AttentionConfig = DEFAULT_CONFIG, interpret=False):
  """Causal (document-masked) GQA attention with the FP8 forward: [B, L, H, Dh] bfloat16.

  The quantization pre-pass runs in XLA (the same tiles as the reference); the kernel does
  the rest in one pass (module doc). segment_ids [B, L] (contiguous documents) or None.
  """
  check_shapes(q_BxLxHxDh, k_BxLxKxDh, v_BxLxKxDh, segment_ids_BxL, config)
  formats.get_format(fmt)
  formats.check_scale_format(scale_format)
  batch, length, heads, _ = q_BxLxHxDh.shape
  groups = heads // k_BxLxKxDh.shape[2]
  seg = (jnp.zeros((batch, length), jnp.int32) if segment_ids_BxL is None
         else segment_ids_BxL.astype(jnp.int32))
  kvlo = tile_document_starts(seg, config.block_q)
  operands = quantize_operands(q_BxLxHxDh, k_BxLxKxDh, v_BxLxKxDh, fmt, scale_format)
  kernel = _build((q_BxLxHxDh.shape, kvlo.shape[1]), config, groups, fmt, scale_format,
                  bool(interpret))
  return kernel(*operands, seg, kvlo)
