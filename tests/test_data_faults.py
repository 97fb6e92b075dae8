"""Faulty inputs (issue 23): each is injected, and must be dropped, counted, or named clearly."""

import gzip
import hashlib
import json

import numpy as np
import pytest

from infir2_jax.data import DataConfig, load_tokenizer, make_data
from infir2_jax.data import sources

WORDS = "the king and queen of denmark speak to the ghost at night".split()


def _text(n_words, seed):
  rng = np.random.default_rng(seed)
  return " ".join(rng.choice(WORDS, n_words)) + "."


def _mk(tmp_path, source, **kw):
  cfg = DataConfig(source=str(source), cache_dir=str(tmp_path / "cache"), prefetch=0,
                   **{"val_fraction": 0.0, **kw})
  return make_data(cfg, seq_len=8, global_batch_size=1, seed=0)


def _all_tokens(data):
  it = iter(data.train)
  return np.concatenate([next(it)["inputs"].ravel() for _ in range(data.steps_per_epoch)])


def test_cache_key_includes_the_file_type(tmp_path):
  """The same bytes as c.txt and then as c.jsonl are different documents."""
  line = json.dumps({"text": "the king speaks."}) + "\n"
  (tmp_path / "t").mkdir()
  (tmp_path / "j").mkdir()
  (tmp_path / "t" / "c.txt").write_text(line * 3)
  (tmp_path / "j" / "c.jsonl").write_text(line * 3)
  as_text = _mk(tmp_path, tmp_path / "t" / "c.txt")
  as_jsonl = _mk(tmp_path, tmp_path / "j" / "c.jsonl")   # same cache dir
  assert as_text.stats["train"].records == 1 and as_jsonl.stats["train"].records == 3
  brace = load_tokenizer("default").encode('{"').ids[0]
  assert brace in _all_tokens(as_text) and brace not in _all_tokens(as_jsonl)


def test_non_utf8_jsonl_line_is_a_bad_record_not_replacement_characters(tmp_path):
  good = json.dumps({"text": "the ghost at night."}).encode()
  bad = b'{"text": "the king \xff\xfe speaks."}'
  (tmp_path / "a.jsonl").write_bytes(good + b"\n" + bad + b"\n" + good + b"\n")
  data = _mk(tmp_path, tmp_path / "a.jsonl")
  assert data.stats["bad_records"] == {"not UTF-8": 1}
  assert data.stats["train"].records == 2
  fffd = load_tokenizer("default").encode("\ufffd").ids
  assert not np.isin(_all_tokens(data), fffd).any()
  with pytest.raises(ValueError, match=r"a.jsonl:2: not UTF-8"):
    _mk(tmp_path, tmp_path / "a.jsonl", bad_records="raise")


def test_random_bytes_as_text_do_not_train(tmp_path):
  d = tmp_path / "docs"
  d.mkdir()
  for i in range(3):
    (d / f"good{i}.txt").write_text(_text(30, i))
  (d / "random.txt").write_bytes(np.random.default_rng(0).bytes(4096))
  (d / "controls.txt").write_bytes(bytes(range(1, 9)) * 64)   # valid UTF-8, not text
  data = _mk(tmp_path, d)
  assert data.stats["train"].records == 3
  assert data.stats["bad_records"] == {"not UTF-8": 1, "binary data": 1}


def test_one_huge_document_does_not_become_the_validation_split(tmp_path):
  d = tmp_path / "docs"
  d.mkdir()
  for i in range(20):
    (d / f"small{i:02d}.txt").write_text(_text(40, i))
  # A huge document whose key ranks first in the split's hash order (the old rule took it).
  key = lambda raw: hashlib.sha256(f"{hashlib.sha256(raw).hexdigest()[:16]}:0".encode()).digest()
  smallest = min(key((d / f"small{i:02d}.txt").read_bytes()) for i in range(20))
  nonce = 0
  while key(big := (f"{nonce} " + _text(20000, 99)).encode()) > smallest:
    nonce += 1
  (d / "huge.txt").write_bytes(big)
  data = _mk(tmp_path, d, val_fraction=0.05)
  total = data.stats["train"].tokens + data.stats["val"].tokens
  assert data.stats["val"].records >= 1
  assert data.stats["val"].tokens <= 0.1 * total       # at most twice the asked share
  assert data.stats["train"].tokens > 0.9 * total      # the huge document trains


def test_split_documents_skips_documents_larger_than_twice_the_share():
  keys = [f"k{i}" for i in range(10)]
  order = sorted(range(10), key=lambda i: hashlib.sha256(keys[i].encode()).digest())
  sizes = [10] * 10
  sizes[order[0]] = 10_000
  train, val = sources.split_documents(keys, sizes, 0.05)
  assert order[0] in train and val and sum(sizes[i] for i in val) <= 2 * 0.05 * sum(sizes)
  # Every document too large: the smallest is held out, one document still trains.
  train, val = sources.split_documents(["a", "b"], [100, 90], 0.01)
  assert val == [1] and train == [0]


def test_fake_gzip_names_the_file(tmp_path):
  (tmp_path / "a.jsonl.gz").write_bytes(b'{"text": "not compressed"}\n')
  with pytest.raises(ValueError, match=r"a.jsonl.gz: not a valid .gz file \(BadGzipFile"):
    _mk(tmp_path, tmp_path / "a.jsonl.gz")
  (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(b'{"text": "cut short"}\n' * 50)[:40])
  with pytest.raises(ValueError, match=r"b.jsonl.gz: not a valid .gz file"):
    _mk(tmp_path, tmp_path / "b.jsonl.gz")


def test_nearly_all_bad_lines_are_named_in_the_split_error(tmp_path):
  lines = ["not json"] * 40 + [json.dumps({"text": "one good line."})]
  (tmp_path / "a.jsonl").write_text("\n".join(lines) + "\n")
  with pytest.raises(ValueError, match=r"has 1 usable record \(40 bad records were skipped: "
                                       r"\{'invalid JSON': 40\}, e.g. .*a.jsonl:1: invalid"):
    _mk(tmp_path, tmp_path / "a.jsonl", val_fraction=0.05)
  with pytest.raises(ValueError, match=r"fewer than one global batch .*40 bad records"):
    make_data(DataConfig(source=str(tmp_path / "a.jsonl"), cache_dir=str(tmp_path / "c"),
                         val_fraction=0.0, prefetch=0), seq_len=8, global_batch_size=64, seed=0)
