"""Precision recipes as data: one spec per GEMM (fprop, dgrad, wgrad), and a registry of names.

Every GEMM of a linear layer Y = X W (X [M, K] tokens x in, W [K, N]) is written in the
canonical "NT" form out = lhs . rhs^T, both operands contraction-last:
  fprop  Y  = X W      lhs = X   [M, K]   rhs = W^T [N, K]
  dgrad  dX = dY W^T   lhs = dY  [M, N]   rhs = W   [K, N]
  wgrad  dW = X^T dY   lhs = X^T [K, M]   rhs = dY^T [N, M]
An OperandSpec's tile is over that NT operand: (1, 128) is 128 consecutive elements along the
contraction axis of one row (a token for X and dY in fprop/dgrad, a feature for X^T and dY^T
in wgrad, i.e. tiles along the token axis), (128, 128) a square block, (1, -1) a whole row,
None the whole tensor.
"""

import dataclasses

from infir2_jax.errors import ConfigError
from infir2_jax.precision import formats
from infir2_jax.precision.quantize import Tile, resolve_tile


@dataclasses.dataclass(frozen=True)
class OperandSpec:
  """How one GEMM operand is quantized.

  Attributes:
    fmt: "e4m3" | "e5m2", or None to keep the operand in its compute dtype (bf16).
    tile: tile over the NT operand (see module docstring), None per tensor.
    scale_format: "ue8m0" (power-of-two scales) | "fp32".
  """
  fmt: str | None = "e4m3"
  tile: Tile = (1, 128)
  scale_format: str = "ue8m0"

  def __post_init__(self):
    if self.fmt is not None:
      formats.get_format(self.fmt)
      formats.check_scale_format(self.scale_format)
      resolve_tile(self.tile, (1, 1))  # validates the form only
    if isinstance(self.tile, list):
      object.__setattr__(self, "tile", tuple(self.tile))

  @property
  def quantized(self) -> bool:
    return self.fmt is not None


HIGH = OperandSpec(fmt=None, tile=None)  # not quantized: stays in the compute dtype


@dataclasses.dataclass(frozen=True)
class GemmSpec:
  """One GEMM of a linear layer.

  Attributes:
    lhs, rhs: operand specs in the NT form of the module docstring.
    accum_dtype: accumulation dtype; "float32" only (partial sums promoted per 128-K block).
    out_dtype: dtype the GEMM writes; None = what the caller needs (fprop: the
      preferred_element_type or the inputs' dtype; dgrad: x's dtype; wgrad: the kernel's).
      The result is then cast to the dtype JAX requires of the cotangent.
    fast_accum: allow cuBLASLt's fast (non-promoting) FP8 accumulation on the native FP8
      GEMM path (per-tensor / per-row scales). Off: partial sums are promoted, as the contract.
  """
  lhs: OperandSpec = HIGH
  rhs: OperandSpec = HIGH
  accum_dtype: str = "float32"
  out_dtype: str | None = None
  fast_accum: bool = False

  def __post_init__(self):
    if self.accum_dtype != "float32":
      raise ValueError(f"accum_dtype={self.accum_dtype!r}: only 'float32' is supported")
    if self.out_dtype not in (None, "float32", "bfloat16", "float16"):
      raise ValueError(f"out_dtype={self.out_dtype!r}; valid: None, 'float32', 'bfloat16', "
                       "'float16'")

  @property
  def quantized(self) -> bool:
    return self.lhs.quantized or self.rhs.quantized


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
  """How a recipe quantizes attention's forward GEMMs (QK^T, PV); the backward is BF16.

  Attributes:
    fmt: "e4m3" | "e5m2": the format of Q, K, P and V.
    scale_format: "ue8m0" (power-of-two scales) | "fp32".
  """
  fmt: str = "e4m3"
  scale_format: str = "ue8m0"

  def __post_init__(self):
    formats.get_format(self.fmt)
    formats.check_scale_format(self.scale_format)


@dataclasses.dataclass(frozen=True)
class Recipe:
  """A precision recipe: the three GEMMs of every linear layer it is applied to, and
  optionally attention's forward GEMMs (`attention`; None keeps attention in BF16, as the
  paper does)."""
  name: str
  fprop: GemmSpec = GemmSpec()
  dgrad: GemmSpec = GemmSpec()
  wgrad: GemmSpec = GemmSpec()
  description: str = ""
  attention: AttentionSpec | None = None

  @property
  def is_bf16(self) -> bool:
    """True when no operand is quantized: the layer uses plain lax.dot_general."""
    return not (self.fprop.quantized or self.dgrad.quantized or self.wgrad.quantized)

  def gemms(self) -> dict[str, GemmSpec]:
    return {"fprop": self.fprop, "dgrad": self.dgrad, "wgrad": self.wgrad}


