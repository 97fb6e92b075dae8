"""The fault families of scripts/fault_injection.py beyond its SIGKILLs and checkpoint damage.

Each family is a function `family(ctx) -> [fault]`; a fault is a dict with its family, a
name, what was done, and its outcome, one of CLASSES:
  ok                  the program did what it promises (refused clearly, fell back, resumed)
  data lost           a run's metrics or valid checkpoints are gone (or moved aside)
  corrupt state used  a damaged or foreign checkpoint, or non-finite state, was trained on
  silently wrong      a start that had to fail or warn said nothing (e.g. trained on)
  hang                no end within the family's timeout
  leak                a temporary folder, lock or process outlived the program
  unclear error       it failed, but with a traceback, or an error line that does not name
                      the problem (the file, the key)
Cheap families (config, files, data) only start programs that must fail with a named error:
no training. The others train a small base run first (a few steps of the default model).
"""

import concurrent.futures
import glob
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from infir2_jax.train import rundir  # noqa: E402

SAVE_FAILURE_SLACK_STEPS = 4   # steps a run may go on before a background save's failure shows
CLASSES = ("ok", "data lost", "corrupt state used", "silently wrong", "hang", "leak",
           "unclear error")
# A start that must fail is given these too: if it wrongly trains, it ends soon.
SHORT = ["--config.steps=2", "--config.eval.every_steps=0", "--config.checkpoint.every_steps=0",
         "--config.log.progress_bar=False", "--config.log.tensorboard=False"]
# What a report of a foreign checkpoint or changed data says (item 2 of issue 36).
REPORTED = re.compile(r"another run|other run|identity|fingerprint|changed|differ", re.I)


class Context:
  """What the families share: flags, a scratch folder, the base run (made on first use)."""

  def __init__(self, args, trainer_args):
    self.args, self.trainer_args = args, trainer_args
    self.root = os.path.join(args.workdir, "families")
    os.makedirs(self.root, exist_ok=True)
    self.timeout = 600 if args.quick else 1200
    self._base = None

  def path(self, *names):
    return os.path.join(self.root, *names)

  def fresh(self, name):
    path = self.path(name)
    shutil.rmtree(path, ignore_errors=True)
    if os.path.isfile(path):
      os.remove(path)
    return path

  def base(self):
    """A finished 4-step run of the trainer's flags (checkpoints 2 and 4, evals at 2, 4)."""
    if self._base is None:
      workdir = self.fresh("base")
      r = run(self, ["-m", "infir2_jax.train", *self.base_flags(4), f"--workdir={workdir}"])
      if r["rc"] != 0:
        raise RuntimeError(f"the base run failed: {r['output'][-2000:]}")
      self._base = workdir
    return self._base

  def base_flags(self, steps):
    return [*self.trainer_args, f"--config.steps={steps}", "--config.checkpoint.every_steps=2",
            "--config.eval.every_steps=2", "--config.eval.batches=2",
            "--config.log.progress_bar=False"]

  def copy_base(self, name):
    workdir = self.fresh(name)
    shutil.copytree(self.base(), workdir)
    return workdir


def run(ctx, args, timeout=None, preexec_fn=None, env=None):
  """Runs `python ARGS` to its end (or its timeout); returns rc, output, seconds."""
  t0 = time.monotonic()
  proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, preexec_fn=preexec_fn,
                          env=dict(os.environ, **(env or {})), start_new_session=True)
  try:
    out, _ = proc.communicate(timeout=timeout or ctx.timeout)
    rc = proc.returncode
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    out, _ = proc.communicate()
    rc = None
  return {"rc": rc, "output": out, "seconds": round(time.monotonic() - t0, 1)}


def kept(result, workdir):
  """result, its output also kept as WORKDIR.log (what an unclear outcome is read from)."""
  with open(workdir.rstrip("/") + ".log", "w") as f:
    f.write(result["output"] or "")
  return result


