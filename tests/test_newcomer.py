"""A newcomer's first day (issue 22): the trainer's start-up, its messages and its pre-flight.

The run's console tells what it does: where the weights come from, whether FP8 is on and on
which backend, how long each start-up phase took, what the validation set holds, and at the
end what it reached and what to run next. Checks run cheap ones first, and a config that
cannot fit stops before anything is allocated.
"""

import gc
import io
import json
import logging
import os
import re
import subprocess
import sys

import jax
import pytest

from infir2_jax import export, parallel
from infir2_jax.config import LogConfig, TrainConfig, apply_overrides, default_config, flat_keys
from infir2_jax.data import make_data
from infir2_jax.train import metrics as metrics_lib
from infir2_jax.train import preflight, rundir
from infir2_jax.train.trainer import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 2**30


def tiny_config(**overrides):
  c = default_config()
  c.steps, c.batch_size, c.seq_len = 4, 8, 64
  c.model.hidden_size, c.model.intermediate_size = 128, 256
  c.model.num_layers, c.model.num_heads, c.model.num_kv_heads = 2, 2, 1
  c.opt.warmup_steps = 2
  c.checkpoint.every_steps = 2
  c.eval.every_steps, c.eval.batches = 2, 2
  return TrainConfig.from_config_dict(apply_overrides(c, overrides))


def params_line(out: str) -> str:
  """The start-up line that names the model, the data and where the weights come from."""
  return next(line for line in out.splitlines() if re.match(r"[\d.]+M params, ", line))


def read_metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


class _Compiles(logging.Handler):
  """Counts jax's "Compiling jit(NAME)" log lines per NAME (jax.log_compiles)."""

  def __init__(self):
    super().__init__()
    self.counts: dict[str, int] = {}

  def emit(self, record):
    m = re.match(r"Compiling jit\((\w+)\)", record.getMessage())
    if m:
      self.counts[m.group(1)] = self.counts.get(m.group(1), 0) + 1


# 512 tokens per device of the 8: the FP8 tiles (1x128 along tokens in wgrad) split evenly.
# One validation document (7 batches): all of them are dispatched at once, and XLA:CPU's
# collectives over 8 fake devices on a 2-core host can stall with ~100 in flight.
FP8 = {"precision.recipe": "infir2", "seq_len": 128, "batch_size": 32,
       "data.val_fraction": 0.003}


@pytest.fixture(scope="module")
def fp8_run(tmp_path_factory):
  """A 4-step infir2 run whose eval asks for more batches than exist; its stdout (not a tty),
  and the compilations it did."""
  workdir = str(tmp_path_factory.mktemp("fp8_run"))
  cfg = tiny_config(**FP8, **{"eval.batches": 10_000, "log.progress_bar": True})
  compiles = _Compiles()
  logger = logging.getLogger("jax")
  logger.addHandler(compiles)
  stdout, saved = io.StringIO(), sys.stdout
  try:
    sys.stdout = stdout
    with jax.log_compiles(True):
      last = train(cfg, workdir)
  finally:
    sys.stdout = saved
    logger.removeHandler(compiles)
  return cfg, workdir, stdout.getvalue(), compiles.counts, last


def test_eval_uses_the_validation_batches_there_are_and_says_so(fp8_run):
  cfg, workdir, out, _, _ = fp8_run
  data = make_data(cfg.data, seq_len=cfg.seq_len, global_batch_size=cfg.batch_size, seed=0)
  n = data.num_eval_batches()
  assert 0 < n < 10_000
  assert (f"note: eval.batches=10000 but the validation split has {n} batch(es) of 32x128 "
          f"tokens ({data.stats['val'].tokens:,} tokens): evaluating on all {n}") in out
  assert [m["step"] for m in read_metrics(workdir) if "eval_loss" in m] == [0, 2, 4]


def test_start_up_names_weights_fp8_backend_memory_and_phases(fp8_run):
  _, _, out, _, _ = fp8_run
  lines = out.splitlines()
  assert params_line(out).endswith("from scratch (random init, seed 0)")
  # 2 layers x 7 projections in FP8, the tied LM head in BF16; no Hopper GPU here
  assert ("FP8 on: recipe infir2 in 14 of 15 projections; GEMMs on the XLA path (cpu; the "
          "Pallas kernels need a Hopper GPU)") in lines
  memory = next(line for line in lines if line.startswith("memory: the train step needs"))
  assert "this host (MemAvailable) has" in memory and "compiled in" in memory
  (startup,) = [line for line in lines if line.startswith("start-up ")]
  serial, beside = startup.split(": ", 1)[1].split("; beside them: ")
  phases = dict(re.findall(r"(\w[\w ]*?) (\d+\.\d) s", serial))
  assert list(phases) == ["config checks", "data", "abstract state", "train step trace",
                          "eval step trace", "wait for the state", "compile wait"]
  assert re.fullmatch(r"init \d+\.\d s", beside), beside
  total = float(re.match(r"start-up (\d+\.\d) s", startup).group(1))
  # each printed time is rounded to 0.1 s: the phases' sum may exceed the rounded total by up
  # to half a tenth per number printed
  assert sum(map(float, phases.values())) <= total + 0.05 * (len(phases) + 1) + 1e-9


