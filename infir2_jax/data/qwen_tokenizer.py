"""The real Qwen2/Qwen2.5 tokenizer, rebuilt offline from dashscope's `qwen.tiktoken` ranks.

`qwen.tiktoken` lists the 151,643 byte-level BPE tokens with their ranks (merge order).
We turn it into an HF `tokenizers` BPE: the vocab maps each token's bytes (spelled with
GPT-2's bytes_to_unicode alphabet) to its rank, and each multi-byte token contributes the
one merge that tiktoken's own algorithm performs last when it builds that token.
"""

import base64
import functools

import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors

from infir2_jax.data import fetch

# Qwen2's pre-tokenizer split pattern (as in its tokenizer.json).
SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# The 22 added tokens of Qwen2.5 at ids 151643..151664; the last 8 are not "special"
# (they are kept when decoding with skip_special_tokens, as in Qwen's tokenizer_config).
ADDED_TOKENS = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False),
    ("</tool_call>", False), ("<|fim_prefix|>", False), ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False), ("<|fim_pad|>", False), ("<|repo_name|>", False),
    ("<|file_sep|>", False),
)
NUM_RANKS = 151643

DASHSCOPE = ("dashscope", "2.0.2", "dashscope/resources/qwen.tiktoken",
             "b2b1b8dfb5cc5f024bafc373121c6aba3f66f9a5a0269e243470a1de16a33186")


@functools.cache
def bytes_to_unicode() -> dict[int, str]:
  """GPT-2's reversible map from the 256 byte values to printable unicode characters."""
  bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1)))
  cs = bs[:]
  n = 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  return dict(zip(bs, map(chr, cs)))


def read_ranks(path) -> dict[bytes, int]:
  """Parses a tiktoken ranks file: one `base64(token) rank` per line."""
  ranks = {}
  with open(path, "rb") as f:
    for line in f:
      if line.strip():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
  return ranks


def _last_merge(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
  """Runs tiktoken's BPE on `token` with the merges ranked below it; returns the 2 parts.

  tiktoken merges the adjacent pair whose concatenation has the lowest rank (leftmost on
  ties) until none is left. Stopping below `token`'s own rank leaves exactly the pair
  whose merge creates it.
  """
  limit = ranks[token]
  parts = [token[i:i + 1] for i in range(len(token))]
  while len(parts) > 2:
    best, best_rank = -1, limit
    for i in range(len(parts) - 1):
      r = ranks.get(parts[i] + parts[i + 1])
      if r is not None and r < best_rank:
        best, best_rank = i, r
    if best < 0:
      break
    parts[best:best + 2] = [parts[best] + parts[best + 1]]
  if len(parts) != 2:
    raise ValueError(f"token {token!r} (rank {limit}) is not reachable by BPE merges")
  return parts[0], parts[1]


def vocab_and_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
  """HF BPE vocab (unicode-spelled token -> id) and merges (in rank order)."""
  b2u = bytes_to_unicode()
  spell = lambda b: "".join(b2u[x] for x in b)
  vocab = {spell(tok): rank for tok, rank in ranks.items()}
  merges = []
  for tok, _ in sorted(ranks.items(), key=lambda kv: kv[1]):
    if len(tok) > 1:
      left, right = _last_merge(tok, ranks)
      merges.append((spell(left), spell(right)))
  return vocab, merges


def build_qwen_tokenizer(ranks_path) -> tokenizers.Tokenizer:
  """Builds the Qwen2.5 tokenizer (151,665 tokens) from a `qwen.tiktoken` file."""
  ranks = read_ranks(ranks_path)
  if len(ranks) != NUM_RANKS or sorted(ranks.values()) != list(range(NUM_RANKS)):
    raise ValueError(f"{ranks_path} is not Qwen's rank file: {len(ranks)} ranks, expected "
                     f"{NUM_RANKS} contiguous ones")
  vocab, merges = vocab_and_merges(ranks)
  tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=False,
                                        fuse_unk=False))
  tok.normalizer = normalizers.NFC()
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(tokenizers.Regex(SPLIT_PATTERN), behavior="isolated",
                           invert=False),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
  ])
  tok.decoder = decoders.ByteLevel()
  tok.post_processor = processors.ByteLevel(trim_offsets=False)
  tok.add_tokens([tokenizers.AddedToken(content, special=special, normalized=False)
                  for content, special in ADDED_TOKENS])
  for i, (content, _) in enumerate(ADDED_TOKENS):
    if tok.token_to_id(content) != NUM_RANKS + i:
      raise AssertionError(f"{content} got id {tok.token_to_id(content)}")
  return tok


def qwen_tokenizer_path(cache_dir: str = ""):
  """Path of the cached Qwen2.5 tokenizer.json, building it on first use (~10 s)."""
  dest = fetch.cache_root(cache_dir) / "tokenizers" / "qwen2.5-v1" / "tokenizer.json"
  if not dest.exists():
    ranks_path = fetch.pypi_file(*DASHSCOPE, cache_dir=cache_dir)
    tok = build_qwen_tokenizer(ranks_path)
    fetch.atomic_write(dest, tok.to_str().encode())
  return dest
