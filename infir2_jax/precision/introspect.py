"""What really ran: dot_generals of a jaxpr with their FP8 sources and roles; FP8 GEMMs in HLO.

A dot_general "uses FP8" on an operand when that operand is an FP8 array, or is reached from
one through dequantize-like ops only (convert, multiply/divide by a scale, broadcast,
reshape, transpose, slice, pad, select, nested jit calls): the XLA dequantize path converts
float8 q to bf16 and scales it right before the dot, the native path feeds float8 directly.
This mirrors XLA's own FP8 pattern matcher (gemm_rewriter's FindF8SubgraphRecursive).
"""

import dataclasses
import re

import jax
import jax.extend

from infir2_jax.precision.formats import is_fp8_dtype

_PASS_THROUGH = frozenset({
    "convert_element_type", "mul", "div", "broadcast_in_dim", "reshape", "transpose",
    "slice", "pad", "select_n", "squeeze", "expand_dims", "copy", "copy_p", "neg",
    "reduce_precision"})
_CALLS = frozenset({"pjit", "jit", "closed_call", "core_call", "remat", "checkpoint",
                    "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"})
# How Pallas kernels appear in a jaxpr (jax 0.11: plgpu.kernel traces to "mpmd_map").
_KERNEL_CALLS = frozenset({"pallas_call", "mpmd_map"})
ROLE_RE = re.compile(r"fp8_(fprop|dgrad|wgrad)")


@dataclasses.dataclass(frozen=True)
class DotRecord:
  """One dot_general of a jaxpr.

  Attributes:
    name_stack: the named scopes it ran under, e.g. "transpose(jvp(Qwen2))/layers_0/
      self_attn/q_proj/fp8_dgrad".
    role: "fprop" | "dgrad" | "wgrad" from the fp8_* scope, or None (not an FP8 recipe GEMM).
    lhs_dtype, rhs_dtype: the dot's operand dtypes.
    lhs_fp8, rhs_fp8: the FP8 dtype feeding each operand (directly or via dequantize), or None.
    lhs_shape, rhs_shape: operand shapes.
    primitive: "dot_general", or the kernel call ("pallas_call", ...) of a Pallas GEMM, whose
      first two FP8 operands are reported as lhs and rhs.
  """
  name_stack: str
  role: str | None
  lhs_dtype: str
  rhs_dtype: str
  lhs_fp8: str | None
  rhs_fp8: str | None
  lhs_shape: tuple[int, ...]
  rhs_shape: tuple[int, ...]
  primitive: str = "dot_general"

  @property
  def fp8(self) -> bool:
    """Both operands come from FP8."""
    return self.lhs_fp8 is not None and self.rhs_fp8 is not None

  @property
  def native_fp8(self) -> bool:
    """The dot itself takes FP8 arrays (XLA can lower it to an FP8 GEMM directly)."""
    return is_fp8_dtype(self.lhs_dtype) and is_fp8_dtype(self.rhs_dtype)


def _sub_jaxprs(params):
  for value in params.values():
    items = value if isinstance(value, (tuple, list)) else (value,)
    for item in items:
      # jax 0.11 merged ClosedJaxpr into Jaxpr; accept either spelling.
      if isinstance(item, (jax.extend.core.ClosedJaxpr, jax.extend.core.Jaxpr)):
        yield getattr(item, "jaxpr", item)


def _call_jaxpr(eqn):
  if eqn.primitive.name not in _CALLS:
    return None
  subs = list(_sub_jaxprs(eqn.params))
  return subs[0] if len(subs) == 1 else None