_REGISTRY: dict[str, Recipe] = {}


def register_recipe(recipe: Recipe, *, overwrite: bool = False) -> Recipe:
  """Adds a recipe under recipe.name (ValueError if taken, unless overwrite)."""
  if not isinstance(recipe, Recipe):
    raise TypeError(f"register_recipe needs a Recipe, got {type(recipe).__name__}")
  if "=" in recipe.name or not recipe.name:
    raise ValueError(f"recipe name {recipe.name!r} must be non-empty and contain no '='")
  if recipe.name in _REGISTRY and not overwrite:
    raise ValueError(f"recipe {recipe.name!r} is already registered; pass overwrite=True")
  _REGISTRY[recipe.name] = recipe
  return recipe


def recipe_names() -> list[str]:
  return sorted(_REGISTRY)


def get_recipe(name: "str | Recipe") -> Recipe:
  """The registered recipe called `name` (a Recipe passes through)."""
  if isinstance(name, Recipe):
    return name
  if name not in _REGISTRY:
    raise ConfigError(f"unknown precision recipe {name!r}; valid: {recipe_names()}")
  return _REGISTRY[name]


def _infir2(name: str, *, scale_format: str = "ue8m0", grad_fmt: str = "e4m3",
            wgrad_high: bool = False, wgrad_dy_high: bool = False,
            description: str) -> Recipe:
  act = OperandSpec("e4m3", (1, 128), scale_format)      # X, X^T: 1x128 tiles
  grad = OperandSpec(grad_fmt, (1, 128), scale_format)   # dY, dY^T: 1x128 tiles
  weight = OperandSpec("e4m3", (128, 128), scale_format)  # W^T, W: 128x128 blocks
  wgrad_dy = HIGH if wgrad_dy_high else grad
  wgrad = GemmSpec(HIGH, HIGH) if wgrad_high else GemmSpec(act, wgrad_dy)
  return Recipe(name, GemmSpec(act, weight), GemmSpec(grad, weight), wgrad, description)


def _uniform(name: str, tile: Tile, scale_format: str, grad_fmt: str, description: str):
  x, w, g = (OperandSpec(f, tile, scale_format) for f in ("e4m3", "e4m3", grad_fmt))
  return Recipe(name, GemmSpec(x, w), GemmSpec(g, w), GemmSpec(x, g), description)


for _r in (
    Recipe("bf16", description="no quantization: plain lax.dot_general in the compute dtype"),
    _uniform("fp8_tensorwise", None, "fp32", "e5m2",
             "per-tensor current scaling; E4M3 activations/weights, E5M2 gradients; hits "
             "XLA's native FP8 GEMM (cuBLASLt) on GPU"),
    _uniform("fp8_rowwise", (1, -1), "ue8m0", "e4m3",
             "one power-of-two scale per row of every NT operand, E4M3 (torchao rowwise)"),
    _infir2("infir2", description="InfiR2 / DeepSeek-V3: 1x128 activation and gradient tiles, "
            "128x128 weight blocks, E4M3 everywhere, UE8M0 scales"),
    _infir2("infir2_fp32_scale", scale_format="fp32",
            description="infir2 with ordinary float32 scales (the paper's ablation)"),
    _infir2("infir2_e5m2_grad", grad_fmt="e5m2",
            description="infir2 with E5M2 gradients (dY) in dgrad and wgrad"),
    _infir2("infir2_bf16_wgrad", wgrad_high=True,
            description="infir2 with the weight-gradient GEMM kept in bf16"),
    # The one operand where infir2's E4M3 flushes most nonzero values to zero (the wgrad's
    # dY^T: 1x128 tiles along tokens); everything else, dgrad's dY included, stays infir2.
    _infir2("infir2_wgrad_dy_bf16", wgrad_dy_high=True,
            description="infir2 with only the weight-gradient GEMM's dY operand in bf16 "
            "(isolates the wgrad dY underflow)"),
):
  register_recipe(_r)
register_recipe(dataclasses.replace(
    get_recipe("infir2"), name="infir2_fp8attn", attention=AttentionSpec(),
    description="infir2 with attention's forward (QK^T, PV) in E4M3, 1x128 tiles, UE8M0; "
    "its backward in bf16 (precision/fp8_attention.py; XLA only for now)"))
