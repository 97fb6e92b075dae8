"""`python -m infir2_jax.data.prepare`: formats, equality with the in-memory pipeline,
parallel workers, resumption after SIGKILL, several machines, bad records, settings."""

import bz2
import filecmp
import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from infir2_jax.data import DataConfig
from infir2_jax.data import chunks as chunks_lib
from infir2_jax.data import encoded as encoded_lib
from infir2_jax.data import prepare
from infir2_jax.data import shards
from infir2_jax.data import sources
from infir2_jax.data import splits
from infir2_jax.data import tokenizer as T

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ("the king and queen of denmark speak to the ghost at night while soldiers "
         "watch the castle walls and the sea").split()


def docs(n, seed=0, lo=3, hi=80):
  rng = np.random.default_rng(seed)
  return [" ".join(rng.choice(WORDS, rng.integers(lo, hi))) + "." for _ in range(n)]


def write_corpus(d, seed=0):
  """Every input kind: jsonl (+gz, +bz2, a bad line), txt with a separator, parquet."""
  d.mkdir(parents=True, exist_ok=True)
  t = docs(60, seed)
  lines = lambda xs: "".join(json.dumps({"text": x}) + "\n" for x in xs)
  (d / "a.jsonl").write_text(lines(t[:20]) + "not json\n" + lines(t[20:25]))
  (d / "b.jsonl.gz").write_bytes(gzip.compress(lines(t[25:35]).encode()))
  (d / "c.jsonl.bz2").write_bytes(bz2.compress((lines(t[35:40]) + '{"text": ""}\n').encode()))
  (d / "d.txt").write_text("\n<doc>\n".join(t[40:50]))
  pa = pytest.importorskip("pyarrow")
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  pq.write_table(pa.table({"text": t[50:60]}), d / "e.parquet", row_group_size=3)
  return t


def run(src, out, *extra):
  return prepare.run(prepare.parse_args(
      [f"--source={src}", f"--out={out}", "--no-progress", "--workers=1",
       "--doc_separator=\n<doc>\n", *extra]))


def in_memory_rows(src, seq_len=16):
  cfg = DataConfig(source=str(src), doc_separator="\n<doc>\n", val_fraction=0.0)
  tok = T.load_tokenizer("default")
  special = T.special_ids(tok)
  enc = encoded_lib.encode_files(sources.resolve_sources(str(src), "pretrain"), cfg, tok,
                                 special)
  return splits.stream_rows(enc, seq_len, special), enc


def prepared_rows(out, split="train", seq_len=16):
  p = shards.open_prepared(str(out))
  return shards.ShardedStreamRows(p.parts[split], p.dtype, seq_len, 0, 0), p


def same_rows(a, b):
  assert len(a) == len(b) and a.num_tokens == b.num_tokens and a.num_records == b.num_records
  ids = np.arange(len(a))
  x, y = a.rows(ids), b.rows(ids)
  for k in x:
    np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def test_prepared_stream_equals_the_in_memory_stream(tmp_path):
  write_corpus(tmp_path / "in")
  # Small parts and chunks: rows cross part boundaries, parts hold several chunks.
  index = run(tmp_path / "in", tmp_path / "out", "--val_fraction=0", "--shard_tokens=150",
              "--chunk_bytes=300")
  mem, enc = in_memory_rows(tmp_path / "in")
  got, p = prepared_rows(tmp_path / "out")
  assert index["totals"]["shards"] > 8
  same_rows(mem, got)
  assert p.totals["records"] == len(enc.keys) == 60
  assert p.totals["bad"] == {"invalid JSON": 1, "empty text": 1}
  assert p.dtype == np.dtype("<u2")
  # A part holds whole documents: each .tok file ends with <|endoftext|>.
  for part in p.parts["train"]:
    assert np.memmap(part.tok, dtype=p.dtype, mode="r")[-1] == 0


def test_two_worker_processes_write_the_same_shards(tmp_path):
  write_corpus(tmp_path / "in")
  run(tmp_path / "in", tmp_path / "one", "--val_fraction=0.2", "--chunk_bytes=500")
  run(tmp_path / "in", tmp_path / "two", "--val_fraction=0.2", "--chunk_bytes=500",
      "--workers=2")
  cmp = filecmp.dircmp(tmp_path / "one" / "shards", tmp_path / "two" / "shards")
  assert not cmp.diff_files and not cmp.left_only and not cmp.right_only
  assert len(cmp.common_files) > 20


