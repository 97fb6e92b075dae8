"""Source files -> sharded token files with an index, for training at any corpus size.

  python -m infir2_jax.data.prepare --source='/data/web/*.jsonl.gz' --out=/data/prep/web \\
      --tokenizer=qwen2.5 --val_fraction=0.001

then train with `--config.data.source=/data/prep/web`. Sources are what `data.source` takes
(globs, directories, .jsonl/.parquet/.txt/.md/.py, .gz/.xz/.bz2). Documents are parsed,
checked and tokenized exactly as by the in-memory pipeline, on all cores (`--workers`);
a document goes to validation when a hash of its text falls below `--val_fraction`.

Resumable: run the same command again after an interruption. Every finished part of a file
(OUT/shards/F-P.json) is kept; the interrupted part is redone from the line where the
previous part ended.

Several machines (a shared filesystem): run the same command on each with
`--worker_index=$SLURM_PROCID --worker_count=$SLURM_NTASKS` (or any launcher's numbers).
Worker i takes input files i, i+n, i+2n, ... and writes their shards and per-file
manifests (OUT/files/F.json); the worker that finishes the last file writes the index
OUT/prepared.json that ties them together (`--finalize` writes it by hand).
"""

import argparse
import collections
import concurrent.futures
import json
import logging
import multiprocessing
import os
import pathlib
import sys
import time

import tqdm

from infir2_jax.data import chunks as chunks_lib
from infir2_jax.data import fetch
from infir2_jax.data import shards
from infir2_jax.data import sources
from infir2_jax.data import tokenizer as tokenizer_lib
from infir2_jax.data.config import DataConfig
from infir2_jax import errors
from infir2_jax.errors import ConfigError, DataError

DEFAULT_SHARD_TOKENS = 1 << 27   # ~134M tokens a part (0.25-0.5 GB)
DEFAULT_CHUNK_BYTES = 4 << 20    # input bytes handed to a worker at a time


def _settings(args, files: list[pathlib.Path]) -> dict:
  tok = tokenizer_lib.load_tokenizer(args.tokenizer, cache_dir=args.cache_dir)
  return {
      "format": shards.FORMAT, "version": shards.VERSION,
      "inputs": [[str(f.resolve()), f.stat().st_size] for f in files],
      "tokenizer": args.tokenizer, "tokenizer_fingerprint": tokenizer_lib.fingerprint(tok),
      "vocab_size": tok.get_vocab_size(), "eos": tokenizer_lib.special_ids(tok).eos,
      "dtype": shards.token_dtype(tok.get_vocab_size()).str, "text_key": args.text_key,
      "doc_separator": args.doc_separator, "val_fraction": args.val_fraction,
      "shard_tokens": args.shard_tokens, "chunk_bytes": args.chunk_bytes,
  }


