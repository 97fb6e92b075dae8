"""data.mixture: named sources mixed by weight, deterministic per seed, validation per source."""

import numpy as np
import pytest

from infir2_jax.data import DataConfig, load_tokenizer, make_data
from infir2_jax.data import mixture
from infir2_jax.data import prepare

# Disjoint vocabularies, so every token tells which source it came from.
VOCAB = {"a": "king queen castle ghost night".split(), "b": "seven eight nine zero four".split()}


def write(d, words, n, seed):
  d.mkdir(parents=True, exist_ok=True)
  rng = np.random.default_rng(seed)
  for i in range(n):
    (d / f"doc{i:03d}.txt").write_text(" ".join(rng.choice(words, rng.integers(5, 40))))
  return d


@pytest.fixture(name="srcs")
def _srcs(tmp_path):
  a = write(tmp_path / "a", VOCAB["a"], 40, 0)
  b = write(tmp_path / "b", VOCAB["b"], 12, 1)
  prepare.run(prepare.parse_args([f"--source={a}", f"--out={tmp_path / 'a_prep'}",
                                  "--no-progress", "--workers=1", "--val_fraction=0.2"]))
  return tmp_path / "a_prep", b


def mk(tmp_path, srcs, mix="a:0.75,b:0.25", seed=0, **kw):
  cfg = DataConfig(source=f"a={srcs[0]},b={srcs[1]}", mixture=mix, prefetch=0,
                   cache_dir=str(tmp_path / "cache"), **{"val_fraction": 0.2, **kw})
  return lambda **p: make_data(cfg, seq_len=8, global_batch_size=4, seed=seed, **p)


def token_sets():
  tok = load_tokenizer("default")
  return {k: {i for w in ws for i in tok.encode(" " + w).ids + tok.encode(w).ids}
          for k, ws in VOCAB.items()}


def row_sources(batch, sets):
  """'a' or 'b' per row, by the (non-EOS) tokens it holds."""
  out = []
  for row, seg in zip(batch["inputs"], batch["segment_ids"]):
    ids = set(row[(seg > 0) & (row != 0)].tolist())
    assert ids, "an empty row"
    (name,) = [k for k, s in sets.items() if ids <= s]
    out.append(name)
  return out


