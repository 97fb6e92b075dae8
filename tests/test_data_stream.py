"""Training on prepared directories: the same batches as in memory, per-process reads,
nothing loaded at start-up, checkpoints that resume under another process count."""

import json

import grain
from grain._src.core import sharding as grain_sharding
import numpy as np
import orbax.checkpoint as ocp
import pytest

from infir2_jax.data import DataConfig, make_data
from infir2_jax.data import checkpoint as data_checkpoint
from infir2_jax.data import prepare
from infir2_jax.data import shards

WORDS = ("the king and queen of denmark speak to the ghost at night while soldiers "
         "watch the castle walls and the sea").split()


def write_docs(d, n=40, seed=0):
  d.mkdir(parents=True, exist_ok=True)
  rng = np.random.default_rng(seed)
  for i in range(n):
    (d / f"doc{i:03d}.txt").write_text(" ".join(rng.choice(WORDS, rng.integers(3, 60))) + ".")
  return d


def prepared(tmp_path, name="p", n=40, seed=0, val_fraction="0"):
  src = write_docs(tmp_path / f"{name}_in", n, seed)
  out = tmp_path / name
  prepare.run(prepare.parse_args([f"--source={src}", f"--out={out}", "--no-progress",
                                  "--workers=1", f"--val_fraction={val_fraction}",
                                  "--shard_tokens=200", "--chunk_bytes=200"]))
  return src, out


def mk(tmp_path, source, seq_len=8, batch=4, seed=0, **kw):
  cfg = DataConfig(source=str(source), cache_dir=str(tmp_path / "cache"),
                   **{"prefetch": 0, "val_fraction": 0.0, **kw})
  return lambda **p: make_data(cfg, seq_len=seq_len, global_batch_size=batch, seed=seed, **p)


def take(it, n):
  return [next(it) for _ in range(n)]


