"""Data at continual-pre-training scale, measured on this machine (issue 26).

  python benchmarks/data_loader.py --work=/tmp/data_bench \
      --out=benchmarks/results/data_loader_cpu.json
  python benchmarks/data_loader.py --work=/tmp/data_resume \
      --resume_check=benchmarks/results/data_resume_prepared_cpu.json

1. prepare throughput: `python -m infir2_jax.data.prepare` on a JSONL corpus (Shakespeare's
   paragraphs, reshuffled per copy), with 1 and 2 worker processes.
2. A prepared corpus far larger than the in-memory pipeline could hold (`--synth_tokens`,
   2.5B tokens = 5 GB of uint16 token files), written in the prepared format directly (the
   tokenized paragraphs, rotated per copy): tokenizing it here would take hours.
3. Start-up time and host memory of make_data in a fresh process, and of a short training
   run (`python -m infir2_jax.train`, the default model), on that corpus and, with today's
   in-memory pipeline, on the smaller JSONL corpora (their token cache warm, and cold).
4. Loader throughput: tokens/s of one process iterating training batches of the 1.5B
   config's shape (8 x 4096) from the prepared corpus, page cache warm and evicted, and of
   one of 8 processes (1 row each), against the ~33k tokens/s one H200 consumes at 1.5B.
5. (--resume_check) The smoke run of the default model on prepared Shakespeare, SIGKILLed
   after its step-10 checkpoint and run again, against the same run uninterrupted.
Each measurement runs in its own process; peak RSS is GNU time's maximum resident set size
(for prepare: the largest of its processes), RssAnon/RssFile are the process's own
/proc/self/status (RssFile: memory-mapped file pages, which the OS can drop at any time).
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

H200_TOKENS_PER_S_1P5B = 33_400   # README: infir2, 2 x 8192 tokens, one H200


def _child_rss(cmd: list[str], mark: str = "") -> dict:
  """Runs a command: wall time, peak RSS and CPU seconds (GNU time), its RESULT json line,
  and when a line containing `mark` appeared (s)."""
  t0 = time.perf_counter()
  proc = subprocess.Popen(["/usr/bin/time", "-f", "TIME_RSS_KB %M %U %S", *cmd], cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
  lines, mark_s = [], None
  for line in proc.stdout:
    lines.append(line.rstrip("\n"))
    if mark and mark_s is None and mark in line:
      mark_s = time.perf_counter() - t0
  proc.wait()
  wall = time.perf_counter() - t0
  if proc.returncode:
    raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n" + "\n".join(lines[-40:]))
  rss_kb, user, system = next(l.split()[1:] for l in lines if l.startswith("TIME_RSS_KB "))
  result = next((json.loads(l[7:]) for l in reversed(lines) if l.startswith("RESULT ")), {})
  tail = "\n".join(l for l in lines if not l.startswith(("TIME_RSS_KB", "RESULT")))
  out = {"wall_s": wall, "peak_rss_mib": int(rss_kb) / 1024,
         "cpu_s": float(user) + float(system), **result, "output_tail": tail[-600:]}
  if mark:
    out["until_" + mark.replace(" ", "_") + "_s"] = mark_s
  return out


def paragraphs() -> list[str]:
  import lzma  # pylint: disable=g-import-not-at-top
  from infir2_jax.data import corpus  # pylint: disable=g-import-not-at-top
  works = [json.loads(l)["text"] for l in
           lzma.decompress(corpus.SHAKESPEARE_ASSET.read_bytes()).decode().splitlines()]
  return [p for w in works for p in w.split("\n\n") if p.strip()]


def text_corpus(d: pathlib.Path, copies: int) -> pathlib.Path:
  """`copies` JSONL files, each every paragraph once in its own order."""
  d.mkdir(parents=True, exist_ok=True)
  paras = paragraphs()
  for c in range(copies):
    f = d / f"part{c:03d}.jsonl"
    if not f.exists():
      order = np.random.default_rng(c).permutation(len(paras))
      f.write_text("".join(json.dumps({"text": paras[i]}) + "\n" for i in order))
  return d


def synth_prepared(out: pathlib.Path, tokens: int, shard_tokens: int = 125_000_000) -> dict:
  """A prepared directory of `tokens` training tokens (+ a 1M-token validation shard)."""
  from infir2_jax.data import prepare, shards  # pylint: disable=g-import-not-at-top
  from infir2_jax.data import tokenizer as T  # pylint: disable=g-import-not-at-top
  if (out / shards.INDEX).exists():
    return json.loads((out / shards.INDEX).read_text())["totals"]
  tok = T.load_tokenizer("default")
  eos = T.special_ids(tok).eos
  ids = [e.ids + [eos] for e in tok.encode_batch_fast(paragraphs(), add_special_tokens=False)]
  base = np.concatenate([np.asarray(x, np.uint16) for x in ids])
  base_ends = np.cumsum([len(x) for x in ids]).astype(np.int64)
  n_files = -(-tokens // shard_tokens)
  settings = {"format": shards.FORMAT, "version": shards.VERSION,
              "inputs": [[f"synthetic:{i}", 0] for i in range(n_files)], "tokenizer": "default",
              "tokenizer_fingerprint": T.fingerprint(tok), "vocab_size": tok.get_vocab_size(),
              "eos": eos, "dtype": np.dtype("<u2").str, "text_key": "text", "doc_separator": "",
              "val_fraction": 0.0, "shard_tokens": shard_tokens, "chunk_bytes": 0}
  (out / "shards").mkdir(parents=True, exist_ok=True)
  (out / "files").mkdir(exist_ok=True)
  prepare._write_json(out / shards.SETTINGS, settings)  # pylint: disable=protected-access
  rng = np.random.default_rng(0)
  for f in range(n_files):
    name = shards.part_name(f, 0)
    counts = {}
    for split, want in (("train", min(shard_tokens, tokens - f * shard_tokens)),
                        ("val", 1_000_000 if f == 0 else 0)):
      tok_path, ends_path = shards.part_paths(out, name, split)
      n = docs = 0
      with open(tok_path, "wb") as ft, open(ends_path, "wb") as fe:
        while n < want:  # whole rotated copies of the paragraphs, cut at a document end
          cut = int(base_ends[rng.integers(len(base_ends))]) % len(base)
          copy = np.concatenate([base[cut:], base[:cut]])
          ends = np.sort(np.concatenate([base_ends[base_ends > cut] - cut,
                                         base_ends[base_ends <= cut] + len(base) - cut]))
          keep = int(np.searchsorted(ends, want - n, side="left")) + 1
          keep = min(keep, len(ends))
          ft.write(copy[:ends[keep - 1]].tobytes())
          fe.write((ends[:keep] + n).tobytes())
          n, docs = n + int(ends[keep - 1]), docs + keep
      counts.update({f"{split}_tokens": n, f"{split}_docs": docs})
    marker = {"name": name, "file": f, "part": 0, "start": 0, "end": 0, "records": 0,
              "chars": 0, "bad": {}, "bad_examples": [], **counts}
    prepare._write_json(out / "shards" / f"{name}.json", marker)  # pylint: disable=protected-access
    prepare._write_json(out / "files" / f"{f:06d}.json", {  # pylint: disable=protected-access
        "index": f, "input": f"synthetic:{f}", "size": 0, "parts": [name], "bad": {},
        "records": counts["train_docs"] + counts["val_docs"], "chars": 0, **counts})
  return prepare.finalize(out)["totals"]


STARTUP_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
from infir2_jax.data import DataConfig, make_data
def status():
  d = dict(l.split(":", 1) for l in open("/proc/self/status") if ":" in l)
  return {k: int(d[k].split()[0]) / 1024 for k in ("VmRSS", "RssAnon", "RssFile", "VmHWM")}
t1 = time.perf_counter()
cfg = DataConfig(**json.loads(sys.argv[1]))
data = make_data(cfg, seq_len=256, global_batch_size=16, seed=0)
t2 = time.perf_counter()
after_make = status()
it = iter(data.train)
for _ in range(50):
  next(it)
t3 = time.perf_counter()
print("RESULT " + json.dumps({"import_s": t1 - t0, "make_data_s": t2 - t1,
      "first_50_batches_s": t3 - t2, "mib_after_make_data": after_make,
      "mib_after_50_batches": status(), "train_tokens": data.stats["train"].tokens,
      "summary": data.summary()}))
"""

