"""Model hyper-parameters: the typed boundary between config files and the Qwen2 modules."""

import dataclasses
import math

from infir2_jax.errors import ConfigError


REMAT_MODES = ("none", "save_dots", "save_dots_fp8", "full")
DOCUMENT_KERNELS = ("cudnn_packed", "fa3_varlen")   # valid values of model.document_kernel


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Qwen2/Qwen2.5 decoder hyper-parameters (names follow HF's Qwen2Config where they exist).

  The defaults are the embedded default: a small model of the Qwen2 family that trains on a
  laptop CPU in minutes. Every width is a multiple of 128 so FP8 tiles align.
  """
  vocab_size: int = 8192            # rows of the embedding table (>= tokenizer size)
  hidden_size: int = 256            # model width D
  intermediate_size: int = 768      # SwiGLU hidden width F
  num_layers: int = 4               # decoder layers
  num_heads: int = 4                # query heads H
  num_kv_heads: int = 2             # key/value heads (grouped-query attention)
  head_dim: int = 0                 # 0 means hidden_size // num_heads
  rope_theta: float = 1e6           # RoPE base frequency
  rms_norm_eps: float = 1e-6        # RMSNorm epsilon
  tie_embeddings: bool = True       # LM head shares the embedding table
  qkv_bias: bool = True             # Qwen2 has biases on q/k/v (Llama has none)
  dtype: str = "bfloat16"           # activation / compute dtype
  param_dtype: str = "float32"      # master weights
  init_std: float = 0.02            # normal init of linear and embedding weights
  attention: str = "xla"            # "xla" | "cudnn" | "auto" (cudnn on GPU)
  # "document": a token attends to earlier tokens of its own packed sequence (segment_ids);
  # "causal": to every earlier token of the row (Megatron's default for pre-training,
  # reset_attention_mask=False). "causal" needs no mask, so cuDNN runs its fastest kernel.
  attention_mask: str = "document"
  # cuDNN attention with the document mask runs cuDNN's packed layout: each row's documents
  # (runs of segment ids) by their starts and lengths, no mask tensor. Its cost and its saved
  # softmax statistics grow with this bound on documents per row; a batch with a row of more
  # documents stops with an error naming this key (benchmarks/attention.py: 2 x 8192 tokens,
  # 8 documents per row, fwd+bwd 0.82 ms at 16, 1.63 ms at 64; dense mask 6.35 ms).
  max_documents: int = 16
  # The GPU kernel of the document mask's packed attention: "cudnn_packed" (cuDNN's packed
  # layout through jax) or "fa3_varlen" (FlashAttention-3's varlen kernel, flash-attn3-jax,
  # Hopper, head size 128; one device: its custom call has no sharding rule). Both attend
  # within each run of segment ids, bounded by max_documents per row.
  document_kernel: str = "cudnn_packed"
  # activation recomputation per layer: "none" | "save_dots" (keep matmul outputs) |
  # "save_dots_fp8" (and FP8 recipes' quantized backward operands) | "full" (keep nothing)
  remat: str = "none"
  # Run the layers as one jax.lax.scan over their stacked params: XLA compiles one layer
  # instead of num_layers (minutes less for 28 FP8 layers). The params stay layers_0..N-1
  # (checkpoints, HF import/export and partition specs unchanged); each step stacks them
  # (a transient copy of the layer params). Needs the same recipe in every layer.
  scan_layers: bool = False
  # Compute the LM head and the loss over chunks of this many positions per row (0: whole
  # rows at once). Only one chunk's float32 logits are live, forward and backward (at 16k
  # tokens x 152k vocab the whole-row logits and their gradient are ~30 GB); each chunk's
  # logits are recomputed in the backward pass (one more LM-head GEMM).
  loss_chunk: int = 0
  # With loss_chunk: the LM head and the loss as one custom derivative that makes each
  # chunk's gradients in the forward pass (train/loss.py, fused_head_cross_entropy_sums): no
  # LM-head GEMM recomputed, and the whole-row loss's numbers (float32 sums of the weight
  # gradient across chunks). Needs a BF16 head (not precision.quantize_lm_head).
  loss_fused: bool = False

  def __post_init__(self):
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "num_kv_heads"):
      if getattr(self, name) <= 0:
        raise ConfigError(f"model.{name} must be positive, got {getattr(self, name)}")
    if self.head_dim < 0:
      raise ConfigError(f"model.head_dim must be >= 0 (0: hidden_size // num_heads), got "
                        f"{self.head_dim}")
    for name in ("rope_theta", "rms_norm_eps", "init_std"):  # NaN and inf fail too
      if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
        raise ConfigError(f"model.{name} must be a finite number > 0, got {getattr(self, name)}")
    if self.rms_norm_eps < 2.0**-126:  # float32's smallest normal; XLA flushes smaller ones
      raise ConfigError(f"model.rms_norm_eps={self.rms_norm_eps!r} is below float32's smallest "
                        "normal 1.17549e-38: it flushes to 0 and an all-zero row gives "
                        "rsqrt(0) = inf; use e.g. 1e-6")
    if self.num_heads % self.num_kv_heads:
      raise ConfigError(f"model.num_heads={self.num_heads} must be a multiple of "
                        f"model.num_kv_heads={self.num_kv_heads}")
    if not self.head_dim and self.hidden_size % self.num_heads:
      raise ConfigError(f"model.hidden_size={self.hidden_size} is not divisible by "
                        f"model.num_heads={self.num_heads}; set model.head_dim explicitly")
    if self.attention not in ("xla", "cudnn", "auto"):
      raise ConfigError(f"model.attention={self.attention!r}; valid: 'xla', 'cudnn', 'auto'")
    if self.max_documents < 1:
      raise ConfigError(f"model.max_documents must be >= 1, got {self.max_documents}")
    if self.loss_chunk < 0:
      raise ConfigError(f"model.loss_chunk must be >= 0 (0: no chunking), got {self.loss_chunk}")
    if self.loss_fused and not self.loss_chunk:
      raise ConfigError("model.loss_fused=True needs model.loss_chunk > 0 (the positions per "
                        "row of each chunk, e.g. 2048)")
    if self.document_kernel not in DOCUMENT_KERNELS:
      raise ConfigError(f"model.document_kernel={self.document_kernel!r}; valid: "
                        f"{', '.join(map(repr, DOCUMENT_KERNELS))}")
    if self.attention_mask not in ("document", "causal"):
      raise ConfigError(f"model.attention_mask={self.attention_mask!r}; valid: 'document', "
                        "'causal'")
    if self.remat not in REMAT_MODES:
      raise ConfigError(f"model.remat={self.remat!r}; valid: {', '.join(map(repr, REMAT_MODES))}")
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in ("float32", "bfloat16", "float16"):
        raise ConfigError(
            f"model.{name}={getattr(self, name)!r}; valid: float32, bfloat16, float16")

  @property
  def head_size(self) -> int:
    return self.head_dim or self.hidden_size // self.num_heads

  def num_params(self, include_embeddings: bool = True) -> int:
    """Exact parameter count (matches jax.eval_shape of the model)."""
    d, f, dh = self.hidden_size, self.intermediate_size, self.head_size
    q, kv = self.num_heads * dh, self.num_kv_heads * dh
    attn = d * q + 2 * d * kv + q * d + (q + 2 * kv if self.qkv_bias else 0)
    layer = attn + 3 * d * f + 2 * d
    n = self.num_layers * layer + d
    if include_embeddings:
      n += self.vocab_size * d * (1 if self.tie_embeddings else 2)
    return n

  def flops_per_token(self, seq_len: int) -> float:
    """Training FLOPs per token: 6 x matmul params (incl. LM head) + causal attention."""
    d, dh = self.hidden_size, self.head_size
    matmul_params = self.num_params(include_embeddings=False) + self.vocab_size * d
    attention = 6 * self.num_layers * seq_len * self.num_heads * dh  # QK^T and PV, causal half
    return 6.0 * matmul_params + attention