def judge_failure(result, says):
  """The outcome of a start that must fail with one `error:` line containing `says`."""
  if result["rc"] is None:
    return "hang", "no end within the timeout"
  lines = [l for l in result["output"].splitlines() if l.startswith("error: ")]
  if result["rc"] == 0:
    return "silently wrong", "exit status 0"
  if "Traceback" in result["output"]:
    out = result["output"].splitlines()
    start = next(i for i, l in enumerate(out) if "Traceback" in l)
    raised = next((l for l in out[start + 1:] if l and not l[0].isspace()), "")
    return "unclear error", f"a traceback (line {start + 1}, {raised[:200]!r}); " + (
        f"error lines: {lines[0][:150]!r}" if lines else "no error line")
  if len(lines) != 1:
    tail = result["output"].strip().splitlines()[-1:] or [""]
    return "unclear error", (f"{len(lines)} error lines: {[l[:120] for l in lines[:3]]}"
                             if lines else f"no error line; last: {tail[0][:300]}")
  if not re.search(says, lines[0]):
    return "unclear error", f"{lines[0][:300]} (does not say {says!r})"
  return "ok", lines[0][:300]


def fault(family, name, did, outcome, detail, **extra):
  assert outcome in CLASSES, outcome
  return {"family": family, "fault": name, "did": did, "outcome": outcome,
          "detail": detail, **extra}


def must_fail_all(ctx, family, cases):
  """Runs each (name, did, python args, regex the error must match, check after) case side
  by side (--jobs at a time); a start that leaves its workdir or a temporary folder is a
  leak."""
  def one(case):
    name, did, args, says, after = case
    result = run(ctx, args)
    outcome, detail = judge_failure(result, says)
    if outcome == "ok" and after:
      leaked = after()
      if leaked:
        outcome, detail = "leak", leaked
    return fault(family, name, did, outcome, detail, seconds=result["seconds"])
  with concurrent.futures.ThreadPoolExecutor(ctx.args.jobs) as pool:
    return list(pool.map(one, cases))


def _train(ctx, workdir, *flags):
  return ["-m", "infir2_jax.train", *ctx.trainer_args, *SHORT, *flags, f"--workdir={workdir}"]


def _no_dir(path):
  return lambda: f"{path} was left behind" if os.path.exists(path) else ""


# Cheap: nonsense configs (each start must fail at its config check, naming the key).

BAD_CONFIGS = [
    ("opt.eps=1e-40", r"opt\.eps.*float32"), ("opt.eps=0", r"opt\.eps"),
    ("opt.lr=nan", r"opt\.lr"), ("opt.lr=1e999", r"opt\.lr"), ("opt.lr=-1", r"opt\.lr"),
    ("opt.lr=1e-46", r"opt\.lr"), ("opt.b2=0.999999999", r"opt\.b2.*float32"),
    ("opt.b1=1.0", r"opt\.b1"), ("opt.weight_decay=-1", r"opt\.weight_decay"),
    ("opt.schedule=linear", r"opt\.schedule"), ("opt.warmup_steps=-3", r"opt\.warmup_steps"),
    ("batch_size=0", r"batch_size"),
    ("grad_accum_steps=3", r"divisible"), ("seq_len=-1", r"seq_len"),
    ("skip_steps=(0,)", r"skip_steps"), ("seed=99999999999999999999", r"seed"),
    ("model.num_kv_heads=3", r"num_kv_heads|multiple"),
    ("model.rms_norm_eps=1e-40", r"rms_norm_eps.*float32"),
    ("model.hidden_sise=64", r"Did you mean 'model\.hidden_size'"),
    ("precision.recipe=fp9", r"precision\.recipe"), ("checkpoint.keep=0", r"checkpoint\.keep"),
    ("steps=abc", r"steps"), ("mesh.fsdp=3", r"mesh|XLA_FLAGS|devices"),
]


def family_config(ctx):
  cases = []
  for i, (flag, says) in enumerate(BAD_CONFIGS):
    workdir = ctx.fresh(f"config_{i}")
    cases.append((flag, f"--config.{flag}", _train(ctx, workdir, f"--config.{flag}"), says,
                  _no_dir(workdir)))
  return must_fail_all(ctx, "nonsense config", cases)


# Cheap: damaged files the program reads (each error must name the file).