def test_validation_documents_are_chosen_by_a_hash_of_their_text(tmp_path):
  texts = write_corpus(tmp_path / "in")
  index = run(tmp_path / "in", tmp_path / "out", "--val_fraction=0.3")
  held = {t for t in texts if chunks_lib.is_val(t, 0.3)}
  assert 0 < len(held) < 30
  tok = T.load_tokenizer("default")
  val, _ = prepared_rows(tmp_path / "out", "val")
  assert index["totals"]["val_docs"] == len(held) == val.num_records
  assert val.num_tokens == sum(len(tok.encode(t).ids) + 1 for t in held)
  train, _ = prepared_rows(tmp_path / "out", "train")
  assert train.num_records + val.num_records == 60


def _kill_command(src, out, kill_after):
  """A prepare run that SIGKILLs itself after `kill_after` chunks (mid-part)."""
  code = (
      "import os, signal, sys\n"
      "from infir2_jax.data import prepare\n"
      "add, seen = prepare._Writer.add, [0]\n"
      "def add_then_die(self, chunk, enc):\n"
      "  add(self, chunk, enc)\n"
      "  seen[0] += 1\n"
      f"  if seen[0] == {kill_after}:\n"
      "    os.kill(os.getpid(), signal.SIGKILL)\n"
      "prepare._Writer.add = add_then_die\n"
      "prepare.main(sys.argv[1:])\n")
  return [sys.executable, "-c", code, f"--source={src}", f"--out={out}", "--no-progress",
          "--workers=1", "--doc_separator=\n<doc>\n", "--shard_tokens=150",
          "--chunk_bytes=300", "--val_fraction=0.1"]


def test_resumes_after_sigkill_and_redoes_only_the_interrupted_part(tmp_path, monkeypatch):
  write_corpus(tmp_path / "in")
  args = ["--shard_tokens=150", "--chunk_bytes=300", "--val_fraction=0.1"]
  encoded = []
  encode = chunks_lib.encode_documents
  monkeypatch.setattr(chunks_lib, "encode_documents",
                      lambda c, *a: encoded.append(c.start) or encode(c, *a))
  run(tmp_path / "in", tmp_path / "full", *args)
  all_chunks = len(encoded)
  out = tmp_path / "killed"
  proc = subprocess.run(_kill_command(tmp_path / "in", out, 12), cwd=ROOT,
                        capture_output=True, text=True, timeout=120,
                        env={**os.environ, "PYTHONPATH": ROOT})
  assert proc.returncode == -9, proc.stderr
  assert not (out / shards.INDEX).exists()
  done = sorted((out / "shards").glob("*.json"))
  assert done and list((out / "shards").glob("*.partial")), "killed mid-part"
  with pytest.raises(ValueError, match="unfinished preparation"):
    shards.open_prepared(str(out))

  encoded.clear()
  run(tmp_path / "in", out, *args)
  # The finished parts' chunks are not encoded again; the interrupted part's are.
  assert all_chunks - 12 <= len(encoded) < all_chunks
  cmp = filecmp.dircmp(tmp_path / "full" / "shards", out / "shards")
  assert not cmp.diff_files and not cmp.left_only and not cmp.right_only
  a, _ = prepared_rows(tmp_path / "full")
  b, _ = prepared_rows(out)
  same_rows(a, b)


def test_several_workers_split_by_file_and_the_last_writes_the_index(tmp_path):
  write_corpus(tmp_path / "in")
  run(tmp_path / "in", tmp_path / "one", "--val_fraction=0.1")
  out = tmp_path / "multi"
  assert run(tmp_path / "in", out, "--val_fraction=0.1", "--worker_index=1",
             "--worker_count=2") is None
  assert sorted(p.name for p in (out / "files").iterdir()) == ["000001.json", "000003.json"]
  assert not (out / shards.INDEX).exists()
  index = run(tmp_path / "in", out, "--val_fraction=0.1", "--worker_index=0",
              "--worker_count=2")
  assert index is not None and (out / shards.INDEX).exists()
  one = json.loads((tmp_path / "one" / shards.INDEX).read_text())
  assert index["shards"] == one["shards"] and index["totals"] == one["totals"]
  same_rows(prepared_rows(tmp_path / "one")[0], prepared_rows(out)[0])
  assert run(tmp_path / "in", out, "--val_fraction=0.1", "--finalize")["totals"] == one["totals"]