def _fp8_source(var, producers, depth=0):
  """The FP8 dtype var is dequantized from, or None."""
  aval = getattr(var, "aval", None)
  if aval is not None and is_fp8_dtype(aval.dtype):
    return str(aval.dtype)
  if aval is None or isinstance(var, jax.extend.core.Literal):
    return None
  eqn = producers.get(var)
  if eqn is None or depth > 32:
    return None
  sub = _call_jaxpr(eqn)
  if sub is not None and len(sub.outvars) == len(eqn.outvars):
    inner = sub.outvars[eqn.outvars.index(var)]
    inner_producers = {v: e for e in sub.eqns for v in e.outvars}
    found = _fp8_source(inner, inner_producers, depth + 1)
    if found is None and inner in sub.invars:  # passed straight through the call
      found = _fp8_source(eqn.invars[sub.invars.index(inner)], producers, depth + 1)
    return found
  if eqn.primitive.name not in _PASS_THROUGH:
    return None
  for operand in eqn.invars:
    found = _fp8_source(operand, producers, depth + 1)
    if found is not None:
      return found
  return None


def _walk(jaxpr, prefix: str, out: list):
  producers = {v: e for e in jaxpr.eqns for v in e.outvars}
  for eqn in jaxpr.eqns:
    stack = str(eqn.source_info.name_stack)
    stack = f"{prefix}/{stack}" if prefix and stack else (prefix or stack)
    name = eqn.primitive.name
    operands = None
    if name == "dot_general":
      operands = eqn.invars[:2]
    elif name in _KERNEL_CALLS or "mosaic" in name:  # a Pallas GEMM: fp8 a_q and b_q in
      fp8 = [v for v in eqn.invars if is_fp8_dtype(getattr(v.aval, "dtype", None))]
      operands = fp8[:2] if len(fp8) >= 2 else None
    if operands is not None:
      lhs, rhs = operands
      role = ROLE_RE.findall(stack)
      out.append(DotRecord(
          stack, role[-1] if role else None, str(lhs.aval.dtype), str(rhs.aval.dtype),
          _fp8_source(lhs, producers), _fp8_source(rhs, producers),
          tuple(lhs.aval.shape), tuple(rhs.aval.shape), name))
      if name != "dot_general":
        continue  # the kernel's body is not another GEMM of the model
    for sub in _sub_jaxprs(eqn.params):
      _walk(sub, stack, out)


def fp8_gemm_report(jaxpr) -> list[DotRecord]:
  """Every dot_general in `jaxpr` (a ClosedJaxpr or Jaxpr, nested calls included)."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  out: list[DotRecord] = []
  _walk(jaxpr, "", out)
  return out


def format_report(records: list[DotRecord]) -> str:
  """A plain-text table of fp8_gemm_report's records."""
  def show(dtype, fp8):
    return dtype if fp8 in (None, dtype) else f"{dtype}<-{fp8}"
  lines = [f"{'role':6} {'lhs':>24} {'rhs':>24}  name_stack"]
  for r in records:
    lhs, rhs = show(r.lhs_dtype, r.lhs_fp8), show(r.rhs_dtype, r.rhs_fp8)
    lines.append(f"{r.role or '-':6} {lhs:>24} {rhs:>24}  {r.name_stack}")
  return "\n".join(lines)


_HLO_FP8_CUSTOM_CALL = re.compile(r'custom_call_target="__cublas\$lt\$matmul\$f8"')
_HLO_FP8_DOT = re.compile(r"=\s*f\w+\[[^\]]*\][^=]*\bdot\(\s*f8e\w+\[")


def hlo_fp8_gemm_count(hlo_text: str) -> dict[str, int]:
  """Counts FP8 GEMMs in compiled HLO text (jax.jit(f).lower(...).compile().as_text()).

  Returns {"cublaslt_f8": ..., "fp8_dot": ...}: cuBLASLt FP8 custom calls, and dot
  instructions with f8 operands left elsewhere (e.g. in Triton fusions). Both count.
  """
  return {"cublaslt_f8": len(_HLO_FP8_CUSTOM_CALL.findall(hlo_text)),
          "fp8_dot": len(_HLO_FP8_DOT.findall(hlo_text))}