def test_each_step_compiles_once(fp8_run):
  """The train and eval steps are compiled ahead of time (timed, memory-checked) and those
  executables run the loop: no second compilation of either."""
  _, _, _, compiles, _ = fp8_run
  assert compiles.get("train_step") == 1, compiles
  assert compiles.get("eval_step") == 1, compiles


def test_closing_summary_and_line_progress(fp8_run):
  cfg, workdir, out, _, last = fp8_run
  records = read_metrics(workdir)
  loss = [m["loss"] for m in records if "loss" in m][-1]
  eval_loss = [m["eval_loss"] for m in records if "eval_loss" in m][-1]
  summary = out[out.index("\ndone: "):]
  duration = r"(\d+ min )?[\d.]+ s"
  assert re.search(rf"done: steps 1-4 in {duration} \(start-up {duration}\): loss {loss:.4f}, "
                   rf"eval_loss {eval_loss:.4f}", summary)
  assert f"run directory {workdir}: metrics.jsonl, tb/, checkpoint 4" in summary
  for command in ("infir2_jax.ablation.plot_run", "infir2_jax.generate", "infir2_jax.export"):
    assert f"python -m {command} " in summary
  # what more steps do, said as it is (issue 37: "continues this run" recomputed the schedule)
  assert ("the same command with --config.steps=8 goes on at the final lr 0.0003 (the decay "
          "stays where it was)") in summary
  assert last["loss"] == pytest.approx(loss)
  # not a terminal: no carriage-return bar, one line for the first and the last step
  assert "\r" not in out
  progress = [line for line in out.splitlines() if line.startswith("train ")]
  assert progress[0].startswith("train 1/4 (25%") and progress[-1].startswith("train 4/4 (100%")
  assert all("loss " in line for line in progress)


def test_resume_says_resumed_and_times_the_restore(fp8_run, tmp_path, capsys):
  """From the run's step-2 checkpoint, with its own config: the compiled step is the run's
  (the persistent cache has it), so only the restore is new work."""
  cfg, workdir, _, _, _ = fp8_run
  resumed = str(tmp_path / "resumed")
  os.makedirs(os.path.join(resumed, "checkpoints"))
  subprocess.run(["cp", "-r", os.path.join(workdir, "checkpoints", "2"),
                  os.path.join(resumed, "checkpoints")], check=True)
  train(tiny_config(**FP8, **{"eval.every_steps": 0, "log.progress_bar": False}), resumed)
  out = capsys.readouterr().out
  assert params_line(out).endswith("resumed from step 2")
  startup = next(line for line in out.splitlines() if line.startswith("start-up "))
  beside = startup.split("; beside them: ")[1]   # restored while the step compiled
  assert beside.startswith("restore ") and "init " not in beside, startup
  assert "done: steps 3-4 in" in out


def test_weights_from_a_run_or_its_fp8_export_are_named(fp8_run, tmp_path, capsys):
  """init.from_run and init.hf_checkpoint (our own --fp8 export) both load; the console says
  so and the step-0 validation loss is the source run's final one (FP8-rounded for the export)."""
  cfg, workdir, _, _, _ = fp8_run
  source_eval = [m for m in read_metrics(workdir) if "eval_loss" in m][-1]["eval_loss"]
  hf_dir = str(tmp_path / "hf_fp8")
  export.export_run(workdir, hf_dir, fp8=True)
  for key, value, says in (("init.from_run", workdir, f"weights from run {workdir} (latest "
                            "step), fresh optimizer"),
                           ("init.hf_checkpoint", hf_dir, f"weights from the HF checkpoint "
                            f"{hf_dir}")):
    child = str(tmp_path / key)
    # The run's own steps (4): its compiled train step is reused; only step 0's eval counts.
    overrides = dict(FP8, **{key: value, "eval.every_steps": 4, "eval.batches": 10_000,
                             "checkpoint.every_steps": 0, "log.progress_bar": False})
    train(tiny_config(**overrides), child)
    out = capsys.readouterr().out
    assert params_line(out).endswith(says), out
    first = [m for m in read_metrics(child) if "eval_loss" in m][0]["eval_loss"]
    tolerance = 1e-6 if key == "init.from_run" else 0.05
    assert first == pytest.approx(source_eval, rel=tolerance), key


