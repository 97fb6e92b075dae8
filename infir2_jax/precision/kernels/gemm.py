"""Block-scaled FP8 GEMM for Hopper (Pallas Mosaic GPU), with its pure-jnp reference.

Shape legend: M rows of A / out, N rows of B (columns of out), K contraction,
Kb = ceil(K / 128) scale blocks along K, Nb = ceil(N / 128).

  out[m, n] = sum_kb (sum_{k in kb} f32(a_q[m, k]) * f32(b_q[n, k]))
                     * a_scale[m, kb] * b_scale[r(n), kb]

with r(n) = n // 128 for 128x128 weight blocks (b_scale [Nb, Kb]) and r(n) = n
for 1x128 tiles (b_scale [N, Kb], the wgrad case). Partial sums are promoted to
the f32 accumulator with their scales at every 128-wide K block, as DeepSeek-V3.

This module is the public wrapper (operand checks, padding, config resolution, the jitted
kernel per signature) and the reference; the kernel body itself is gemm_body.py.
"""
import dataclasses
import functools
import re

import jax
from jax import lax
import jax.numpy as jnp

from infir2_jax.precision import formats
from infir2_jax.precision.kernels import gemm_body
from infir2_jax.precision.kernels.tuning import BLOCK
from infir2_jax.precision.kernels.tuning import HOPPER_SMS
from infir2_jax.precision.kernels.tuning import TuningConfig
from infir2_jax.precision.kernels.tuning import choose_split_k
from infir2_jax.precision.kernels.tuning import default_config
from infir2_jax.precision.kernels.tuning import fit_stages
from infir2_jax.precision.kernels.tuning import resolve_cross_tile
from infir2_jax.precision.kernels.tuning import split_k_blocks

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
    if not formats.is_fp8_dtype(x.dtype):
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
  (lowering it per call dominated the default model's compile time; NOTES_kernels.md)."""
  import jax.experimental.pallas.mosaic_gpu as plgpu
  body = functools.partial(gemm_body.kernel_body, config=config, per_column=per_column,
                           split_k=split_k)
  return jax.jit(plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct(out_shape, part_dtype),
      grid=(ctas,),
      grid_names=("sm",),
      num_threads=config.compute_wgs + 1,
      thread_name="wg",
      kernel_name=gemm_kernel_name(out_shape[1], out_shape[2], k, config.tile_n, split_k),
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      interpret=plgpu.InterpretGPUParams() if interpret else None,
  ))


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
  operand, and for 128x128 blocks a broadcast), which weigh on the short GEMMs
  (benchmarks/NOTES_kernels.md).
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


def _check_kernel_scales(a_q, b_q, scales: KernelScales) -> None:
  (m, k), n = a_q.shape, b_q.shape[0]
  kb = _cdiv(k, BLOCK)
  for name, s, want in (("sa_KbxM", scales.sa_KbxM, (kb, m)), ("sb_KbxN", scales.sb_KbxN, (kb, n))):
    if s.shape != want or s.dtype != jnp.float32:
      raise ValueError(f"KernelScales.{name}: {s.dtype}{list(s.shape)}, expected float32"
                       f"{list(want)} for a_q {a_q.shape} and b_q {b_q.shape}")
  if scales.kind not in ("block", "row"):
    raise ValueError(f"KernelScales.kind={scales.kind!r}: must be 'block' or 'row'")


def _resolve_config(config: TuningConfig, mp: int, np_: int, kp: int, out_dtype, num_sms: int):
  """The concrete build of a padded [mp, kp] x [np_, kp] problem.

  Returns (config, split_k, part_dtype, ctas): the config fitted to shared memory and with
  cross_tile decided, the K splits, the dtype the kernel writes (f32 partials when split)
  and the number of persistent CTAs.
  """
  split_k = config.split_k or choose_split_k(mp, np_, kp, config, num_sms)
  part_dtype = out_dtype if split_k == 1 else jnp.dtype(jnp.float32)
  config = fit_stages(config, part_dtype)
  work_items = _cdiv(mp, config.cta_m) * _cdiv(np_, config.tile_n) * split_k
  # As few persistent CTAs as give the same number of rounds: each gets an equal share
  # (+-1), e.g. 256 tiles -> 128 CTAs of 2, not 132 of which 8 have one.
  rounds = _cdiv(work_items, num_sms)
  ctas = _cdiv(work_items, rounds)
  k_per_split = split_k_blocks(kp // BLOCK, split_k)
  config = resolve_cross_tile(config, work_items, ctas, k_per_split)
  return config, split_k, part_dtype, ctas


def matmul_kernel_scales(a_q, b_q, scales: KernelScales, *, out_dtype=jnp.bfloat16,
                         config: TuningConfig | None = None, interpret: bool = False):
  """block_scaled_matmul with its scales already in the kernel's layout (KernelScales)."""
  _check_matrices(a_q, b_q, out_dtype)
  _check_kernel_scales(a_q, b_q, scales)
  (m, k), n = a_q.shape, b_q.shape[0]
  kb = _cdiv(k, BLOCK)
  out_dtype = jnp.dtype(out_dtype)
  num_sms = _num_sms() if not interpret else 4
  # The interpreter runs each warpgroup of a CTA as a thread executing its own XLA program;
  # inside a jitted train step four per CTA deadlocked on a 2-core host, so its default
  # stays at two compute warpgroups (three run when a config asks for them).
  config = config or default_config(m, n, k, num_sms, b_scale=scales.kind,
                                    max_compute_wgs=2 if interpret else 3)
  # Swizzled TMA needs whole (8, 128)-byte tiles in each array; tiles overhanging
  # that padding are read as zeros and dropped on write by TMA. An array smaller than
  # one tile is padded to a whole tile: on the H200 such a TMA box gave all-zero output.
  mp = max(_round_up(m, 8), config.cta_m)
  np_ = max(_round_up(n, 64), config.tile_n)
  kp = _round_up(k, BLOCK)
  a = jnp.pad(a_q, ((0, mp - m), (0, kp - k))) if (mp, kp) != (m, k) else a_q
  b = jnp.pad(b_q, ((0, np_ - n), (0, kp - k))) if (np_, kp) != (n, k) else b_q
  config, split_k, part_dtype, ctas = _resolve_config(config, mp, np_, kp, out_dtype, num_sms)
  # Zero scales past M, N and (a ragged last split) K; no op where none is needed.
  sa_KbxM, sb_KbxN = scales.sa_KbxM, scales.sb_KbxN
  kb_pad = split_k * split_k_blocks(kb, split_k) - kb
  if (kb_pad, mp - m) != (0, 0):
    sa_KbxM = jnp.pad(sa_KbxM, ((0, kb_pad), (0, mp - m)))
  if (kb_pad, np_ - n) != (0, 0):
    sb_KbxN = jnp.pad(sb_KbxN, ((0, kb_pad), (0, np_ - n)))
  per_column = scales.kind == "row" or config.tile_n != BLOCK
  f = _gemm_kernel(config, per_column, split_k, (split_k, mp, np_), kp, part_dtype, ctas,
                   interpret)
  out = f(a, b, sa_KbxM, sb_KbxN)
  out = (out[0] if out.shape[0] == 1 else jnp.sum(out, axis=0)).astype(out_dtype)
  return out[:m, :n] if (mp, np_) != (m, n) else out
