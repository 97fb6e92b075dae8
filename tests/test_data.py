"""Pre-training pipeline: packing semantics, determinism, resumption, sharding, sources."""

import gzip
import json
import sys

import grain
import numpy as np
import orbax.checkpoint as ocp
import pytest

from infir2_jax.data import DataConfig, load_tokenizer, make_data
from infir2_jax.data import corpus
from infir2_jax.data import encoded as encoded_lib
from infir2_jax.data import fetch
from infir2_jax.data import packing
from infir2_jax.data import pipeline
from infir2_jax.data import splits

WORDS = ("the king and queen of denmark speak to the ghost at night while soldiers "
         "watch the castle walls and the sea").split()


def _docs(n, seed=0, lo=3, hi=60):
  rng = np.random.default_rng(seed)
  return [" ".join(rng.choice(WORDS, rng.integers(lo, hi))) + "." for _ in range(n)]


def _write_txt(tmp_path, docs):
  d = tmp_path / "corpus"
  d.mkdir(exist_ok=True)
  for i, text in enumerate(docs):
    (d / f"doc{i:03d}.txt").write_text(text)
  return d


def _cfg(tmp_path, source, **kw):
  kw = {"prefetch": 0, **kw}
  return DataConfig(source=str(source), cache_dir=str(tmp_path / "cache"), **kw)


