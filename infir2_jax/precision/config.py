"""PrecisionConfig: the `precision` config section, and recipe resolution per projection path."""

import dataclasses
import re

from infir2_jax.errors import ConfigError
from infir2_jax.precision import gemm
from infir2_jax.precision.dot_general import QUANTIZE_BACKENDS
from infir2_jax.precision.recipes import Recipe, get_recipe, recipe_names


# Paths that are embeddings or the LM head: BF16 unless quantize_lm_head (the paper's choice).
HEAD_PATH_RE = re.compile(r"(^|/)(lm_head|embed_tokens)(/|$)")


def parse_override(override: str) -> tuple[re.Pattern, str]:
  """"REGEX=RECIPE" -> (compiled regex, recipe name); the last '=' splits."""
  if not isinstance(override, str) or "=" not in override:
    raise ConfigError(f"precision.overrides entry {override!r}: expected 'REGEX=RECIPE', e.g. "
                      "'layers_(0|27)/=bf16'")
  pattern, name = override.rsplit("=", 1)
  try:
    regex = re.compile(pattern)
  except re.error as e:
    raise ConfigError(f"precision.overrides entry {override!r}: bad regex {pattern!r}: {e}") from e
  if name not in recipe_names():
    raise ConfigError(f"precision.overrides entry {override!r}: unknown recipe {name!r}; "
                      f"valid: {recipe_names()}")
  return regex, name


@dataclasses.dataclass(frozen=True)
class PrecisionConfig:
  """Which FP8 recipe runs where, on which backend, and how often to measure it.

  Attributes:
    recipe: named recipe for every projection (see recipes.recipe_names()).
    overrides: "REGEX=RECIPE" entries, matched with re.search against the projection path
      ("layers_0/self_attn/q_proj", "layers_3/mlp/down_proj", "lm_head"); the first match
      wins, e.g. ("layers_(0|27)/=bf16",) keeps the first and last of 28 layers in BF16
      (with model.scan_layers=False: a scanned model needs one recipe for all layers).
    backend: "auto" (Pallas kernels on Hopper when available and the shapes fit, else XLA),
      "xla", or "pallas" (error when the kernels are unusable).
    telemetry_every_steps: collect FP8 numerics telemetry every N steps; 0 = off.
    quantize_lm_head: let the recipe (and overrides) reach the LM head too; when False the
      LM head and embedding paths are always bf16, whatever the overrides say.
    fused_mlp: run each SwiGLU MLP as one op where its recipe allows (precision.fused_mlp:
      gate and up as one GEMM, quantization fused into SwiGLU and its backward); False runs
      its three projections as separate dot_generals (the same quantized operands; dx then
      adds two bf16 products).
    fused_qkv: run each attention's q, k and v projections as one product where their
      recipe allows (precision.fused_qkv, FP8 or bf16: one GEMM each way on the
      concatenated weights; q, k, v and the weight gradients bit for bit as three
      projections, dx summed in one float32 accumulator); False runs three dot_generals.
    fused_norm: hand each fused MLP (fused_mlp above) its post-attention RMSNorm's input,
      row statistics and scale instead of the normed x (precision/normed.py), and each
      fused FP8 q/k/v product (fused_qkv above) its input_layernorm's, so that both norms'
      FP8 tiles come from one read of the residual stream (kernels.quantize_normed_tiles on
      Hopper) and the normed bf16 x is never written nor read back (~2 x 50 MB per norm per
      layer at 1.5B/16k tokens). The same loss and gradients bit for bit
      (tests/test_fused_norm.py). Off: opt-in until measured on the GPU.
    fused_mlp_backward: in the fused MLP on Hopper, SwiGLU's backward and the quantization
      of dgate and dup as one kernel (kernels.swiglu_bwd_quantize) instead of XLA's SwiGLU
      backward and one quantize kernel: the same quantization of the values made, which
      may differ from XLA's in the last bit of exp/division in a few per million. On the
      H200 575 us against 710 at 1.5B/16k tokens, 0.983x the step (session 18); False
      gives back the XLA form.
    quantize_backend: which kernels make the 1x128 tile quantizations on Hopper (X and dY
      of every FP8 projection, the fused MLP's SwiGLU forward and backward): "mosaic"
      (kernels/quantize.py and fused_quantize.py, Mosaic GPU) or "triton" (kernels/
      quantize_triton.py, Pallas Triton, issue 33's design 2; bit-identical quantization,
      the same last-bit caveat on the producers). Opt-in for a step comparison; the
      weights' 128x128 blocks stay Mosaic GPU. Elsewhere XLA runs either way.
    fp8_attention_kernel: recipes with an FP8 attention (infir2_fp8attn) run its forward as
      the Mosaic GPU kernel on Hopper (precision/kernels/fp8_attention.py) instead of the
      XLA forward with dense scores. Off: on the H200 the kernel is 10% of max |out| off
      its reference (session 24, a GPU-only error the interpreter does not show) and 2x
      slower than cuDNN's BF16 forward. `precision.backend=xla` keeps XLA either way.
  """
  recipe: str = "bf16"
  overrides: tuple[str, ...] = ()
  backend: str = "auto"
  telemetry_every_steps: int = 0
  quantize_lm_head: bool = False
  fused_mlp: bool = True
  fused_qkv: bool = True
  fused_norm: bool = False
  fused_mlp_backward: bool = True
  quantize_backend: str = "mosaic"
  fp8_attention_kernel: bool = False

  def __post_init__(self):
    if isinstance(self.overrides, str):
      raise ConfigError(f"precision.overrides={self.overrides!r} must be a tuple of "
                        "'REGEX=RECIPE' strings, not one string")
    object.__setattr__(self, "overrides", tuple(self.overrides))
    if self.recipe not in recipe_names():
      raise ConfigError(f"precision.recipe={self.recipe!r}; valid: {recipe_names()}")
    for override in self.overrides:
      parse_override(override)
    gemm.check_backend(self.backend)
    if self.quantize_backend not in QUANTIZE_BACKENDS:
      raise ConfigError(f"precision.quantize_backend={self.quantize_backend!r}; valid: "
                        f"{list(QUANTIZE_BACKENDS)}")
    if not isinstance(self.telemetry_every_steps, int) or self.telemetry_every_steps < 0:
      raise ConfigError(f"precision.telemetry_every_steps={self.telemetry_every_steps!r}: must "
                        "be an int >= 0 (0 = off)")


def resolve_recipe(cfg: PrecisionConfig, path: str) -> Recipe:
  """The recipe of the projection at `path`: first matching override, else the default.

  Embedding / LM-head paths get bf16 unless cfg.quantize_lm_head.
  """
  if HEAD_PATH_RE.search(path) and not cfg.quantize_lm_head:
    return get_recipe("bf16")
  for override in cfg.overrides:
    regex, name = parse_override(override)
    if regex.search(path):
      return get_recipe(name)
  return get_recipe(cfg.recipe)