def _cut(path, keep=0.5):
  data = open(path, "rb").read()
  with open(path, "wb") as f:
    f.write(data[:int(len(data) * keep)])


def _hf_checkpoint(ctx, name):
  """An HF checkpoint of the default model (random weights), written as an export is."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from infir2_jax.config import TrainConfig  # pylint: disable=g-import-not-at-top
  from infir2_jax.hf.save import export_params  # pylint: disable=g-import-not-at-top
  from infir2_jax.model.params import param_shapes  # pylint: disable=g-import-not-at-top
  out = ctx.fresh(name)
  cfg = TrainConfig().model
  rng = np.random.default_rng(0)
  flat = {path: (rng.standard_normal(shape) * 0.02).astype(np.float32)
          for path, shape in param_shapes(cfg).items()}
  export_params([flat], cfg, out)
  return out


def _prepared(ctx, name):
  """The embedded corpus prepared (`python -m infir2_jax.data.prepare`), once."""
  out = ctx.path("prepared_clean")
  if not os.path.exists(os.path.join(out, "prepared.json")):
    shutil.rmtree(out, ignore_errors=True)
    r = run(ctx, ["-m", "infir2_jax.data.prepare", "--source=shakespeare", f"--out={out}",
                  "--workers=1", "--no-progress"])
    if r["rc"]:
      raise RuntimeError(f"data preparation failed: {r['output'][-2000:]}")
  copy = ctx.fresh(name)
  shutil.copytree(out, copy)
  return copy


def family_files(ctx):
  cases = []

  def case(name, did, flags, says, workdir):
    cases.append((name, did, _train(ctx, workdir, *flags), says, None))

  afile = ctx.fresh("workdir_is_a_file")
  open(afile, "w").write("a file")
  case("workdir is a file", afile, [], r"is a file, not a folder", afile)
  case("workdir under a file", afile + "/run", [], r"is a file, not a folder", afile + "/run")
  for kind, keep in (("truncated", 0.5), ("empty", 0.0)):
    workdir = ctx.fresh(f"run_config_{kind}")
    os.makedirs(workdir)
    path = os.path.join(workdir, rundir.CONFIG_FILE)
    from infir2_jax.config import TrainConfig  # pylint: disable=g-import-not-at-top
    rundir.write_config(workdir, TrainConfig())
    _cut(path, keep)
    case(f"run config.json {kind}", path, [], re.escape(path), workdir)
  for kind in ("truncate", "header", "config_json", "missing"):
    hf_dir = _hf_checkpoint(ctx, f"hf_{kind}")
    weights, config = (os.path.join(hf_dir, n) for n in ("model.safetensors", "config.json"))
    if kind == "truncate":
      _cut(weights)
    elif kind == "header":
      with open(weights, "r+b") as f:
        f.write((1 << 40).to_bytes(8, "little"))
    elif kind == "config_json":
      _cut(config)
    else:
      os.remove(weights)
    named = {"config_json": config, "missing": hf_dir}.get(kind, weights)
    case(f"init.hf_checkpoint: {kind}", named, [f"--config.init.hf_checkpoint={hf_dir}"],
         re.escape(named), ctx.fresh(f"run_hf_{kind}"))
  tok = ctx.fresh("tokenizer_damaged")
  os.makedirs(tok)
  open(os.path.join(tok, "tokenizer.json"), "w").write('{"version": "1.0", "model": {')
  case("tokenizer.json truncated", tok, [f"--config.data.tokenizer={tok}"],
       re.escape(os.path.join(tok, "tokenizer.json")), ctx.fresh("run_tok"))
  for kind in ("prepared.json truncated", "shard file cut", "shard file deleted"):
    prep = _prepared(ctx, "prepared_" + kind.split()[0] + "_" + kind.split()[-1])
    index = os.path.join(prep, "prepared.json")
    shard = sorted(glob.glob(os.path.join(prep, "shards", "*.train.tok")))[0]
    if kind.startswith("prepared"):
      _cut(index)
      named = index
    elif kind.endswith("cut"):
      _cut(shard)
      named = os.path.basename(shard)
    else:
      os.remove(shard)
      named = os.path.basename(shard)
    case(kind, named, [f"--config.data.source={prep}"], re.escape(named),
         ctx.fresh(f"run_prep_{len(cases)}"))
  return must_fail_all(ctx, "damaged file", cases)


# Cheap: broken data behind data.source.

def family_data(ctx):
  folder = ctx.fresh("data")
  os.makedirs(folder)
  files = {"missing file": (os.path.join(folder, "nope.jsonl"), None),
           "empty file": (os.path.join(folder, "empty.jsonl"), b""),
           "not JSON": (os.path.join(folder, "junk.jsonl"), b"not json\n" * 50),
           "binary junk": (os.path.join(folder, "bin.jsonl"), os.urandom(4096)),
           "no text field": (os.path.join(folder, "notext.jsonl"), b'{"body": "x"}\n' * 50),
           "empty texts": (os.path.join(folder, "blank.jsonl"), b'{"text": ""}\n' * 50)}
  cases = []
  for name, (path, data) in files.items():
    if data is not None:
      open(path, "wb").write(data)
    cases.append((name, path, _train(ctx, ctx.fresh(f"run_data_{len(cases)}"),
                                     f"--config.data.source={path}"),
                  re.escape(os.path.basename(path)), None))
  empty_dir = os.path.join(folder, "empty_dir")
  os.makedirs(empty_dir)
  cases.append(("empty folder", empty_dir, _train(ctx, ctx.fresh("run_data_dir"),
                                                  f"--config.data.source={empty_dir}"),
                re.escape(empty_dir), None))
  cases.append(("glob matching nothing", folder + "/*.parquet",
                _train(ctx, ctx.fresh("run_data_glob"),
                       f"--config.data.source={folder}/*.parquet"), r"\*\.parquet", None))
  cases.append(("val_source missing", folder + "/val.jsonl",
                _train(ctx, ctx.fresh("run_data_val"),
                       f"--config.data.val_source={folder}/val.jsonl"), r"val\.jsonl", None))
  return must_fail_all(ctx, "broken data", cases)


# Base run needed: exports and imports.

def _export(workdir, out, *flags):
  return ["-m", "infir2_jax.export", f"--workdir={workdir}", f"--out={out}", *flags]


def _tmp_left(out):
  left = glob.glob(out + ".tmp-*") + glob.glob(out + ".old-*")
  return f"left behind: {left}" if left else ""


def family_exports(ctx):
  base = ctx.base()
  out = ctx.fresh("export_out")
  faults = must_fail_all(ctx, "broken export", [
      ("--out is the run directory", base, _export(base, base), r"run directory", None),
      ("--out inside checkpoints", base, _export(base, os.path.join(base, "checkpoints", "x")),
       r"inside the run's checkpoints", None),
      ("--step that does not exist", "--step=3", _export(base, out, "--step=3"), r"3", None),
      ("--workdir that is no run", out, _export(out + "_none", out), r"config\.json", None)])
  # A damaged checkpoint: refused, naming it.
  damaged = ctx.copy_base("export_damaged")
  state = os.path.join(rundir.step_dir(damaged, 4), rundir.STATE_ITEM)
  biggest = max((os.path.join(r, f) for r, _, fs in os.walk(state) for f in fs),
                key=os.path.getsize)
  with open(biggest, "r+b") as f:
    f.seek(os.path.getsize(biggest) // 2)
    b = f.read(1)[0]
    f.seek(-1, 1)
    f.write(bytes([b ^ 1]))
  faults += must_fail_all(ctx, "broken export", [
      ("a flipped byte in the checkpoint exported", biggest, _export(damaged, out),
       r"damaged", None)])
  # Killed exports: nothing may outlive them; the next export clears what SIGKILL left.
  for signum in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT):
    target = ctx.fresh(f"export_{signum.name}")
    proc = subprocess.Popen([sys.executable, *_export(base, target)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + ctx.timeout
    while not glob.glob(target + ".tmp-*") and proc.poll() is None:
      if time.monotonic() > deadline:
        break
      time.sleep(0.01)
    was_writing = bool(glob.glob(target + ".tmp-*"))
    proc.send_signal(signum)
    proc.wait()
    leaked = _tmp_left(target)
    if signum == signal.SIGKILL and leaked:   # SIGKILL cannot clean: the next export must
      r = run(ctx, _export(base, target))
      leaked = _tmp_left(target) or ("" if r["rc"] == 0 else r["output"][-300:])
    faults.append(fault("broken export", f"{signum.name} during the write", target,
                        "leak" if leaked else "ok", leaked or "no temporary folder left",
                        during_write=was_writing))
  # Two exports to the same --out at once: one complete export there, nothing left over.
  target = ctx.fresh("export_concurrent")
  procs = [subprocess.Popen([sys.executable, *_export(base, target, "--overwrite")], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for _ in range(2)]
  outs = [p.communicate()[0] for p in procs]
  complete = os.path.isfile(os.path.join(target, "config.json"))
  leaked = _tmp_left(target)
  unclear = [o for p, o in zip(procs, outs) if p.returncode and "error: " not in o]
  outcome = ("leak" if leaked else "data lost" if not complete else
             "unclear error" if unclear else "ok")
  faults.append(fault("concurrency", "two exports to one --out", target, outcome,
                      leaked or f"exit {[p.returncode for p in procs]}, complete={complete}"))
  # Import: the export of the base run as init.hf_checkpoint of a new run, after damage.
  hf_dir = ctx.fresh("import_src")
  r = run(ctx, _export(base, hf_dir))
  if r["rc"] == 0:
    _cut(os.path.join(hf_dir, "model.safetensors"))
    faults += must_fail_all(ctx, "broken import", [
        ("our export truncated, as init.hf_checkpoint", hf_dir,
         _train(ctx, ctx.fresh("import_run"), f"--config.init.hf_checkpoint={hf_dir}"),
         r"model\.safetensors", None)])
  return faults


# Base run needed: configs changed on resume.

def family_resume_config(ctx):
  cases = []
  for flag, says in (("model.hidden_size=128", r"model\.hidden_size"),
                     ("model.num_layers=2", r"model\.num_layers"),
                     ("model.vocab_size=4096", r"vocab_size|tokenizer")):
    workdir = ctx.copy_base(f"resume_{len(cases)}")
    cases.append((f"resume with {flag}", flag,
                  ["-m", "infir2_jax.train", *ctx.base_flags(6), f"--config.{flag}",
                   f"--workdir={workdir}"], says, _kept_checkpoints(workdir)))
  # config.json missing, then a shape change: the checkpoints must not be moved aside.
  workdir = ctx.copy_base("resume_no_config")
  os.remove(os.path.join(workdir, rundir.CONFIG_FILE))
  cases.append(("config.json deleted, resume with another shape", "model.hidden_size=128",
                ["-m", "infir2_jax.train", *ctx.base_flags(6), "--config.model.hidden_size=128",
                 f"--workdir={workdir}"], r"hidden_size|shape|does not restore|config",
                _kept_checkpoints(workdir)))
  faults = must_fail_all(ctx, "config changed on resume", cases)
  for f in faults:   # a moved-aside valid checkpoint is data lost, whatever the message
    if f["outcome"] == "leak":
      f["outcome"] = "data lost"
  return faults


def _kept_checkpoints(workdir):
  def check():
    if rundir.checkpoint_steps(workdir) != [2, 4]:
      moved = os.listdir(rundir.damaged_dir(workdir)) if os.path.isdir(
          rundir.damaged_dir(workdir)) else []
      return f"checkpoints now {rundir.checkpoint_steps(workdir)}, moved aside: {moved}"
    return ""
  return check


# Base run needed: diverging numerics.

def family_numerics(ctx):
  faults = []
  workdir = ctx.copy_base("numerics_resume")
  r = run(ctx, ["-m", "infir2_jax.train", *ctx.base_flags(6), "--config.opt.lr=1e30",
                f"--workdir={workdir}"])
  # At step 5, the first after checkpoint 4, the advice must say that checkpoint diverges;
  # later (step 5's update finite, step 6 NaN), it is the last good checkpoint.
  at = re.search(r"^error: .*? at step (\d+)", r["output"], re.M)   # the error's step
  outcome, detail = judge_failure(r, r"checkpoint 4 itself diverges on step 5"
                                  if at and at.group(1) == "5" else
                                  r"Last good checkpoint: step 4 ")
  if rundir.checkpoint_steps(workdir) != [2, 4]:
    outcome, detail = "corrupt state used", f"checkpoints {rundir.checkpoint_steps(workdir)}"
  faults.append(fault("diverging numerics", "lr 1e30 on resume (diverges at once)", workdir,
                      outcome, detail))
  workdir = ctx.fresh("numerics_fresh")
  r = run(ctx, ["-m", "infir2_jax.train", *ctx.trainer_args, "--config.steps=4",
                "--config.opt.lr=1e30", "--config.opt.warmup_steps=0",
                "--config.checkpoint.every_steps=1", "--config.eval.every_steps=0",
                "--config.log.progress_bar=False", f"--workdir={workdir}"])
  outcome, detail = judge_failure(r, r"non-finite|NaN|nan")
  if outcome == "ok" and not _all_finite(workdir):
    outcome, detail = "corrupt state used", "a saved checkpoint is not finite"
  faults.append(fault("diverging numerics", "lr 1e30 from the start", workdir, outcome,
                      detail))
  return faults


def _all_finite(workdir):
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from infir2_jax.train import checkpoint as checkpoint_lib  # pylint: disable=g-import-not-at-top
  for step in rundir.checkpoint_steps(workdir):
    state = checkpoint_lib.read_state(rundir.checkpoint_item(workdir, step)[0])
    if not all(np.isfinite(np.asarray(x, np.float32)).all() for x in jax.tree.leaves(state)
               if np.asarray(x).dtype.kind == "f"):
      return False
  return True


# Base run needed: full disks and folders that cannot be written.

def family_disk(ctx):
  faults = []
  for limit in (64 << 10, 1 << 20):   # EFBIG: a file-size limit below a checkpoint's size
    workdir = ctx.copy_base(f"disk_fsize_{limit}")

    def cap(limit=limit):
      resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
      signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # EFBIG, not a killed process
    # to 16 steps, so that training on to the end after the failed save at 6 would show
    r = kept(run(ctx, ["-m", "infir2_jax.train", *ctx.base_flags(16), f"--workdir={workdir}"],
                 preexec_fn=cap), workdir)
    outcome, detail = judge_failure(r, r"EFBIG|[Ff]ile too large|file size|disk|space")
    steps = [rec["step"] for rec in rundir.read_metrics(workdir) if "loss" in rec]
    # The save at 6 fails in the background; the loop learns it at the first poll after
    # orbax's thread ends (Checkpointer.poll, every step) and stops there, its one error
    # line naming the checkpoint to resume from. So a few steps past 6 are the contract
    # (tests/test_checkpoint_save_faults.py allows 4); training on beyond is the fault.
    if outcome == "ok" and steps and max(steps) > 6 + SAVE_FAILURE_SLACK_STEPS:
      outcome, detail = "silently wrong", f"trained to step {max(steps)} past a failed save"
    faults.append(fault("full disk", f"RLIMIT_FSIZE={limit >> 10} KiB", workdir, outcome,
                        detail))
  for what in ("checkpoints", "workdir"):
    workdir = ctx.copy_base(f"disk_readonly_{what}")
    folder = rundir.checkpoints_dir(workdir) if what == "checkpoints" else workdir
    os.chmod(folder, 0o555)
    probe = os.path.join(folder, ".probe")
    try:
      open(probe, "w").close()
      os.remove(probe)
      writable = True
    except OSError:
      writable = False
    if writable:   # root ignores the mode bits: this fault cannot be made here
      os.chmod(folder, 0o755)
      faults.append(fault("full disk", f"{what} chmod 0555", folder, "ok",
                          "not applicable: this user (root) writes into 0555 folders",
                          skipped=True))
      continue
    r = run(ctx, ["-m", "infir2_jax.train", *ctx.base_flags(8), f"--workdir={workdir}"])
    os.chmod(folder, 0o755)
    outcome, detail = judge_failure(r, r"[Pp]ermission|read-only|cannot be written|EACCES")
    faults.append(fault("full disk", f"{what} chmod 0555", folder, outcome, detail))
  return faults


# Base run needed: trainers and evaluations at the same time.

def _start_bg(args, log):
  return subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=log,
                          stderr=subprocess.STDOUT, start_new_session=True)


def _wait_step(workdir, proc, after, timeout):
  deadline = time.monotonic() + timeout
  while proc.poll() is None and time.monotonic() < deadline:
    steps = [r["step"] for r in rundir.read_metrics(workdir) if "loss" in r]
    if steps and max(steps) > after:
      return True
    time.sleep(0.1)
  return False


def family_concurrency(ctx):
  faults = []
  for variant in ("second trainer", "second trainer after deleting .lock"):
    workdir = ctx.copy_base(f"concurrent_{len(faults)}")
    with open(workdir + ".log", "w") as log:
      first = _start_bg(["-m", "infir2_jax.train", *ctx.base_flags(12),
                         f"--workdir={workdir}"], log)
      if not _wait_step(workdir, first, 4, ctx.timeout):
        first.kill()
        faults.append(fault("concurrency", variant, workdir, "hang", "no step logged"))
        continue
      if variant.endswith(".lock"):
        lock = os.path.join(workdir, rundir.LOCK_FILE)
        if os.path.exists(lock):
          os.remove(lock)
      second = run(ctx, ["-m", "infir2_jax.train", *ctx.base_flags(12),
                         f"--workdir={workdir}"])
      first.wait(timeout=ctx.timeout)
    outcome, detail = judge_failure(second, r"in use by another trainer.*pid")
    steps = sorted(r["step"] for r in rundir.read_metrics(workdir) if "loss" in r)
    if steps != list(range(1, 13)):
      outcome, detail = "data lost", f"metrics.jsonl steps {steps[:3]}..{steps[-3:]}"
    faults.append(fault("concurrency", variant, workdir, outcome, detail))
  # An export and an evaluation while the run trains: both read a committed checkpoint.
  workdir = ctx.copy_base("concurrent_readers")
  with open(workdir + ".log", "w") as log:
    trainer = _start_bg(["-m", "infir2_jax.train", *ctx.base_flags(12),
                         f"--workdir={workdir}"], log)
    _wait_step(workdir, trainer, 4, ctx.timeout)
    export = run(ctx, _export(workdir, ctx.fresh("concurrent_export")))
    evaluate = run(ctx, ["-m", "infir2_jax.inference.evaluate", f"--workdir={workdir}",
                         "--eval_batches=2", "--limit=1"])
    trainer.wait(timeout=ctx.timeout)
  for name, r in (("export while training", export), ("evaluation while training", evaluate)):
    outcome = ("hang" if r["rc"] is None else "ok" if r["rc"] == 0 else
               "unclear error" if "error: " not in r["output"] else "ok")
    faults.append(fault("concurrency", name, workdir, outcome,
                        r["output"].strip().splitlines()[-1][:300] if r["output"] else ""))
  return faults


FAMILIES = {"config": family_config, "files": family_files, "data": family_data,
            "exports": family_exports, "resume_config": family_resume_config,
            "numerics": family_numerics, "disk": family_disk,
            "concurrency": family_concurrency}
CHEAP = ("config", "files", "data")


def summary_table(faults):
  """Markdown: one row per family, a column per outcome class."""
  rows = ["| family | faults | " + " | ".join(CLASSES) + " |",
          "| --- | ---: | " + " | ".join("---:" for _ in CLASSES) + " |"]
  families = sorted({f["family"] for f in faults}, key=[f["family"] for f in faults].index)
  for family in families + ["all"]:
    mine = [f for f in faults if family in ("all", f["family"])]
    counts = [sum(f["outcome"] == c for f in mine) for c in CLASSES]
    rows.append(f"| {family} | {len(mine)} | " + " | ".join(map(str, counts)) + " |")
  return "\n".join(rows)