def _reference_rows(docs_tokens, eos, L, pad):
  """The packing definition, one token at a time (pure Python)."""
  stream, doc_of = [], []
  for d, toks in enumerate(docs_tokens):
    for t in list(toks) + [eos]:
      stream.append(int(t))
      doc_of.append(d)
  rows = []
  for r in range(-(-(len(stream) - 1) // L)):
    row = {k: [0] * L for k in packing.KEYS}
    row["inputs"] = [pad] * L
    row["targets"] = [pad] * L
    seg_of, seg_start = {}, {}
    for j in range(L):
      i = r * L + j
      if i + 1 >= len(stream):
        break
      d = doc_of[i]
      if d not in seg_of:
        seg_of[d], seg_start[d] = len(seg_of) + 1, j
      row["inputs"][j], row["targets"][j] = stream[i], stream[i + 1]
      row["segment_ids"][j], row["positions"][j] = seg_of[d], j - seg_start[d]
      row["loss_mask"][j] = float(doc_of[i + 1] == d)
    rows.append(row)
  return rows


@pytest.mark.parametrize("seq_len", [1, 5, 16])
def test_stream_rows_match_reference(seq_len):
  rng = np.random.default_rng(seq_len)
  docs = [rng.integers(3, 100, rng.integers(1, 12)) for _ in range(9)]
  enc = encoded_lib.Encoded(
      tokens=np.concatenate(docs).astype(np.uint32),
      lengths=np.array([len(d) for d in docs]), keys=[str(i) for i in range(9)],
      sizes=np.ones(9, np.int64), wheres=[""] * 9, mask=None, bad=[])
  special = load_tokenizer_special()
  rows = splits.stream_rows(enc, seq_len, special)
  got = rows.rows(np.arange(len(rows)))
  want = _reference_rows(docs, special.eos, seq_len, special.pad)
  assert len(rows) == len(want)
  for k in packing.KEYS:
    np.testing.assert_array_equal(got[k], np.array([w[k] for w in want]), err_msg=k)


def load_tokenizer_special():
  from infir2_jax.data.tokenizer import special_ids  # pylint: disable=g-import-not-at-top
  return special_ids(load_tokenizer("default"))


def test_one_epoch_is_every_within_document_pair_once(tmp_path):
  docs = _docs(7)
  src = _write_txt(tmp_path, docs)
  data = make_data(_cfg(tmp_path, src, val_fraction=0.0), seq_len=16, global_batch_size=1,
                   seed=3)
  tok = load_tokenizer("default")
  eos = data.special.eos
  want = sorted((a, b) for text in docs
                for a, b in zip(tok.encode(text).ids, tok.encode(text).ids[1:] + [eos]))
  it = iter(data.train)
  batches = [next(it) for _ in range(data.steps_per_epoch)]
  got, cross = [], 0
  for b in batches:
    m = b["loss_mask"] > 0
    got += list(zip(b["inputs"][m].tolist(), b["targets"][m].tolist()))
    cross += int(((b["targets"] != eos) & (b["inputs"] == eos) & m).sum())
  assert sorted(got) == want   # never across documents; every EOS that ends a doc is a target
  assert cross == 0
  assert data.stats["train"].records == 7


def test_batch_format_and_default_corpus_size(tmp_path):
  data = make_data(DataConfig(prefetch=0), seq_len=256, global_batch_size=16, seed=0)
  batch = next(iter(data.train))
  assert sorted(batch) == sorted(packing.KEYS)
  for k, v in batch.items():
    assert v.shape == (16, 256)
    assert v.dtype == (np.float32 if k == "loss_mask" else np.int32)
  # ~300 steps of 16x256 tokens per epoch, and a validation split of whole works.
  assert data.steps_per_epoch >= 300
  assert data.num_eval_batches() >= 8 and data.stats["val"].records >= 2
  assert data.vocab_size == 8192
  assert "shakespeare" in data.summary()
  assert fetch.sha256_file(corpus.SHAKESPEARE_ASSET) == corpus.SHAKESPEARE_ASSET_SHA256


def _take(it, n):
  return [next(it) for _ in range(n)]


def _assert_same(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])


def test_determinism_reshuffle_and_state(tmp_path):
  src = _write_txt(tmp_path, _docs(12, seed=1))
  cfg = _cfg(tmp_path, src, val_fraction=0.0, prefetch=2)   # background threads, as in runs
  make = lambda seed: make_data(cfg, seq_len=8, global_batch_size=1, seed=seed)
  data = make(0)
  epoch = data.steps_per_epoch
  first = _take(iter(data.train), 2 * epoch)
  _assert_same(first, _take(iter(make(0).train), 2 * epoch))          # same seed, same stream
  other = _take(iter(make(1).train), 2)
  assert any((x["inputs"] != y["inputs"]).any() for x, y in zip(first, other))
  # Each epoch is a new permutation of the same rows.
  rows = lambda bs: sorted(map(tuple, np.concatenate([b["inputs"] for b in bs])))
  assert rows(first[:epoch]) == rows(first[epoch:2 * epoch])
  assert not np.array_equal(first[0]["inputs"], first[epoch]["inputs"])

  it = iter(data.train)
  _take(it, 5)
  state = it.get_state()
  after = _take(it, 4)
  fresh = iter(make(0).train)
  fresh.set_state(state)
  _assert_same(after, _take(fresh, 4))
  _assert_same(after, first[5:9])


def test_orbax_checkpoint_of_iterator(tmp_path):
  src = _write_txt(tmp_path, _docs(10, seed=2))
  data = make_data(_cfg(tmp_path, src, val_fraction=0.0, prefetch=2), seq_len=8,
                   global_batch_size=2, seed=0)
  it = iter(data.train)
  _take(it, 3)
  with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
    mngr.save(3, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
    mngr.wait_until_finished()
  want = _take(it, 3)
  restored = iter(data.train)
  with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
    mngr.restore(3, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(restored)))
  _assert_same(want, _take(restored, 3))


def test_process_shards_union_is_the_global_batch(tmp_path):
  src = _write_txt(tmp_path, _docs(20, seed=4))
  cfg = _cfg(tmp_path, src, val_fraction=0.3)
  whole = make_data(cfg, seq_len=8, global_batch_size=4, seed=7)
  parts = [make_data(cfg, seq_len=8, global_batch_size=4, seed=7, process_index=p,
                     process_count=2) for p in range(2)]
  assert parts[0].local_batch_size == 2
  w = _take(iter(whole.train), 3)
  p0, p1 = (_take(iter(p.train), 3) for p in parts)
  for x, a, b in zip(w, p0, p1):
    for k in x:
      np.testing.assert_array_equal(x[k], np.concatenate([a[k], b[k]]))
  ev = whole.eval_batches()
  e0, e1 = parts[0].eval_batches(), parts[1].eval_batches()
  for x, a, b in zip(ev, e0, e1):
    np.testing.assert_array_equal(x["targets"], np.concatenate([a["targets"], b["targets"]]))
  with pytest.raises(ValueError, match="not divisible"):
    make_data(cfg, seq_len=8, global_batch_size=3, seed=0, process_count=2)


def test_validation_split_is_by_document_and_fixed(tmp_path):
  docs = _docs(30, seed=5)
  src = _write_txt(tmp_path, docs)
  cfg = _cfg(tmp_path, src, val_fraction=0.2)
  a = make_data(cfg, seq_len=8, global_batch_size=2, seed=0)
  b = make_data(cfg, seq_len=8, global_batch_size=2, seed=99)   # the split ignores the seed
  _assert_same(a.eval_batches(), b.eval_batches())
  _assert_same(a.eval_batches(), a.eval_batches())
  # Reconstruct the validation documents from the eval batches; none is in training.
  tok = load_tokenizer("default")
  eos = a.special.eos
  val_pairs = sorted((x, y) for e in a.eval_batches()
                     for x, y in zip(e["inputs"][e["loss_mask"] > 0].tolist(),
                                     e["targets"][e["loss_mask"] > 0].tolist()))
  by_doc = {t: sorted(zip(tok.encode(t).ids, tok.encode(t).ids[1:] + [eos])) for t in docs}
  val_docs = [t for t in docs if set(by_doc[t]) <= set(val_pairs)]
  assert sorted(p for t in val_docs for p in by_doc[t]) == val_pairs
  chars = sum(len(t) for t in val_docs) / sum(len(t) for t in docs)
  assert 0.2 <= chars < 0.35 and a.stats["val"].records == len(val_docs)
  assert a.stats["train"].records + a.stats["val"].records == 30
  with pytest.raises(ValueError, match="validation batches"):
    a.eval_batches(a.num_eval_batches() + 1)


def test_file_formats(tmp_path):
  docs = _docs(6, seed=6)
  (tmp_path / "a.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in docs[:3]))
  (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(
      "".join(json.dumps({"body": t}) + "\n" for t in docs[3:]).encode()))
  (tmp_path / "c.txt").write_text("\n<doc>\n".join(docs))
  kw = dict(val_fraction=0.0, text_key="body")
  j = make_data(_cfg(tmp_path, f"{tmp_path}/*.jsonl*", **kw), seq_len=8, global_batch_size=1,
                seed=0)
  t = make_data(_cfg(tmp_path, tmp_path / "c.txt", doc_separator="\n<doc>\n", **kw),
                seq_len=8, global_batch_size=1, seed=0)
  assert j.stats["train"] == t.stats["train"] and j.stats["train"].records == 6
  pa = pytest.importorskip("pyarrow")
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  pq.write_table(pa.table({"body": docs}), tmp_path / "d.parquet")
  p = make_data(_cfg(tmp_path, tmp_path / "d.parquet", **kw), seq_len=8, global_batch_size=1,
                seed=0)
  assert p.stats["train"] == t.stats["train"]


def test_parquet_without_pyarrow_is_a_clear_error(tmp_path, monkeypatch):
  (tmp_path / "d.parquet").write_bytes(b"PAR1")
  monkeypatch.setitem(sys.modules, "pyarrow", None)
  with pytest.raises(ValueError, match="needs pyarrow"):
    make_data(_cfg(tmp_path, tmp_path / "d.parquet"), seq_len=8, global_batch_size=1, seed=0)


def test_errors(tmp_path):
  src = _write_txt(tmp_path, _docs(4, seed=8))
  mk = lambda cfg, **kw: make_data(cfg, **{"seq_len": 8, "global_batch_size": 1, "seed": 0,
                                           **kw})
  with pytest.raises(FileNotFoundError, match="does not exist"):
    mk(_cfg(tmp_path, tmp_path / "missing.txt"))
  with pytest.raises(ValueError, match="matched no files"):
    mk(_cfg(tmp_path, f"{tmp_path}/nothing/*.jsonl"))
  (tmp_path / "x.csv").write_text("a,b")
  with pytest.raises(ValueError, match="unsupported type"):
    mk(_cfg(tmp_path, tmp_path / "x.csv"))
  with pytest.raises(ValueError, match="not pretrain data"):
    mk(_cfg(tmp_path, "champ"))
  with pytest.raises(ValueError, match="format"):
    DataConfig(format="sft")
  with pytest.raises(ValueError, match="bad_records"):
    DataConfig(bad_records="ignore")
  with pytest.raises(ValueError, match="fewer than one global batch of 10000"):
    mk(_cfg(tmp_path, src, val_fraction=0.0), global_batch_size=10000)
  small_val = mk(_cfg(tmp_path, src, val_fraction=0.1), global_batch_size=8)
  (ev,) = small_val.eval_batches()   # fewer rows than a batch: one batch, padded
  rows = small_val.stats["val"].rows
  assert 0 < rows < 8 and (ev["segment_ids"][rows:] == 0).all()
  assert (ev["loss_mask"][rows:] == 0).all() and ev["loss_mask"][:rows].sum() > 0
  with pytest.raises(ValueError, match="no validation split"):
    mk(_cfg(tmp_path, src, val_fraction=0.0)).eval_batches(1)
  (tmp_path / "bad.jsonl").write_text('{"text": ""}\n{"txt": "x"}\nnot json\n')
  with pytest.raises(ValueError, match="no usable records"):
    mk(_cfg(tmp_path, tmp_path / "bad.jsonl"))
  with pytest.raises(ValueError, match="bad.jsonl:1: empty text"):
    mk(_cfg(tmp_path, tmp_path / "bad.jsonl", bad_records="raise"))
  with pytest.raises(ValueError, match="needs >= 2 documents"):
    mk(_cfg(tmp_path, src / "doc000.txt"))


def test_token_cache_hit_and_invalidation(tmp_path, monkeypatch):
  src = _write_txt(tmp_path, _docs(5, seed=9))
  cfg = _cfg(tmp_path, src, val_fraction=0.0)
  first = _take(iter(make_data(cfg, seq_len=8, global_batch_size=1, seed=0).train), 4)

  def boom(*args):
    raise AssertionError("tokenized again despite the cache")

  monkeypatch.setattr(encoded_lib, "_encode_uncached", boom)
  _assert_same(first, _take(iter(make_data(cfg, seq_len=8, global_batch_size=1,
                                           seed=0).train), 4))
  (src / "doc000.txt").write_text("a changed document.")
  with pytest.raises(AssertionError, match="tokenized again"):
    make_data(cfg, seq_len=8, global_batch_size=1, seed=0)


@pytest.mark.slow
def test_worker_processes_give_the_same_stream_and_resume(tmp_path):
  src = _write_txt(tmp_path, _docs(12, seed=10))
  make = lambda workers: make_data(_cfg(tmp_path, src, val_fraction=0.0, num_workers=workers),
                                   seq_len=8, global_batch_size=2, seed=0)
  want = _take(iter(make(0).train), 6)
  it = iter(make(1).train)
  _assert_same(want[:3], _take(it, 3))
  state = it.get_state()
  resumed = iter(make(1).train)
  resumed.set_state(state)
  _assert_same(want[3:], _take(resumed, 3))