def test_rows_come_in_the_weights_shares_and_each_source_cycles_alone(tmp_path, srcs):
  data = mk(tmp_path, srcs)()
  sets = token_sets()
  it = iter(data.train)
  batches = [next(it) for _ in range(60)]
  names = [n for b in batches for n in row_sources(b, sets)]
  assert names.count("a") == 180 and names.count("b") == 60      # exactly 3:1
  assert data.stats["mixture"]["a"]["realized"] == 0.75
  assert "realized 0.750" in data.summary()
  # b has few rows: its epochs repeat (each a new order), every row equally often.
  b_rows = [tuple(r) for bt in batches for r, n in zip(bt["inputs"], row_sources(bt, sets))
            if n == "b"]
  n_b = data.stats["mixture"]["b"]["train"].rows
  counts = np.unique(np.array(b_rows[: (60 // n_b) * n_b]), axis=0, return_counts=True)[1]
  assert len(counts) == n_b and (counts == 60 // n_b).all()


def test_deterministic_per_seed_and_resumable(tmp_path, srcs):
  first = [next(it) for it in [iter(mk(tmp_path, srcs)().train)] for _ in range(12)]
  again = iter(mk(tmp_path, srcs)().train)
  for x in first:
    y = next(again)
    assert all((x[k] == y[k]).all() for k in x)
  other = iter(mk(tmp_path, srcs, seed=1)().train)
  other_batches = [next(other) for _ in range(12)]
  assert any((x["inputs"] != y["inputs"]).any() for x, y in zip(first, other_batches))
  sets = token_sets()
  assert [row_sources(b, sets) for b in first] == [row_sources(b, sets) for b in other_batches]
  it = iter(mk(tmp_path, srcs)().train)
  for _ in range(5):
    next(it)
  resumed = iter(mk(tmp_path, srcs)().train)
  resumed.set_state(it.get_state())
  for x in first[5:]:
    y = next(resumed)
    assert all((x[k] == y[k]).all() for k in x)


def test_processes_split_mixed_batches(tmp_path, srcs):
  whole = iter(mk(tmp_path, srcs)().train)
  parts = [iter(mk(tmp_path, srcs)(process_index=p, process_count=2).train) for p in range(2)]
  for _ in range(6):
    w, a, b = next(whole), next(parts[0]), next(parts[1])
    for k in w:
      np.testing.assert_array_equal(w[k], np.concatenate([a[k], b[k]]))


def test_validation_per_source_and_mixed(tmp_path, srcs):
  data = mk(tmp_path, srcs)()
  sets = token_sets()
  assert data.eval_sources == ["a", "b"]
  for name in ("a", "b"):
    rows = [n for b in data.eval_batches(source=name) for n, m in
            zip(row_sources_or_pad(b, sets), b["loss_mask"].sum(1)) if m > 0]
    assert rows and set(rows) == {name}
  mixed = [n for b in data.eval_batches() for n in row_sources_or_pad(b, sets) if n]
  assert mixed.count("b") > 0 and abs(mixed.count("a") - 3 * mixed.count("b")) <= 3
  with pytest.raises(ValueError, match="no validation split of source 'c'"):
    data.eval_batches(source="c")


def row_sources_or_pad(batch, sets):
  out = []
  for row, seg in zip(batch["inputs"], batch["segment_ids"]):
    ids = set(row[(seg > 0) & (row != 0)].tolist())
    out.append(next((k for k, s in sets.items() if ids and ids <= s), None))
  return out


def test_mixture_errors(tmp_path, srcs):
  with pytest.raises(ValueError, match="not NAME:WEIGHT"):
    mk(tmp_path, srcs, mix="a:0.7,b")()
  with pytest.raises(ValueError, match="not NAME:WEIGHT"):
    mk(tmp_path, srcs, mix="a:0.7,b:0")()
  with pytest.raises(ValueError, match="names no source of data.mixture"):
    mk(tmp_path, srcs, mix="a:1")()
  with pytest.raises(ValueError, match=r"names \['c'\] but data.source"):
    mk(tmp_path, srcs, mix="a:1,b:1,c:1")()
  assert mixture.parse("x", "", "") == [mixture.SourceSpec("", "x", "", 1.0)]
  specs = mixture.parse("a=p,b=q,a=r", "b=v", "a:3,b:1")
  assert specs == [mixture.SourceSpec("a", "p,r", "", 0.75), mixture.SourceSpec("b", "q", "v",
                                                                                0.25)]


def test_source_tokens_count_the_rows_each_source_gave(tmp_path, srcs):
  """Data.source_tokens(k) (what the trainer logs as data/tokens/NAME) against the rows of
  the first k batches classified by their tokens."""
  data = mk(tmp_path, srcs, mix="a:0.6,b:0.4")()
  sets = token_sets()
  it = iter(data.train)
  seen = {"a": 0, "b": 0}
  for k in range(1, 26):
    for name in row_sources(next(it), sets):
      seen[name] += 1
    if k in (1, 7, 25):
      assert data.source_tokens(k) == {n: r * 8 for n, r in seen.items()}, k
  assert data.source_tokens(3) == data.source_tokens(3)       # an earlier point counts again


def test_trainer_logs_tokens_and_eval_loss_per_source(tmp_path, srcs):
  from test_trainer import tiny_config  # pylint: disable=import-outside-toplevel
  from infir2_jax.train import rundir  # pylint: disable=import-outside-toplevel
  from infir2_jax.train.trainer import train  # pylint: disable=import-outside-toplevel
  cfg = tiny_config(**{"data.source": f"a={srcs[0]},b={srcs[1]}", "data.mixture": "a:0.75,b:0.25",
                       "data.val_fraction": 0.2, "seq_len": 16, "batch_size": 8, "steps": 4,
                       "eval.every_steps": 4, "eval.batches": 1, "log.tensorboard": False,
                       "data.cache_dir": str(tmp_path / "cache")})
  workdir = str(tmp_path / "run")
  train(cfg, workdir)
  rows = rundir.read_metrics(workdir)
  train_rows = [r for r in rows if "loss" in r]
  assert [(r["data/tokens/a"], r["data/tokens/b"]) for r in train_rows] == [
      (6 * 16 * k, 2 * 16 * k) for k in range(1, 5)]            # 3 of every 4 rows are a's
  evals = [r for r in rows if "eval_loss" in r]
  assert [r["step"] for r in evals] == [0, 4]
  for r in evals:
    assert {"eval_loss/a", "eval_loss/b"} <= set(r) and r["eval_loss/a"] != r["eval_loss/b"]