def _text_file(path, words=3000):
  vocab = "to be or not that is the question whether tis nobler in mind suffer".split()
  path.write_text(" ".join(vocab[(i * 7) % len(vocab)] for i in range(words)))
  return str(path)


def test_no_validation_split_is_an_error_before_any_model_work(tmp_path, monkeypatch):
  """A prepared corpus without validation documents, with validation asked for."""
  from infir2_jax.data import prepare
  prepare.run(prepare.parse_args([f"--source={_text_file(tmp_path / 'a.txt')}",
                                  f"--out={tmp_path / 'prep'}", "--val_fraction=0",
                                  "--no-progress", "--workers=1"]))

  def must_not_run(*args, **kwargs):
    raise AssertionError("the model was set up before the data check")
  monkeypatch.setattr(parallel, "abstract_state", must_not_run)
  monkeypatch.setattr(parallel, "sharded_init", must_not_run)
  with pytest.raises(ValueError, match="has no validation documents"):
    train(tiny_config(**{"data.source": str(tmp_path / "prep")}), str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()   # a failed start leaves no run directory behind


def test_a_single_text_file_trains_with_one_change(tmp_path, capsys):
  """One .txt is one document: no validation split by document. The error names the one
  change that makes it train (data.val_fraction=0), and that change turns evaluation off."""
  source = _text_file(tmp_path / "notes.txt")
  with pytest.raises(ValueError, match=r"set --config.data.val_fraction=0 \(train without "
                     r"validation: evaluation is then off\)"):
    train(tiny_config(**{"data.source": source}), str(tmp_path / "first"))
  train(tiny_config(**{"data.source": source, "data.val_fraction": 0.0, "steps": 2,
                       "log.progress_bar": False}), str(tmp_path / "second"))
  assert "note: data.val_fraction=0 (and no data.val_source): no validation split, so no " \
      "evaluation" in capsys.readouterr().out
  records = read_metrics(str(tmp_path / "second"))
  assert [m["step"] for m in records if "loss" in m] == [1, 2]
  assert not any("eval_loss" in m for m in records)


def _no_allocation(monkeypatch):
  def must_not_run(*args, **kwargs):
    raise AssertionError("state was allocated by a run that cannot fit")
  monkeypatch.setattr(parallel, "sharded_init", must_not_run)


def _live_bytes() -> int:
  return sum(a.nbytes for a in jax.live_arrays())


def test_a_state_that_cannot_fit_stops_before_compiling(tmp_path, monkeypatch):
  """2 layers of width 4096 (0.5B params), replicated on the 8 CPU devices: 8 x 8 GiB."""
  cfg = tiny_config(**{"model.hidden_size": 4096, "model.intermediate_size": 16384,
                       "model.num_heads": 32, "model.num_kv_heads": 8})
  need = 8 * 16 * cfg.model.num_params()   # f32 params, two Adam moments, one gradient
  if preflight.host_available_bytes() > need:
    pytest.skip("this host could hold the state")
  _no_allocation(monkeypatch)
  monkeypatch.setattr(preflight, "compile_step", lambda *a: pytest.fail("compiled"))
  before = _live_bytes()
  with pytest.raises(preflight.InsufficientMemoryError) as e:
    train(cfg, str(tmp_path))
  message = str(e.value)
  assert "\n" not in message
  m = re.match(r"memory pre-flight: the train state alone needs ([\d.]+) GiB \(8 devices x "
               r"([\d.]+) GiB: .*\), this host \(MemAvailable\) has ([\d.]+) GiB; try .*"
               r"--config.mesh.fsdp=N", message)
  assert m, message
  assert float(m.group(2)) == pytest.approx(16 * cfg.model.num_params() / GIB, abs=0.06)
  assert float(m.group(1)) > float(m.group(3))
  assert _live_bytes() - before < 2**20


@pytest.mark.parametrize("large_state", [True, False], ids=["large_state", "small_state"])
def test_a_step_that_cannot_fit_stops_before_its_first_step(tmp_path, monkeypatch, large_state):
  """A small model, but 128 x 8192 tokens per step: XLA's memory analysis of the compiled
  step (logits, attention scores) is what says no. A state that takes more than
  preflight.STATE_SHARE_BESIDE_COMPILE of the memory is never allocated before that check
  (here: the share set to 0); a small one is initialised beside the compile and freed."""
  cfg = tiny_config(**{"batch_size": 128, "seq_len": 8192, "eval.every_steps": 0})
  if large_state:
    monkeypatch.setattr(preflight, "STATE_SHARE_BESIDE_COMPILE", 0.0)
    _no_allocation(monkeypatch)
  before = _live_bytes()
  with pytest.raises(preflight.InsufficientMemoryError) as e:
    train(cfg, str(tmp_path))
  message = str(e.value)
  m = re.match(r"memory pre-flight: the train step needs ([\d.]+) GiB \(8 devices x [\d.]+ "
               r"GiB: arguments .* \+ temporaries .*\), this host \(MemAvailable\) has "
               r"([\d.]+) GiB; try a smaller batch \(--config.batch_size=128 -> 64, .*"
               r"--config.model.remat=full", message)
  assert m, message
  if float(m.group(1)) < 64:
    pytest.fail(f"the step should need far more than any test host has: {message}")
  del e   # its traceback holds the frames (and a small state's arrays)
  gc.collect()
  assert _live_bytes() - before < 2**20
  assert not os.path.exists(os.path.join(tmp_path, rundir.CONFIG_FILE))


def test_the_state_is_initialised_while_the_step_compiles(tmp_path, monkeypatch):
  """The train step's XLA compile (a background thread) cannot finish before the state's
  init has begun: a start-up that compiled first and initialised after would time out."""
  import threading
  from infir2_jax.train import trainer
  init_began, waited_out = threading.Event(), []
  pending_step = preflight.PendingStep.__init__

  class CompileAfterInitBegan:
    def __init__(self, lowered):
      self.lowered = lowered

    def compile(self):
      if not init_began.wait(timeout=60):
        waited_out.append(True)
      return self.lowered.compile()

  initial_state = trainer._initial_state
  def init_and_say_so(*args, **kwargs):
    init_began.set()
    return initial_state(*args, **kwargs)

  monkeypatch.setattr(preflight.PendingStep, "__init__", lambda self, lowered, lower_s:
                      pending_step(self, CompileAfterInitBegan(lowered), lower_s))
  monkeypatch.setattr(trainer, "_initial_state", init_and_say_so)
  train(tiny_config(**{"steps": 1, "eval.every_steps": 0, "checkpoint.every_steps": 0,
                       "log.progress_bar": False}), str(tmp_path))
  assert init_began.is_set() and not waited_out


def test_the_1p5b_command_on_a_small_cpu_host_fails_fast_with_one_line(tmp_path):
  """`python -m infir2_jax.train --config=configs/1p5b.py` on one CPU device: the state does
  not fit this host. It says so in one line, without a traceback, and never grows."""
  state = 1_543_714_304 * 16   # f32 params + two Adam moments + one gradient
  if preflight.host_available_bytes() > state:
    pytest.skip("this host could hold the 1.5B state: the check would come after a long compile")
  rss = tmp_path / "maxrss"
  code = ("import atexit, resource, runpy, sys; atexit.register(lambda: open(%r, 'w').write("
          "str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss))); sys.argv = ["
          "'infir2_jax.train', '--config=configs/1p5b.py', '--workdir=%s']; "
          "runpy.run_module('infir2_jax.train', run_name='__main__')" % (str(rss),
                                                                       tmp_path / "run"))
  env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu", INFIR2_COMPILATION_CACHE="")
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == 1, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr
  last = proc.stderr.strip().splitlines()[-1]
  assert re.match(r"error: memory pre-flight: the train state alone needs 23\.0 GiB \(state "
                  r"17\.3 GiB \+ gradients 5\.8 GiB, before activations\), this host "
                  r"\(MemAvailable\) has [\d.]+ GiB; try", last), last
  assert "evaluating on all" in proc.stdout   # the data was checked, and said so, first
  # Nothing of the 17.3 GiB state was allocated: the process stays far below it (2.0 GiB
  # with a warm token cache, 3.4 GiB when it tokenizes the embedded text first).
  assert int(rss.read_text()) * 1024 < 6 * GIB


def test_help_lists_every_config_key_with_its_meaning():
  proc = subprocess.run([sys.executable, "-m", "infir2_jax.train", "--help"], cwd=ROOT,
                        capture_output=True, text=True, timeout=120)
  listed = dict(re.findall(r"^  --config\.([\w.]+)=(.*)$", proc.stdout, re.M))
  assert set(listed) == set(flat_keys())
  assert listed["opt.lr"] == "0.003  peak learning rate"
  assert listed["eval.batches"].startswith("8  validation batches per evaluation")
  # from a docstring's Attributes section, and from comments above a field
  assert listed["precision.backend"].startswith("'auto'  \"auto\" (Pallas kernels on Hopper")
  assert listed["data.source"].startswith("'default'  \"default\" = the embedded data")
  assert "--workdir: Run directory" in proc.stdout


def test_progress_lines_when_the_console_is_not_a_terminal(tmp_path, monkeypatch):
  """At most one line per LINE_INTERVAL_S, plus the first and last step; a tty gets tqdm."""
  out = io.StringIO()
  monkeypatch.setattr(sys, "stdout", out)
  monkeypatch.setattr(metrics_lib, "LINE_INTERVAL_S", 3600.0)
  writer = metrics_lib.MetricsWriter(str(tmp_path), LogConfig(tensorboard=False), 50)
  for step in range(1, 51):
    writer.write(step, {"loss": 10.0 / step, "lr": 1e-3})
  writer.close()
  lines = out.getvalue().splitlines()
  assert [line.split(" (")[0] for line in lines] == ["train 1/50", "train 50/50"]
  assert lines[-1].endswith("loss 0.2000, lr 0.001") and "\r" not in out.getvalue()

  class Tty(io.StringIO):
    def isatty(self):
      return True
  assert isinstance(metrics_lib._progress_bar(file=Tty(), total=3, initial=0, desc="x"),
                    metrics_lib.tqdm)


def test_fp8_line_names_the_pallas_kernels_when_they_run(monkeypatch):
  """The GPU branches of the FP8 line, with stand-in kernels and compiled steps."""
  from infir2_jax.train import startup
  monkeypatch.setattr(startup.gemm, "pallas_kernels",
                      lambda backend: None if backend == "xla" else object())

  class Compiled:
    def __init__(self, text):
      self.text = text

    def as_text(self):
      return self.text
  cfg = tiny_config(**FP8)
  with_kernels = Compiled('a custom_call_target="mosaic_gpu_v2", b\n' * 3)
  assert startup.precision_line(cfg, with_kernels) == (
      "FP8 on: recipe infir2 in 14 of 15 projections; GEMMs on the Pallas kernels (Mosaic GPU, "
      "backend 'auto', 3 kernel calls in the train step)")
  assert "the kernels took none of its shapes" in startup.precision_line(cfg, Compiled("dot"))
  xla = tiny_config(**dict(FP8, **{"precision.backend": "xla"}))
  assert startup.precision_line(xla, with_kernels).endswith(
      "GEMMs on the XLA path (cpu; precision.backend='xla')")
  assert startup.precision_line(tiny_config()) == (
      "precision bf16: BF16 GEMMs everywhere (no FP8)")


def test_gpu_budget_is_the_smallest_device_limit_and_counts_per_device():
  class Gpu:
    platform, device_kind = "gpu", "NVIDIA H200"

    def __init__(self, id, limit, used):
      self.id, self._stats = id, {"bytes_limit": limit, "bytes_in_use": used}

    def memory_stats(self):
      return self._stats
  budget = preflight.device_budget([Gpu(0, 100 * GIB, 0), Gpu(1, 100 * GIB, 30 * GIB)])
  assert budget == preflight.Budget(70 * GIB, "GPU 1 (NVIDIA H200)", per_device=True)

  class Analysis:
    argument_size_in_bytes, output_size_in_bytes = 20 * GIB, 20 * GIB
    alias_size_in_bytes, temp_size_in_bytes, generated_code_size_in_bytes = 20 * GIB, 55 * GIB, 0

  class Compiled:
    def memory_analysis(self):
      return Analysis()
  step = preflight.CompiledStep(Compiled(), 0.0, 0.0, preflight.StepMemory.of(Compiled()))
  cfg = tiny_config(**{"model.remat": "save_dots"})
  with pytest.raises(preflight.InsufficientMemoryError, match=(
      r"the train step needs 75\.0 GiB \(arguments 20\.0 GiB \+ temporaries 55\.0 GiB \+ "
      r"outputs not donated 0\.0 GiB\), GPU 1 \(NVIDIA H200\) has 70\.0 GiB; try a smaller "
      r"batch .*--config\.model\.remat=full; now 'save_dots'")):
    preflight.check_step(cfg, step, budget, num_devices=2)   # per device: not times 2
  roomy = preflight.Budget(80 * GIB, "GPU 0 (NVIDIA H200)", per_device=True)
  assert preflight.check_step(cfg, step, roomy, 2).startswith(
      "memory: the train step needs 75.0 GiB")
