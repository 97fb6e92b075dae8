"""Tokenizers: the committed 8k byte-level BPE ("default"), real Qwen2.5 ("qwen2.5"), or a file.

Rebuild the committed default (deterministic; ~5 s):
  python -m infir2_jax.data.tokenizer
"""

import dataclasses
import functools
import hashlib
import os
import pathlib
import sys

import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

from infir2_jax.data import fetch
from infir2_jax.data import qwen_tokenizer
from infir2_jax.errors import ConfigError, DataError

DEFAULT_ASSET = pathlib.Path(__file__).parent / "assets" / "bpe8k.json"
DEFAULT_VOCAB_SIZE = 8192  # a multiple of 128, special tokens included
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
NAMES = ("default", "qwen2.5", "qwen2")  # qwen2 is an alias: Qwen2 and 2.5 share the BPE


@dataclasses.dataclass(frozen=True)
class SpecialIds:
  """Ids of the tokens the pipelines need; im_start/im_end are None without a chat vocab."""
  eos: int             # <|endoftext|>: ends every pre-training document
  pad: int             # padding id in inputs/targets (masked out; = eos, as in Qwen)
  im_start: int | None
  im_end: int | None   # ends every chat turn; generation stops here


def load_tokenizer(name_or_path: str = "default", *, cache_dir: str = "") -> tokenizers.Tokenizer:
  """Loads a tokenizer by name or path.

  Args:
    name_or_path: "default" (our 8k BPE, committed), "qwen2.5"/"qwen2" (the real Qwen
      tokenizer, built offline from PyPI's dashscope wheel on first use and cached), a
      tokenizer.json file, or a directory containing one (e.g. an HF checkpoint).
    cache_dir: cache root for the Qwen build ("" = $INFIR2_JAX_CACHE or ~/.cache/infir2_jax).

  Returns:
    A shared `tokenizers.Tokenizer` (memoized): do not change its padding/truncation.
  """
  return _load(_resolve(name_or_path, cache_dir))


def _resolve(name_or_path: str, cache_dir: str) -> str:
  if name_or_path == "default":
    return str(DEFAULT_ASSET)
  if name_or_path in ("qwen2.5", "qwen2"):
    return str(qwen_tokenizer.qwen_tokenizer_path(cache_dir))
  path = pathlib.Path(name_or_path).expanduser()
  if path.is_dir():
    path = path / "tokenizer.json"
  if not path.is_file():
    raise ConfigError(f"tokenizer {name_or_path!r} is neither one of {NAMES} nor a "
                      "tokenizer.json file (or a directory holding one)")
  return str(path.resolve())


@functools.lru_cache(maxsize=8)
def _load(path: str) -> tokenizers.Tokenizer:
  try:
    return tokenizers.Tokenizer.from_file(path)
  except Exception as e:
    raise DataError(f"could not load tokenizer {path}: {e}; the file is damaged or not an HF "
                    "tokenizer.json: copy it again, or set data.tokenizer to another") from e


def special_ids(tok: tokenizers.Tokenizer) -> SpecialIds:
  """The ids of <|endoftext|> (or another end-of-text token), <|im_start|>, <|im_end|>."""
  eos = None
  for name in ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>"):
    eos = tok.token_to_id(name)
    if eos is not None:
      break
  if eos is None:
    raise DataError("the tokenizer has no end-of-text token (tried <|endoftext|>, </s>, "
                    "<|end_of_text|>, <eos>, <|eos|>); pre-training needs one between documents")
  return SpecialIds(eos=eos, pad=eos, im_start=tok.token_to_id("<|im_start|>"),
                    im_end=tok.token_to_id("<|im_end|>"))


def fingerprint(tok: tokenizers.Tokenizer) -> str:
  """A content hash of the tokenizer (keys the token cache)."""
  return hashlib.sha256(tok.to_str().encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=8)
def literal_copy(tok: tokenizers.Tokenizer) -> tokenizers.Tokenizer:
  """A (memoized) copy that encodes special-token strings found in text as plain text.

  Raw documents that happen to contain "<|endoftext|>" must not create document
  boundaries (or chat turns) of their own; the pipelines insert special ids themselves.
  Added tokens that are not special (Qwen's <tool_call>, <|fim_prefix|>, ...) still match,
  as in HF.
  """
  copy = tokenizers.Tokenizer.from_str(tok.to_str())
  copy.encode_special_tokens = True
  return copy


def train_default_tokenizer(texts: list[str],
                            vocab_size: int = DEFAULT_VOCAB_SIZE) -> tokenizers.Tokenizer:
  """Trains a byte-level BPE with Qwen's pre-tokenizer; special tokens get ids 0, 1, 2."""
  tok = tokenizers.Tokenizer(models.BPE(byte_fallback=False, fuse_unk=False))
  tok.normalizer = normalizers.NFC()
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(tokenizers.Regex(qwen_tokenizer.SPLIT_PATTERN),
                           behavior="isolated", invert=False),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
  ])
  tok.decoder = decoders.ByteLevel()
  tok.post_processor = processors.ByteLevel(trim_offsets=False)
  trainer = trainers.BpeTrainer(
      vocab_size=vocab_size, min_frequency=2, show_progress=False,
      special_tokens=list(SPECIAL_TOKENS),
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
  if tok.get_vocab_size() != vocab_size:
    raise ValueError(f"trained vocab has {tok.get_vocab_size()} tokens, wanted {vocab_size}: "
                     "the corpus is too small for that many merges")
  return tok


def default_training_texts() -> list[str]:
  """The training split of the embedded default corpus (its validation works excluded)."""
  from infir2_jax.data import sources  # pylint: disable=g-import-not-at-top
  from infir2_jax.data.config import DataConfig  # pylint: disable=g-import-not-at-top
  cfg = DataConfig()
  records = []
  for path in sources.resolve_sources("shakespeare", "pretrain"):
    records.extend(sources.read_records(path, cfg).records)
  train_idx, _ = sources.split_documents([r.key for r in records],
                                         [len(r.value) for r in records], cfg.val_fraction)
  return [records[i].value for i in train_idx]


def main(argv: list[str]) -> None:
  out = pathlib.Path(argv[1]) if len(argv) > 1 else DEFAULT_ASSET
  tok = train_default_tokenizer(default_training_texts())
  fetch.atomic_write(out, tok.to_str(pretty=False).encode())
  print(f"wrote {out}: {tok.get_vocab_size()} tokens, sha256 {fetch.sha256_file(out)}")


if __name__ == "__main__":
  os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
  main(sys.argv)
