"""DataConfig: where the text comes from and how it becomes batches (defaults = embedded run)."""

import dataclasses

from infir2_jax.errors import ConfigError

QWEN_SYSTEM_PROMPT = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
FORMATS = ("pretrain", "chat")
BAD_RECORDS = ("skip", "raise")


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Data settings. Field comments are the documentation of the `data.*` config keys."""
  # "default" = the embedded data (pretrain: Shakespeare's works, committed; chat: CHAMP
  # competition-math training problems, fetched from PyPI once), a built-in name
  # (shakespeare, stdlib, champ, champ_heldout, humaneval), or comma-separated globs or
  # directories of .txt/.md/.py/.jsonl/.parquet files (all but .parquet may end in
  # .gz/.xz/.bz2; tokenized into memory), or prepared directories (`python -m
  # infir2_jax.data.prepare`; streamed from disk, for corpora of any size). With `mixture`,
  # every item is NAME=ITEM.
  source: str = "default"
  # Validation data, same syntax (NAME=ITEM with a mixture; unnamed sources hold out their
  # own); "" = hold out `val_fraction` of `source` (a prepared source: the documents held
  # out when it was prepared; for the default chat data: the CHAMP held-out problems, which
  # are also the exact-match eval set).
  val_source: str = ""
  # Weights of named sources, e.g. "web:0.7,math:0.2,code:0.1" ("" = one source, no
  # mixing); each source is shuffled on its own and rows are interleaved in these shares.
  mixture: str = ""
  # "pretrain": documents joined by <|endoftext|> and packed | "chat": {"messages": [...]}
  # records in the Qwen2.5 template, loss on assistant tokens only.
  format: str = "pretrain"
  text_key: str = "text"     # pretrain: the text field of .jsonl/.parquet records
  messages_key: str = "messages"  # chat: the field with [{"role", "content"}, ...]
  doc_separator: str = ""    # pretrain: split text files into documents here ("" = 1 per file)
  # "default" (our 8k byte-level BPE), "qwen2.5" (the real one, built offline from PyPI's
  # dashscope wheel once), or a tokenizer.json path / HF checkpoint directory.
  tokenizer: str = "default"
  # Share of the text (characters) held out, whole documents (prepared sources: 0 = no
  # validation, else the share chosen when they were prepared).
  val_fraction: float = 0.05
  shuffle_seed: int = -1     # data order; -1 = the run's seed
  # chat: system turn inserted when a conversation has none, as Qwen2.5's template does
  # ("" = insert nothing).
  system_prompt: str = QWEN_SYSTEM_PROMPT
  bad_records: str = "skip"  # "skip": count, report and drop bad records | "raise": stop
  cache_dir: str = ""        # token/download cache; "" = $INFIR2_JAX_CACHE or ~/.cache/infir2_jax
  num_workers: int = 0       # grain worker processes building batches (0 = in this process)
  prefetch: int = 2          # batches built ahead by background threads (0 = none)

  def __post_init__(self):
    if self.format not in FORMATS:
      raise ConfigError(f"data.format={self.format!r} is not one of {FORMATS}")
    if self.bad_records not in BAD_RECORDS:
      raise ConfigError(f"data.bad_records={self.bad_records!r} is not one of {BAD_RECORDS}")
    if not 0.0 <= self.val_fraction < 1.0:
      raise ConfigError(f"data.val_fraction={self.val_fraction} must be in [0, 1)")
    if not self.source.strip():
      raise ConfigError("data.source is empty; use 'default', a built-in name or file globs")
    if self.shuffle_seed < -1:
      raise ConfigError(f"data.shuffle_seed={self.shuffle_seed} must be >= 0 (or -1 = run seed)")
    for name in ("num_workers", "prefetch"):
      if getattr(self, name) < 0:
        raise ConfigError(f"data.{name}={getattr(self, name)} must be >= 0")
    if not self.tokenizer:
      raise ConfigError("data.tokenizer is empty; use 'default', 'qwen2.5' or a path")
    if self.format == "pretrain" and not self.text_key:
      raise ConfigError("data.text_key is empty")
    if self.format == "chat" and not self.messages_key:
      raise ConfigError("data.messages_key is empty")