LOADER_CHILD = r"""
import json, os, sys, time
from infir2_jax.data import DataConfig, make_data, shards
src, seq_len, batch, procs, steps, cold = json.loads(sys.argv[1])
if cold:  # evict this corpus's pages from the page cache (only its files)
  for f in os.scandir(os.path.join(src, "shards")):
    fd = os.open(f.path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
data = make_data(DataConfig(source=src, val_fraction=0.0, prefetch=2), seq_len=seq_len,
                 global_batch_size=batch, seed=1, process_index=procs - 1, process_count=procs)
it = iter(data.train)
next(it)
t0 = time.perf_counter()
for _ in range(steps):
  b = next(it)
dt = time.perf_counter() - t0
local = b["inputs"].size
print("RESULT " + json.dumps({"steps": steps, "local_tokens_per_step": local,
      "tokens_per_s_per_process": steps * local / dt, "batches_per_s": steps / dt}))
"""


def resume_check(work: pathlib.Path, out: str) -> None:
  """The default smoke run on prepared Shakespeare, SIGKILLed after its step-10 checkpoint
  and run again, against the same run uninterrupted: every loss must be equal."""
  from infir2_jax.bench import tools as benchtools  # pylint: disable=g-import-not-at-top
  res = {**benchtools.run_info(sys.argv, with_device=False)}
  prep = work / "prep_shakespeare"
  subprocess.run(["rm", "-rf", str(prep), str(work / "full"), str(work / "killed")], check=True)
  subprocess.run([sys.executable, "-m", "infir2_jax.data.prepare", "--source=shakespeare",
                  f"--out={prep}", "--val_fraction=0.05", "--no-progress"], cwd=ROOT, check=True,
                 env={**os.environ, "PYTHONPATH": str(ROOT)})
  train = lambda wd: [sys.executable, "-m", "infir2_jax.train", "--config=configs/default.py:smoke",
                      f"--config.data.source={prep}", f"--workdir={wd}",
                      "--config.log.progress_bar=False"]
  env = {**os.environ, "PYTHONPATH": str(ROOT)}
  subprocess.run(train(work / "full"), cwd=ROOT, env=env, check=True, capture_output=True)
  proc = subprocess.Popen(train(work / "killed"), cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  metrics = work / "killed" / "metrics.jsonl"
  def logged_steps():
    steps = []
    for l in (metrics.read_text().splitlines() if metrics.exists() else []):
      try:
        m = json.loads(l)
      except json.JSONDecodeError:  # a line being written
        continue
      if "loss" in m:
        steps.append(m["step"])
    return steps
  while proc.poll() is None:  # kill once step 12 is logged (the step-10 checkpoint is done)
    if max(logged_steps(), default=0) >= 12:
      proc.kill()
      break
    time.sleep(0.05)
  proc.wait()
  killed_at = max(logged_steps())
  subprocess.run(train(work / "killed"), cwd=ROOT, env=env, check=True, capture_output=True)

  def losses(wd):  # the last time each step was logged
    out = {}
    for l in (wd / "metrics.jsonl").read_text().splitlines():
      m = json.loads(l)
      for k in ("loss", "eval_loss"):
        if k in m:
          out[f"{k}@{m['step']}"] = m[k]
    return out
  full, resumed = losses(work / "full"), losses(work / "killed")
  res.update(killed_after_step=killed_at, returncode_of_killed=proc.returncode,
             command=" ".join(train("WORKDIR")[1:]), losses_full=full, losses_resumed=resumed,
             bit_identical=full == resumed)
  pathlib.Path(out).write_text(json.dumps(res, indent=1) + "\n")
  print(json.dumps({k: res[k] for k in ("killed_after_step", "bit_identical")}))


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--work", default="/tmp/data_bench")
  p.add_argument("--out", default="benchmarks/results/data_loader_cpu.json")
  p.add_argument("--synth_tokens", type=int, default=2_500_000_000)
  p.add_argument("--copies", default="4,15", help="JSONL corpora: copies of the paragraphs")
  p.add_argument("--train_steps", type=int, default=5)
  p.add_argument("--resume_check", default="", help="only the SIGKILL check, into this JSON")
  args = p.parse_args()
  work = pathlib.Path(args.work)
  if args.resume_check:
    return resume_check(work, args.resume_check)
  from infir2_jax.bench import tools as benchtools  # pylint: disable=g-import-not-at-top
  res = {**benchtools.run_info(sys.argv, with_device=False), "cpu_count": os.cpu_count(),
         "load_average_at_start": os.getloadavg(), "h200_tokens_per_s_1p5b": H200_TOKENS_PER_S_1P5B}
  save = lambda: pathlib.Path(args.out).write_text(json.dumps(res, indent=1, default=str) + "\n")
  copies = [int(c) for c in args.copies.split(",")]
  corpora = {c: text_corpus(work / f"text{c}", c) for c in copies}

  res["prepare"] = []
  for c, workers in ((copies[0], 1), (copies[0], 2), (copies[-1], 2)):
    out = work / f"prep{c}_w{workers}"
    subprocess.run(["rm", "-rf", str(out)], check=True)
    r = _child_rss([sys.executable, "-m", "infir2_jax.data.prepare", f"--source={corpora[c]}",
                    f"--out={out}", f"--workers={workers}", "--no-progress"])
    index = json.loads((out / "prepared.json").read_text())["totals"]
    tokens = index["train_tokens"] + index["val_tokens"]
    res["prepare"].append({"copies": c, "workers": workers, "tokens": tokens,
                           "input_bytes": index["input_bytes"], "wall_s": r["wall_s"],
                           "tokens_per_s": tokens / r["wall_s"], "cpu_s": r["cpu_s"],
                           "tokens_per_cpu_s": tokens / r["cpu_s"],
                           "peak_rss_mib": r["peak_rss_mib"], "summary": r["output_tail"]})
    print("prepare", res["prepare"][-1], flush=True)
    save()

  synth = work / "synth"
  t0 = time.perf_counter()
  res["synth"] = {"dir": str(synth), "totals": synth_prepared(synth, args.synth_tokens),
                  "write_s": time.perf_counter() - t0,
                  "bytes_on_disk": sum(f.stat().st_size for f in (synth / "shards").iterdir())}
  print("synth", res["synth"], flush=True)
  save()

  res["startup"] = []
  cases = [("prepared", {"source": str(synth)})]
  for c in copies:
    cache = str(work / f"cache{c}")
    subprocess.run(["rm", "-rf", cache], check=True)
    cases += [(f"in_memory_{c}_cold", {"source": str(corpora[c]), "cache_dir": cache}),
              (f"in_memory_{c}_warm", {"source": str(corpora[c]), "cache_dir": cache})]
  for name, kw in cases:
    r = _child_rss([sys.executable, "-c", STARTUP_CHILD, json.dumps({"prefetch": 2, **kw})])
    res["startup"].append({"case": name, **{k: v for k, v in r.items() if k != "output_tail"}})
    print("startup", res["startup"][-1], flush=True)
    save()

  res["loader"] = []
  for seq_len, batch, procs, cold in ((4096, 8, 1, True), (4096, 8, 1, False),
                                      (4096, 8, 8, False)):
    r = _child_rss([sys.executable, "-c", LOADER_CHILD,
                    json.dumps([str(synth), seq_len, batch, procs, 200, cold])])
    r.update(seq_len=seq_len, global_batch=batch, process_count=procs, page_cache_evicted=cold,
             vs_h200=r["tokens_per_s_per_process"] / H200_TOKENS_PER_S_1P5B)
    res["loader"].append({k: v for k, v in r.items() if k != "output_tail"})
    print("loader", res["loader"][-1], flush=True)
    save()

  res["train_run"] = []
  for name, source in (("prepared", str(synth)),
                       (f"in_memory_{copies[-1]}_warm", str(corpora[copies[-1]]))):
    wd = work / f"run_{name}"
    subprocess.run(["rm", "-rf", str(wd)], check=True)
    cmd = [sys.executable, "-m", "infir2_jax.train", f"--workdir={wd}",
           f"--config.steps={args.train_steps}", f"--config.data.source={source}",
           "--config.checkpoint.every_steps=0", "--config.log.progress_bar=False"]
    if name != "prepared":
      cmd.append(f"--config.data.cache_dir={work / f'cache{copies[-1]}'}")
    r = _child_rss(cmd, mark="from scratch")
    metrics = [json.loads(l) for l in (wd / "metrics.jsonl").read_text().splitlines()]
    res["train_run"].append({"case": name, "command": " ".join(cmd[1:]), "wall_s": r["wall_s"],
                             "until_start_line_s": r["until_from_scratch_s"],
                             "peak_rss_mib": r["peak_rss_mib"],
                             "losses": [m["loss"] for m in metrics if "loss" in m],
                             "eval_losses": [m["eval_loss"] for m in metrics if "eval_loss" in m]})
    print("train", res["train_run"][-1], flush=True)
    save()
  res["load_average_at_end"] = os.getloadavg()
  save()


if __name__ == "__main__":
  main()