def assert_same(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert sorted(x) == sorted(y)
    for k in x:
      np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def test_prepared_source_gives_the_in_memory_batches(tmp_path):
  src, out = prepared(tmp_path)
  mem, prep = mk(tmp_path, src)(), mk(tmp_path, out)()
  assert prep.stats["prepared"] and not mem.stats["prepared"]
  assert mem.stats["train"] == prep.stats["train"]
  n = 2 * mem.steps_per_epoch + 1   # across an epoch boundary (reshuffled)
  assert_same(take(iter(mem.train), n), take(iter(prep.train), n))


def test_start_up_reads_no_tokens_and_each_process_reads_its_slice(tmp_path, monkeypatch):
  _, out = prepared(tmp_path)
  opened = []
  file_read = shards._Files.read  # pylint: disable=protected-access
  monkeypatch.setattr(shards._Files, "read", lambda self, path, *a: opened.append(path)
                      or file_read(self, path, *a))
  whole = mk(tmp_path, out)()
  assert not opened   # the index only: start-up does not grow with the corpus
  read = []
  rows = shards.ShardedStreamRows.rows
  monkeypatch.setattr(shards.ShardedStreamRows, "rows",
                      lambda self, ids: read.append(list(ids)) or rows(self, ids))
  parts = [mk(tmp_path, out)(process_index=p, process_count=2) for p in range(2)]
  w = take(iter(whole.train), 3)
  read.clear()
  p1 = take(iter(parts[1].train), 3)
  assert [len(r) for r in read] == [2, 2, 2]   # 2 of the 4 rows of each global batch
  assert opened and all(f.endswith(".train.tok") for f in opened)   # tokens only
  p0 = take(iter(parts[0].train), 3)
  for x, a, b in zip(w, p0, p1):
    for k in x:
      np.testing.assert_array_equal(x[k], np.concatenate([a[k], b[k]]))


def test_validation_split_of_a_prepared_source(tmp_path):
  _, out = prepared(tmp_path, val_fraction="0.25")
  data = mk(tmp_path, out, val_fraction=0.05)()
  index = json.loads((out / shards.INDEX).read_text())
  assert data.stats["val"].records == index["totals"]["val_docs"] > 0
  assert data.stats["train"].records == index["totals"]["train_docs"]
  assert data.stats["val_source"] == "held out when prepared"
  assert_same(data.eval_batches(), mk(tmp_path, out, val_fraction=0.05, seed=5)().eval_batches())
  assert mk(tmp_path, out)().num_eval_batches() == 0       # data.val_fraction=0: none
  _, no_val = prepared(tmp_path, "nv")
  with pytest.raises(ValueError, match=r"nv was prepared with --val_fraction=0 \(no validation "
                     r"split\); set data.val_fraction=0"):
    mk(tmp_path, no_val, val_fraction=0.05)()
  # A small corpus prepared with a share fit for a large one holds out nothing: the error says
  # that, not that it was prepared without validation (issue 37).
  _, tiny_share = prepared(tmp_path, "ts", val_fraction="0.001")
  assert json.loads((tiny_share / shards.INDEX).read_text())["totals"]["val_docs"] == 0
  with pytest.raises(ValueError, match=r"ts was prepared with --val_fraction=0.001, which held "
                     r"out none of its 40 documents"):
    mk(tmp_path, tiny_share, val_fraction=0.05)()


def test_prepared_source_errors(tmp_path):
  src, out = prepared(tmp_path)
  with pytest.raises(ValueError, match="mixes prepared directories"):
    mk(tmp_path, f"{out},{src}")()
  with pytest.raises(ValueError, match="prepared pre-training data"):
    mk(tmp_path, out, format="chat")()
  index = json.loads((out / shards.INDEX).read_text())
  index["settings"]["tokenizer_fingerprint"] = "0" * 16
  (out / shards.INDEX).write_text(json.dumps(index))
  with pytest.raises(ValueError, match="prepared with tokenizer 'default'"):
    mk(tmp_path, out)()
  _, out2 = prepared(tmp_path, "q")
  tok = next((out2 / "shards").glob("*.train.tok"))
  tok.write_bytes(tok.read_bytes()[:-2])
  with pytest.raises(ValueError, match="damaged"):
    mk(tmp_path, out2)()
  (out2 / shards.INDEX).unlink()
  with pytest.raises(ValueError, match="unfinished preparation"):
    mk(tmp_path, out2)()


def _save(path, it):
  with ocp.CheckpointManager(path) as mngr:
    mngr.save(1, args=ocp.args.Composite(data=data_checkpoint.IteratorSave(it)))
    mngr.wait_until_finished()


def _restore(path, it):
  with ocp.CheckpointManager(path) as mngr:
    mngr.restore(1, args=ocp.args.Composite(data=data_checkpoint.IteratorRestore(it)))


def _as_process(monkeypatch, index, count):
  """Names the data-state files as process `index` of `count` would (the rest stays 1 process)."""
  monkeypatch.setattr(grain_sharding, "get_process_index_and_count", lambda: (index, count))


@pytest.mark.parametrize("before,after", [(2, 1), (2, 4), (1, 2)])
def test_resume_under_another_process_count(tmp_path, monkeypatch, before, after):
  _, out = prepared(tmp_path)
  make = mk(tmp_path, out, batch=4, prefetch=2)
  want = take(iter(make().train), 9)                     # one process, never stopped
  for p in range(before):                                # `before` processes, 5 steps each
    it = iter(make(process_index=p, process_count=before).train)
    take(it, 5)
    _as_process(monkeypatch, p, before)
    _save(tmp_path / f"ckpt{p}", it)
    if p:  # all processes of a run write into one checkpoint directory
      name = f"1/data/process_{p}-of-{before}.json"
      (tmp_path / "ckpt0" / name).write_text((tmp_path / f"ckpt{p}" / name).read_text())
  assert len(list((tmp_path / "ckpt0" / "1" / "data").glob("process_*"))) == before
  got = []
  for p in range(after):
    it = iter(make(process_index=p, process_count=after).train)
    _as_process(monkeypatch, p, after)
    _restore(tmp_path / "ckpt0", it)
    got.append(take(it, 4))
  for k, w in enumerate(want[5:]):
    for key in w:
      np.testing.assert_array_equal(w[key], np.concatenate([g[k][key] for g in got]))


def test_grain_checkpoints_restore_and_differing_states_are_refused(tmp_path, monkeypatch):
  _, out = prepared(tmp_path)
  data = mk(tmp_path, out)()
  it = iter(data.train)
  take(it, 3)
  with ocp.CheckpointManager(tmp_path / "g") as mngr:   # written by grain's own handler
    mngr.save(1, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
    mngr.wait_until_finished()
  want = take(it, 2)
  resumed = iter(data.train)
  _restore(tmp_path / "g", resumed)
  assert_same(want, take(resumed, 2))
  d = tmp_path / "g" / "1" / "data"
  (d / "process_1-of-2.json").write_text(json.dumps({"next_index": 99}))
  (d / "process_0-of-1.json").rename(d / "process_0-of-2.json")
  with pytest.raises(ValueError, match="differ between processes"):
    _restore(tmp_path / "g", iter(data.train))