def test_other_settings_in_the_same_directory_are_refused(tmp_path):
  write_corpus(tmp_path / "in")
  run(tmp_path / "in", tmp_path / "out", "--val_fraction=0.1")
  with pytest.raises(ValueError, match="other settings .*val_fraction"):
    run(tmp_path / "in", tmp_path / "out", "--val_fraction=0.2")
  (tmp_path / "in" / "a.jsonl").write_text('{"text": "changed."}\n')
  with pytest.raises(ValueError, match="inputs"):
    run(tmp_path / "in", tmp_path / "out", "--val_fraction=0.1")


def test_bad_inputs_are_counted_by_reason_or_named(tmp_path, capsys):
  d = tmp_path / "in"
  d.mkdir()
  (d / "a.jsonl").write_bytes(b'{"text": "good."}\n{"text": "\xff"}\n{"txt": 1}\n'
                              b'{"text": "\\ud800"}\n[1\n')
  (d / "r.txt").write_bytes(np.random.default_rng(0).bytes(2000))
  index = run(d, tmp_path / "out")
  assert index["totals"]["bad"] == {"not UTF-8": 3, "missing text field": 1, "invalid JSON": 1}
  assert index["totals"]["records"] == 1
  assert "5 bad records (invalid JSON: 1, missing text field: 1, not UTF-8: 3)" in (
      capsys.readouterr().out)
  with pytest.raises(ValueError, match=r"a.jsonl:2: not UTF-8.*--bad_records=raise"):
    run(d, tmp_path / "out2", "--bad_records=raise")
  (tmp_path / "z").mkdir()
  (tmp_path / "z" / "f.jsonl.gz").write_bytes(b'{"text": "plain"}\n')
  with pytest.raises(ValueError, match=r"f.jsonl.gz: not a valid .gz file"):
    run(tmp_path / "z", tmp_path / "out3")


def test_command_line_prints_a_summary(tmp_path):
  write_corpus(tmp_path / "in")
  proc = subprocess.run(
      [sys.executable, "-m", "infir2_jax.data.prepare", f"--source={tmp_path / 'in'}/*.jsonl*",
       f"--out={tmp_path / 'out'}", "--workers=1"], cwd=ROOT, capture_output=True, text=True,
      timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
  assert proc.returncode == 0, proc.stderr
  assert "3 files" in proc.stdout and "bad records (empty text: 1, invalid JSON: 1)" in (
      proc.stdout)
  assert "prepare" in proc.stderr   # the progress bar


def test_endoftext_made_from_text_is_refused(tmp_path):
  """Readers end a document at every <|endoftext|>: one made from text would split it."""
  chunk = chunks_lib.Chunk(0, "text", "x.txt", 0, 1, [b"a <|endoftext|> b"], 0)
  cfg = {"dtype": "<u2", "text_key": "text", "val_fraction": 0.0, "eos": 0}
  tok = T.load_tokenizer("default")
  assert chunks_lib.encode_documents(chunk, T.literal_copy(tok), cfg).records == 1
  with pytest.raises(ValueError, match="made <\\|endoftext\\|> .* out of document text"):
    chunks_lib.encode_documents(chunk, tok, cfg)


def test_a_small_corpus_prepared_with_defaults_trains_with_the_default_config(tmp_path):
  """prepare's default --val_fraction is data.val_fraction's (issue 37: 0.001 against 0.05
  held out nothing of a small corpus, and the default config then could not train on it)."""
  from infir2_jax.data import make_data  # pylint: disable=g-import-not-at-top
  assert prepare.parse_args(["--source=x", "--out=y"]).val_fraction == DataConfig().val_fraction
  src = tmp_path / "small.jsonl"
  src.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs(200)))
  prepare.run(prepare.parse_args([f"--source={src}", f"--out={tmp_path / 'out'}",
                                  "--no-progress", "--workers=1"]))
  data = make_data(DataConfig(source=str(tmp_path / "out"), cache_dir=str(tmp_path / "c")),
                   seq_len=16, global_batch_size=2, seed=0)
  assert data.num_eval_batches() > 0


def test_inputs_without_documents_are_an_error(tmp_path):
  src = tmp_path / "bad.jsonl"
  src.write_text('not json\n{"text": ""}\n')
  with pytest.raises(ValueError, match=r"yields no documents \(2 bad records: empty text: "
                     r"1, invalid JSON: 1\)"):
    run(src, tmp_path / "out")