def _write_json(path: pathlib.Path, obj) -> None:
  fetch.atomic_write(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


def _check_settings(out: pathlib.Path, settings: dict) -> None:
  path = out / shards.SETTINGS
  if path.exists():
    old = json.loads(path.read_text())
    diff = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
    if diff:
      raise DataError(f"{out} was prepared with other settings ({', '.join(diff)} differ, "
                      "e.g. the input files changed): prepare into a new --out directory, "
                      "or delete this one")
  else:
    _write_json(path, settings)


def _done_parts(out: pathlib.Path, file_index: int) -> list[dict]:
  """Markers of the finished parts 0, 1, ... of a file (stops at the first gap)."""
  done = []
  while (p := out / "shards" / f"{shards.part_name(file_index, len(done))}.json").exists():
    done.append(json.loads(p.read_text()))
  return done


class _Writer:
  """Appends encoded chunks to the current part's files; closes parts and files."""

  def __init__(self, out: pathlib.Path, settings: dict, bad_records: str):
    self.out, self.settings, self.bad_records = out, settings, bad_records
    self.part = None
    self.tokens_written = 0

  def add(self, chunk: chunks_lib.Chunk, enc: chunks_lib.Encoded) -> None:
    if enc.bad and self.bad_records == "raise":
      where, reason = enc.bad_examples[0]
      raise DataError(f"bad record {where}: {reason} (--bad_records=raise; 'skip' drops "
                      "bad records and counts them)")
    if chunk.first:
      self._open(chunk.file_index, chunk.part, chunk.start)
    part = self.part
    for split in shards.SPLITS:
      part["files"][split][0].write(enc.tokens[split].tobytes())
      ends = part[f"{split}_tokens"] + enc.lengths[split].cumsum()
      part["files"][split][1].write(ends.astype(shards.ENDS_DTYPE).tobytes())
      part[f"{split}_tokens"] += int(enc.lengths[split].sum())
      part[f"{split}_docs"] += len(enc.lengths[split])
      self.tokens_written += int(enc.lengths[split].sum())
    part["records"] += enc.records
    part["chars"] += enc.chars
    part["bad"].update(enc.bad)
    part["bad_examples"] = (part["bad_examples"] + enc.bad_examples)[:chunks_lib.MAX_EXAMPLES]
    full = part["train_tokens"] + part["val_tokens"] >= self.settings["shard_tokens"]
    if full or chunk.last:
      self._close(chunk.end)
      if chunk.last:
        self._finish_file(chunk.file_index)
      else:
        self._open(chunk.file_index, part["part"] + 1, chunk.end)

  def _open(self, file_index: int, part: int, start: int) -> None:
    name = shards.part_name(file_index, part)
    files = {}
    for split in shards.SPLITS:
      paths = shards.part_paths(self.out, name, split)
      files[split] = [open(p.with_name(p.name + ".partial"), "wb") for p in paths]
    self.part = {"name": name, "file": file_index, "part": part, "start": start, "files": files,
                 "train_tokens": 0, "train_docs": 0, "val_tokens": 0, "val_docs": 0,
                 "records": 0, "chars": 0, "bad": collections.Counter(), "bad_examples": []}

  def _close(self, end: int) -> None:
    part, self.part = self.part, None
    files = part.pop("files")
    for split in shards.SPLITS:
      for f, final in zip(files[split], shards.part_paths(self.out, part["name"], split)):
        f.flush()
        os.fsync(f.fileno())
        f.close()
        os.replace(f.name, final)
    part.update(end=end, bad=dict(part["bad"]))
    _write_json(self.out / "shards" / f"{part['name']}.json", part)  # the part's done marker

  def _finish_file(self, file_index: int) -> None:
    parts = _done_parts(self.out, file_index)
    bad = collections.Counter()
    for p in parts:
      bad.update(p["bad"])
    path, size = self.settings["inputs"][file_index]
    _write_json(self.out / "files" / f"{file_index:06d}.json", {
        "index": file_index, "input": path, "size": size, "parts": [p["name"] for p in parts],
        **{k: sum(p[k] for p in parts) for k in ("records", "chars", "train_tokens",
                                                 "train_docs", "val_tokens", "val_docs")},
        "bad": dict(bad)})


def _chunks(out, files, todo, settings, progress):
  """Every chunk still to encode, file after file, each file from its resume point."""
  for i in todo:
    done = _done_parts(out, i)
    start = done[-1]["end"] if done else 0
    for stale in (out / "shards").glob(f"{i:06d}-*"):  # parts after a gap, .partial files
      if int(stale.name.split(".")[0].split("-")[1]) >= len(done) or stale.suffix == ".partial":
        stale.unlink()
    last = 0
    for chunk in chunks_lib.read_chunks(files[i], i, start, len(done), settings):
      progress.update(chunk.raw_pos - last)
      last = chunk.raw_pos
      yield chunk


def _ordered(tasks, workers: int, cfg: dict):
  """(chunk, encoded) in chunk order; at most 2 x workers chunks in flight."""
  if workers <= 1:  # in this process, where the tokenizer's own threads use every core
    tok = tokenizer_lib.literal_copy(tokenizer_lib.load_tokenizer(cfg["tokenizer"],
                                                                  cache_dir=cfg["cache_dir"]))
    for t in tasks:
      yield t, chunks_lib.encode_documents(t, tok, cfg)
    return
  pending = collections.deque()
  # spawn, not fork: the parent may run JAX or grain threads, which fork does not copy.
  with concurrent.futures.ProcessPoolExecutor(
      workers, mp_context=multiprocessing.get_context("spawn"),
      initializer=chunks_lib.init_worker, initargs=(cfg,)) as pool:
    try:
      for t in tasks:
        pending.append((t, pool.submit(chunks_lib.encode_chunk, t)))
        if len(pending) >= 2 * workers:
          t0, fut = pending.popleft()
          yield t0, fut.result()
      while pending:
        t0, fut = pending.popleft()
        yield t0, fut.result()
    except BaseException:
      pool.shutdown(wait=True, cancel_futures=True)
      raise


def finalize(out: pathlib.Path) -> dict | None:
  """Writes OUT/prepared.json once every input file is done; returns it (None if not yet)."""
  settings = json.loads((out / shards.SETTINGS).read_text())
  n = len(settings["inputs"])
  markers = [out / "files" / f"{i:06d}.json" for i in range(n)]
  missing = [i for i, m in enumerate(markers) if not m.exists()]
  if missing:
    logging.info("%d of %d input files still to prepare (e.g. %s); %s is written when the "
                 "last one is done", len(missing), n, settings["inputs"][missing[0]][0],
                 shards.INDEX)
    return None
  files = [json.loads(m.read_text()) for m in markers]
  shard_list, bad = [], collections.Counter()
  for f in files:
    bad.update(f["bad"])
    for name in f["parts"]:
      p = json.loads((out / "shards" / f"{name}.json").read_text())
      shard_list.append({"name": name, "input": f["input"],
                         **{k: p[k] for k in ("train_tokens", "train_docs", "val_tokens",
                                              "val_docs")}})
  keys = ("records", "chars", "train_tokens", "train_docs", "val_tokens", "val_docs")
  totals = {k: sum(f[k] for f in files) for k in keys}
  totals.update(bad=dict(bad), bad_records=sum(bad.values()), files=n,
                input_bytes=sum(s for _, s in settings["inputs"]), shards=len(shard_list))
  index = {"format": shards.FORMAT, "version": shards.VERSION, "settings": settings,
           "dtype": settings["dtype"], "totals": totals, "shards": shard_list}
  _write_json(out / shards.INDEX, index)
  return index


def run(args) -> dict | None:
  """Prepares this worker's files; returns the index if this worker completed the set."""
  files = sources.resolve_sources(args.source, "pretrain", args.cache_dir)
  if not 0 <= args.worker_index < args.worker_count:
    raise ConfigError(f"--worker_index={args.worker_index} is not in [0, {args.worker_count})")
  out = pathlib.Path(args.out).expanduser()
  (out / "shards").mkdir(parents=True, exist_ok=True)
  (out / "files").mkdir(exist_ok=True)
  settings = _settings(args, files)
  _check_settings(out, settings)
  if args.finalize:
    return finalize(out)
  mine = range(args.worker_index, len(files), args.worker_count)
  todo = [i for i in mine if not (out / "files" / f"{i:06d}.json").exists()]
  t0 = time.perf_counter()
  writer = _Writer(out, settings, args.bad_records)
  total = sum(files[i].stat().st_size for i in todo)
  cfg = {**settings, "cache_dir": args.cache_dir}
  with tqdm.tqdm(total=total, unit="B", unit_scale=True, desc="prepare",
                 disable=not args.progress, file=sys.stderr) as progress:
    for chunk, enc in _ordered(_chunks(out, files, todo, settings, progress), args.workers,
                               cfg):
      writer.add(chunk, enc)
      progress.set_postfix(tokens=f"{writer.tokens_written:,}", refresh=False)
  elapsed = time.perf_counter() - t0
  index = finalize(out)
  print(summary(out, index, len(todo), writer.tokens_written, elapsed, args.workers))
  if index is not None:
    _check_documents(args, index["totals"])
  return index


def _check_documents(args, totals: dict) -> None:
  """A corpus without documents is an error; one whose validation share held out none (a
  small corpus) is said so: training with validation on would otherwise fail later."""
  docs = totals["train_docs"] + totals["val_docs"]
  bad = ", ".join(f"{k}: {v}" for k, v in sorted(totals["bad"].items())) or "none"
  if not docs:
    raise DataError(f"--source={args.source!r} yields no documents ({totals['bad_records']:,} "
                    f"bad records: {bad}); nothing to train on")
  if args.val_fraction > 0 and not totals["val_docs"]:
    logging.warning("warning: --val_fraction=%g held out none of the %d documents: train "
                    "with --config.data.val_fraction=0 (no validation), or prepare again with "
                    "a larger --val_fraction", args.val_fraction, docs)


def summary(out, index, files_done, tokens, elapsed, workers) -> str:
  rate = f"{tokens / max(elapsed, 1e-9):,.0f} tokens/s"
  head = (f"this run: {files_done} input files, {tokens:,} tokens in {elapsed:.1f} s ({rate}, "
          f"{workers} workers)")
  if index is None:
    return head + f"; {out} is not complete yet (other workers' files remain)"
  t = index["totals"]
  bad = ", ".join(f"{k}: {v}" for k, v in sorted(t["bad"].items())) or "none"
  return (f"{head}\n{out}: {t['files']} files ({t['input_bytes']:,} bytes) -> {t['shards']} "
          f"shards; {t['records']:,} records; train {t['train_docs']:,} documents "
          f"{t['train_tokens']:,} tokens, val {t['val_docs']:,} documents "
          f"{t['val_tokens']:,} tokens; {t['bad_records']:,} bad records ({bad})")


def parse_args(argv: list[str]) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--source", required=True, help="as data.source: globs, dirs, built-ins")
  p.add_argument("--out", required=True, help="the prepared directory (created)")
  p.add_argument("--tokenizer", default="default", help="as data.tokenizer")
  p.add_argument("--text_key", default="text", help="as data.text_key")
  p.add_argument("--doc_separator", default="", help="as data.doc_separator")
  p.add_argument("--val_fraction", type=float, default=DataConfig.val_fraction,
                 help="share of documents held out for validation (by a hash of the text); "
                      "the default is data.val_fraction's, so a corpus prepared with it trains "
                      "with the default config (a large corpus needs far less, e.g. 0.001)")
  p.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)),
                 help="tokenizing processes (default: every core)")
  p.add_argument("--worker_index", type=int, default=0, help="this machine among several")
  p.add_argument("--worker_count", type=int, default=1, help="machines sharing the work")
  p.add_argument("--shard_tokens", type=int, default=DEFAULT_SHARD_TOKENS,
                 help="a part is closed after this many tokens")
  p.add_argument("--chunk_bytes", type=int, default=DEFAULT_CHUNK_BYTES)
  p.add_argument("--bad_records", choices=("skip", "raise"), default="skip")
  p.add_argument("--cache_dir", default="", help="as data.cache_dir (tokenizer builds)")
  p.add_argument("--finalize", action="store_true",
                 help="only write OUT/prepared.json (every worker must be done)")
  p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True)
  p.add_argument("--debug", action="store_true",
                 help="show the traceback of a user error, not only its `error:` line (also "
                      f"{errors.DEBUG_ENV}=1)")
  args = p.parse_args(argv)
  if not 0 <= args.val_fraction < 1:
    p.error(f"--val_fraction={args.val_fraction} must be in [0, 1)")
  if args.shard_tokens < 1 or args.chunk_bytes < 1 or args.workers < 1:
    p.error("--shard_tokens, --chunk_bytes and --workers must be >= 1")
  return args


def main(argv: list[str] | None = None) -> None:
  logging.basicConfig(level=logging.INFO, format="%(message)s")
  args = parse_args(sys.argv[1:] if argv is None else argv)
  with errors.cli_errors(args.debug or errors.debug_requested()):
    run(args)


if __name__ == "__main__":
  main()
