"""The training loop: build everything from a TrainConfig, resume, step, evaluate, save."""

import contextlib
import dataclasses
import functools
import math
import os
import signal
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from infir2_jax import parallel
from infir2_jax.config import TrainConfig
from infir2_jax.data import make_data
from infir2_jax.errors import ConfigError, UserError
from infir2_jax.model import Qwen2, init_params, projections
from infir2_jax.model.attention import check_documents, uses_packed_documents
from infir2_jax.precision import make_dot_general_factory, telemetry
from infir2_jax.train import (continuation, identity, loggers, nan_advice, preemption, preflight,
                              resume,
                              rundir, runlock, startup)
from infir2_jax.train.checkpoint import Checkpointer, all_finite, restore_params
from infir2_jax.train.metrics import MetricsWriter, peak_flops_per_device, perplexity
from infir2_jax.train.optim import make_apply, make_optimizer, make_schedule, stable_end
from infir2_jax.train.profile import StepProfiler
from infir2_jax.train.background import Background
from infir2_jax.train.step import make_eval_step, make_train_step


class NonFiniteLossError(UserError, FloatingPointError):
  """Raised when a step's loss, gradient norm or new state is NaN/Inf; that state is never
  saved."""


def build_model(cfg: TrainConfig, telemetry: bool = False) -> Qwen2:
  """The model with the precision recipe injected at its one point (the dot_general factory).

  The telemetry model is unrolled (its per-layer sinks are per-layer modules); the params are
  the same tree either way.
  """
  model_cfg = dataclasses.replace(cfg.model, scan_layers=False) if telemetry else cfg.model
  return Qwen2(model_cfg, make_dot_general_factory(cfg.precision, telemetry=telemetry))


def _global_batch(batch: dict[str, np.ndarray], sharding, global_rows: int) -> dict[str, jax.Array]:
  """Process-local rows -> one global array; the global shape makes a wrong split an error."""
  return {k: jax.make_array_from_process_local_data(sharding, v, (global_rows, *v.shape[1:]))
          for k, v in batch.items()}


@dataclasses.dataclass(frozen=True)
class _Placement:
  """Where a run's arrays live: the mesh, its logical rules and the batch's sharding."""
  mesh: jax.sharding.Mesh
  rules: parallel.Rules
  batch: jax.sharding.NamedSharding
  replicated: jax.sharding.NamedSharding

  packed_documents: bool  # attention bounds the documents per row (model.max_documents)
  model_cfg: Any

  def checked(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The host batch, after checking what the model's attention needs of it."""
    if self.packed_documents:
      check_documents(batch["segment_ids"], self.model_cfg)
    return batch

  @contextlib.contextmanager
  def context(self):
    """The mesh and rules every traced call of the run needs."""
    with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
      yield


def _placement(cfg: TrainConfig) -> _Placement:
  """The mesh and rules of cfg, after checking that its batches and FP8 tiles split evenly."""
  mesh = parallel.make_mesh(cfg.mesh)
  rules = parallel.logical_rules(cfg.mesh, cfg.model, mesh)
  batch_shards = parallel.ways(mesh, parallel.mesh_axes_of(rules, "batch"))
  micro_batch = cfg.batch_size // cfg.grad_accum_steps
  if micro_batch % batch_shards:
    raise ConfigError(f"batch_size={cfg.batch_size} / grad_accum_steps={cfg.grad_accum_steps} = "
                      f"{micro_batch} rows per micro-batch cannot be split over the "
                      f"{batch_shards} batch shards of mesh {dict(mesh.shape)}")
  parallel.check_fp8_alignment(projections(cfg.model), mesh, rules, cfg.precision,
                               batch_rows=micro_batch, seq_len=cfg.seq_len,
                               mode=cfg.mesh.fp8_alignment)
  platform = mesh.devices.flat[0].platform
  return _Placement(mesh, rules, parallel.batch_sharding(mesh, rules), parallel.replicated(mesh),
                    uses_packed_documents(cfg.model, platform), cfg.model)


def _make_data(cfg: TrainConfig, place: _Placement):
  # Processes whose devices hold the same batch rows (tensor parallelism across processes)
  # must load the same rows.
  data_index, data_count = parallel.data_process_index(place.mesh, place.rules)
  data = make_data(cfg.data, seq_len=cfg.seq_len, global_batch_size=cfg.batch_size,
                   seed=cfg.seed, process_index=data_index, process_count=data_count)
  if data.vocab_size > cfg.model.vocab_size:
    raise ConfigError(f"the tokenizer has {data.vocab_size} tokens but model.vocab_size is "
                      f"{cfg.model.vocab_size}; raise model.vocab_size")
  return data


@dataclasses.dataclass(frozen=True)
class _Steps:
  """The jitted steps of a run: train, eval, the telemetry variant (or None), and the
  step that skips a batch (counts the step, changes nothing else)."""
  train: Any
  eval: Any
  telemetry: Any
  sinks: Any
  skip: Any


def _with_finite_flag(step_fn):
  """The step, also returning whether its new state is all finite: a reduction fused into
  the step on the device, read with the other metrics before that state may be saved."""
  def train_step(state, batch, *rest):   # the name the compile logs and profiles show
    new_state, metrics = step_fn(state, batch, *rest)
    return new_state, {**metrics, "state_finite": all_finite(new_state)}
  return train_step


def _jit_steps(cfg: TrainConfig, model, optimizer, schedule, shardings, place) -> _Steps:
  with place.context():
    train_step = jax.jit(
        _with_finite_flag(make_train_step(model, optimizer, schedule, cfg.grad_accum_steps,
                                          apply=make_apply(cfg.opt, cfg.steps, optimizer))),
        in_shardings=(shardings, place.batch), out_shardings=(shardings, place.replicated),
        donate_argnums=0)
    eval_step = jax.jit(make_eval_step(model), in_shardings=(shardings["params"], place.batch))
    skip_step = jax.jit(lambda state: {**state, "step": state["step"] + 1},
                        in_shardings=(shardings,), out_shardings=shardings, donate_argnums=0)
  telemetry_step, sinks = _telemetry_step(cfg, model, optimizer, schedule, shardings, place)
  return _Steps(train_step, eval_step, telemetry_step, sinks, skip_step)


def train(cfg: TrainConfig, workdir: str) -> dict[str, Any]:
  """Trains (or resumes) a run in `workdir`. Returns the last step's and eval metrics.

  Start-up runs cheap checks before expensive ones (startup.py times each phase): config and
  data, then the abstract state and its memory, then the train step traced and compiled once
  ahead of time while the state is restored or allocated beside it, then (preflight.py) the
  compiled step's memory is checked against the devices before the first step.

  One trainer per workdir (train/runlock.py). SIGTERM and SIGINT save a checkpoint at the
  next step and raise preemption.Preempted (a SystemExit).
  """
  rundir.check_workdir(workdir)
  created = rundir.missing_root(workdir)
  fresh = created is not None or not os.listdir(workdir)
  try:
    with runlock.hold(workdir):
      return _train(cfg, workdir)
  except runlock.RunDirLocked:
    raise  # what is there is the holder's (it may have made the folder after we looked)
  except BaseException:
    # A start that failed (a config or data error, an interrupted compile) leaves no run
    # directory holding only its lock file; one that trained keeps what it wrote.
    if fresh and jax.process_index() == 0:
      rundir.remove_unused(workdir, created)
    raise


def _eval_sets(cfg: TrainConfig, data, place, num_eval: int) -> dict[str, list]:
  """{"": the validation batches, NAME: each mixture source's own (as many, or all it has)}."""
  if not num_eval:
    return {}
  sets = {"": data.eval_batches(num_eval)}
  for name in data.eval_sources if len(data.eval_sources) > 1 else ():
    if data.num_eval_batches(name):
      sets[name] = data.eval_batches(min(num_eval, data.num_eval_batches(name)), source=name)
  return {name: [_global_batch(place.checked(b), place.batch, cfg.batch_size) for b in batches]
          for name, batches in sets.items()}


def _continue(cfg: TrainConfig, workdir: str) -> TrainConfig:
  """cfg with the schedule a resume with other steps trains with (train/continuation.py);
  prints what it decided, and moves aside the checkpoints a rewind skips."""
  plan = continuation.plan(cfg, workdir)
  for note in plan.notes:
    _print0(note)
  if plan.rewind_to is not None:
    if jax.process_index() == 0:
      continuation.rewind(workdir, plan.rewind_to)
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      multihost_utils.sync_global_devices("infir2_rewind")
  return plan.cfg


def _train(cfg: TrainConfig, workdir: str) -> dict[str, Any]:
  os.makedirs(workdir, exist_ok=True)
  clock = startup.PhaseClock()
  cfg = _continue(cfg, workdir)   # before the optimizer: the schedule is compiled in
  with clock.phase("config checks"):
    place = _placement(cfg)
    loggers.check_available(cfg.log)
  with clock.phase("data"):
    data = _make_data(cfg, place)
    num_eval = startup.eval_batch_count(cfg, data, log=_print0)
    eval_batches = _eval_sets(cfg, data, place, num_eval)
  model = build_model(cfg)
  optimizer = make_optimizer(cfg.opt, cfg.steps)
  schedule = make_schedule(cfg.opt, cfg.steps)
  # The params do not depend on the recipe: tracing the init through the FP8 dot_generals
  # only costs time (~25 s of a 1.5B model's start-up on a CPU host).
  init_fn = functools.partial(init_params, Qwen2(cfg.model))
  with clock.phase("abstract state"):
    structs, shardings = parallel.abstract_state(init_fn, optimizer, place.mesh, place.rules)
    budget = preflight.device_budget(place.mesh.local_devices)
    preflight.check_state(cfg, structs, budget, len(place.mesh.local_devices), log=_print0)
    beside = preflight.state_fits_beside_compile(structs, budget, len(place.mesh.local_devices))
  checkpointer = Checkpointer(workdir, cfg.checkpoint, owner=True,
                              keep_steps=_decay_start_checkpoint(cfg),
                              adam=(cfg.opt.b1, cfg.opt.b2))
  checkpointer.identity = identity.describe(
      cfg, identity.run_id(workdir, checkpointer.first_identity()),
      identity.data_fingerprint(cfg.data, data.stats))
  train_iter = iter(data.train)
  state_clock = startup.PhaseClock()
  get_state = functools.partial(_restored_or_initial_state, cfg, workdir, checkpointer, structs,
                                train_iter, init_fn, optimizer, shardings, place, state_clock)
  start_compiles = functools.partial(_start_compiles, cfg, model, optimizer, schedule, structs,
                                     shardings, place, data.special.pad, bool(eval_batches),
                                     clock)
  finish_compiles = functools.partial(_finish_compiles, cfg, budget=budget,
                                      devices=len(place.mesh.local_devices), clock=clock)
  if beside:   # the state is restored or initialised while the steps trace and compile
    state_job = Background(get_state, "state")
    try:
      pending = start_compiles()
      with clock.phase("wait for the state"):
        start_step, state, initialised = state_job.result()
      steps, memory = finish_compiles(pending)
    except BaseException as e:
      if not isinstance(e, KeyboardInterrupt):   # let a restore in flight end before closing
        state_job.wait(timeout=60)
      checkpointer.close()
      raise
    clock.beside.update(state_clock.phases)
  else:        # a large state: allocated only once the compiled step is known to fit
    steps, memory = finish_compiles(start_compiles())
    start_step, state, initialised = get_state()
    clock.phases.update(state_clock.phases)
  if initialised:
    _write_config(cfg, workdir)

  writer = MetricsWriter(workdir, cfg.log, cfg.steps, start_step, run_config=cfg.to_dict())
  writer.print(f"{cfg.model.num_params() / 1e6:.1f}M params, recipe {cfg.precision.recipe}, "
               f"mesh {dict(place.mesh.shape)}, {data.summary()}, "
               + startup.init_source(cfg, start_step))
  writer.print(startup.precision_line(cfg, steps.train))
  writer.print(memory)
  writer.print(clock.line())  # the start-up ends here
  if start_step >= cfg.steps:
    writer.print(f"{workdir} already finished its {cfg.steps} steps; raise --config.steps to go on")
  loop = _Loop(cfg, place, steps, eval_batches, checkpointer, writer, start_step,
               source_tokens=data.source_tokens)
  try:
    with preemption.StopRequests() as stop:
      last = loop.run(state, train_iter, stop)
      if stop.signum is not None:  # it came during the last step, its evaluation or save
        writer.print(preemption.after_last_step(stop.signum, cfg.steps, checkpointer.directory))
  finally:
    checkpointer.close()
    writer.close()
  _print0(startup.closing_summary(cfg, workdir, last, start_step=start_step,
                                  wall_s=clock.elapsed(), startup_s=clock.startup_s))
  return last


def _decay_start_checkpoint(cfg: TrainConfig) -> tuple[int, ...]:
  """(the step of the run's last scheduled checkpoint before its wsd decay,) or ()."""
  end, every = stable_end(cfg.opt, cfg.steps), cfg.checkpoint.every_steps
  if cfg.opt.schedule != "wsd" or end is None or every <= 0 or end >= cfg.steps:
    return ()
  last = end // every * every
  return (last,) if last > 0 else ()


def _print0(message: str) -> None:
  if jax.process_index() == 0:
    print(message, flush=True)


def _start_compiles(cfg, model, optimizer, schedule, structs, shardings, place, pad_id,
                    evaluates: bool, clock):
  """The jitted steps, traced here from abstract shapes and compiled ahead of time by XLA on
  background threads (preflight.PendingStep), so that restoring or initialising the state
  runs beside the compile; `_finish_compiles` waits for them. The eval step only when the
  run evaluates. Returns (steps, pending train step, pending eval step or None)."""
  steps = _jit_steps(cfg, model, optimizer, schedule, shardings, place)
  batch = startup.abstract_batch(cfg, pad_id, place.batch)
  with place.context():
    with clock.phase("train step trace"):
      train = preflight.compile_step(steps.train, structs, batch)
    evaluate = None
    if evaluates:
      with clock.phase("eval step trace"):
        evaluate = preflight.compile_step(steps.eval, structs["params"], batch)
  return steps, train, evaluate


def _finish_compiles(cfg, pending, *, budget, devices: int, clock):
  """The compiled steps (each compiled once: the loop calls these executables) and the
  train step's memory checked against the devices before the first step. Returns (steps,
  the memory line)."""
  steps, train, evaluate = pending
  with clock.phase("compile wait"):   # the compiles' time beyond what ran beside them
    train_step = train.result()
    eval_step = evaluate.result() if evaluate is not None else None
  memory = preflight.check_step(cfg, train_step, budget, devices, log=_print0)
  memory += (f"; train step traced in {train_step.lower_s:.1f} s, compiled in "
             f"{train_step.compile_s:.1f} s (beside the start-up's other work)")
  return dataclasses.replace(
      steps, train=train_step.compiled,
      eval=eval_step.compiled if eval_step is not None else steps.eval), memory


def _restored_or_initial_state(cfg, workdir, checkpointer, structs, train_iter, init_fn,
                               optimizer, shardings, place, clock):
  """(start step, state, whether it was initialised): the newest checkpoint that restores,
  else step 0's state; each timed on `clock` ("restore", "init")."""
  restoring = bool(rundir.checkpoint_steps(workdir))
  with clock.phase("restore") if restoring else contextlib.nullcontext():
    start_step, state = _resume(cfg, workdir, checkpointer, structs, train_iter)
  if state is not None:
    return start_step, state, False
  with clock.phase("init"):
    return start_step, _initial_state(cfg, init_fn, optimizer, structs, shardings, place), True


def _resume(cfg, workdir, checkpointer, structs, train_iter):
  """(start step, state): the newest checkpoint that restores, else (0, None).

  A config whose train state has another shape than the run's is refused first (before any
  checkpoint could be taken for damaged); other changes are recorded once resumed.
  """
  try:
    changes = (resume.check(cfg, workdir, _state_structure, checkpointer.newest_config())
               if rundir.checkpoint_steps(workdir) else {})
    start_step, restored = checkpointer.restore_latest(structs, train_iter, log=_print0)
    if restored is not None:  # its run and data (train/identity.py), before any training
      identity.check_restored(checkpointer.restored_identity, checkpointer.identity, cfg,
                              start_step, workdir, resume.changes_data(changes), _print0)
  except BaseException:
    checkpointer.close()
    raise
  if restored is None:
    return 0, None
  if jax.process_index() == 0:
    if changes:
      _print0(resume.record(cfg, workdir, start_step, changes))
    elif rundir.config_dict(workdir) is None:
      rundir.write_config(workdir, cfg)
  return start_step, restored


def _state_structure(cfg: TrainConfig) -> dict[str, tuple]:
  """{path: (shape, dtype)} of the train state of `cfg` (abstract: nothing allocated)."""
  model = build_model(cfg)
  optimizer = make_optimizer(cfg.opt, cfg.steps)

  def init():
    params = nn.unbox(init_params(model, jax.random.key(0)))
    return {"step": jnp.int32(0), "params": params, "opt_state": optimizer.init(params)}
  leaves, _ = jax.tree_util.tree_flatten_with_path(jax.eval_shape(init))
  return {jax.tree_util.keystr(p): (tuple(x.shape), str(x.dtype)) for p, x in leaves}


class _Loop:
  """The step loop: dispatch step N, read step N-1's metrics, evaluate and save on schedule."""

  def __init__(self, cfg, place, steps, eval_batches, checkpointer, writer, start_step,
               source_tokens=lambda step: {}):
    self.cfg, self.place, self.steps = cfg, place, steps
    self.source_tokens = source_tokens
    self.eval_batches, self.checkpointer, self.writer = eval_batches, checkpointer, writer
    self.start_step = start_step
    self.last_good = start_step if start_step else None
    self.timer = _Timer()
    self.tokens_per_step = cfg.batch_size * cfg.seq_len
    self.flops_per_step = cfg.model.flops_per_token(cfg.seq_len) * self.tokens_per_step
    self.peak = peak_flops_per_device(cfg.log)
    self.profiler = StepProfiler(cfg.profile, writer.workdir, log=writer.print)

  def evaluate(self, params) -> dict[str, float]:
    """{"eval_loss": the validation set's token loss, "eval_loss/NAME": each mixture
    source's own validation set}, and each one's "eval_perplexity[/NAME]"."""
    out = {}
    for name, batches in self.eval_batches.items():
      with self.place.context():
        sums = [self.steps.eval(params, b) for b in batches]
      tokens = sum(float(s[1]) for s in sums)
      loss = sum(float(s[0]) for s in sums) / max(tokens, 1.0)
      out["eval_loss" + (f"/{name}" if name else "")] = loss
      out["eval_perplexity" + (f"/{name}" if name else "")] = perplexity(loss)
    return out

  def check_finite(self, step: int, metrics: dict[str, float], state_finite: bool) -> None:
    loss, grad_norm = metrics["loss"], metrics["grad_norm"]
    if math.isfinite(loss) and math.isfinite(grad_norm) and state_finite:
      return
    self.checkpointer.wait()
    what = (f"non-finite loss {loss} (grad norm {grad_norm}) at step {step}"
            if not (math.isfinite(loss) and math.isfinite(grad_norm)) else
            f"the train state turned non-finite in the update of step {step} (its loss {loss} "
            f"and grad norm {grad_norm} were finite)")
    how = nan_advice.advice(step, self.start_step, self.last_good, self.checkpointer.directory,
                            self.cfg.opt.lr, rundir.checkpoint_steps(self.writer.workdir))
    raise NonFiniteLossError(f"{what}; the state of that step was not saved. {how}")

  def log(self, step, device_metrics) -> dict[str, float]:
    extra = {f"data/tokens/{name}": n for name, n in self.source_tokens(step).items()}
    return _log_step(self.writer, step, device_metrics, self.timer, self.tokens_per_step,
                     self.flops_per_step, self.peak, self.place.mesh.size, self.check_finite,
                     extra)

  def dispatch(self, step, state, batch):
    cfg, steps = self.cfg, self.steps
    with self.place.context():
      if step in cfg.skip_steps:  # a documented way past a batch that gives NaN
        self.writer.print(f"step {step}: batch skipped (skip_steps)")
        self.writer.write(step, {"skipped_batch": 1}, console=False)
        return steps.skip(state), None
      if steps.telemetry is not None and step % cfg.precision.telemetry_every_steps == 0:
        return steps.telemetry(state, batch, steps.sinks)
      return steps.train(state, batch)

  def run(self, state, train_iter, stop: preemption.StopRequests) -> dict[str, Any]:
    cfg = self.cfg
    last: dict[str, Any] = {}
    if self.eval_batches and self.start_step == 0:
      evals = self.evaluate(state["params"])
      last.update(evals)
      self.writer.write(0, evals)
    try:
      return self._steps(state, train_iter, stop, last)
    finally:
      self.profiler.stop(cfg.steps, force=True)   # a run stopped inside the traced steps

  def _steps(self, state, train_iter, stop, last):
    cfg = self.cfg
    pending = None  # (step, device metrics) of the previous step, read while the next one runs
    for step in range(self.start_step + 1, cfg.steps + 1):
      self.checkpointer.poll()  # a failed background save stops the run before this step
      batch = _global_batch(self.place.checked(next(train_iter)), self.place.batch,
                            cfg.batch_size)
      self.profiler.start(step)
      state, device_metrics = self.dispatch(step, state, batch)
      self.profiler.stop(step, (state, device_metrics))
      if pending is not None:  # read step N-1 while step N runs
        last = self.log(*pending)
      pending = None if device_metrics is None else (step, device_metrics)
      stopping = stop.stop_at(step)
      due_save = self.checkpointer.should_save(step) or step == cfg.steps or stopping
      due_eval = self.eval_batches and (step % cfg.eval.every_steps == 0 or step == cfg.steps)
      if (due_save or due_eval) and pending is not None:  # known before we keep its state
        last = self.log(*pending)
        pending = None
      if due_eval:  # before the save: a kill right after the checkpoint keeps this eval line
        evals = self.evaluate(state["params"])
        last.update(evals)
        self.writer.write(step, evals)
      if due_save:
        self.writer.flush()  # the logs of every step the checkpoint covers are on disk
        self.checkpointer.save(step, state, train_iter)
        self.last_good = step
      if stopping and step < cfg.steps:  # at the last step the run is complete: it ends as one
        self._stop(step, stop.signum)
      if due_save or due_eval:
        self.timer.reset()  # keep evaluation and checkpoint time out of the next step time
    if pending is not None:
      last = self.log(*pending)
    return last

  def _stop(self, step: int, signum: int):
    self.checkpointer.wait()
    self.writer.flush()
    message = (f"stopped by {signal.Signals(signum).name} after step {step}: checkpoint "
               f"{step} is in {self.checkpointer.directory}; re-run the same command to resume")
    self.writer.print(message)
    raise preemption.Preempted(signum, message)


class _Timer:
  """Wall time between consecutive metric reads: the step time once the pipeline is full."""

  def __init__(self):
    self._last = None

  def lap(self) -> float | None:
    now = time.perf_counter()
    dt = None if self._last is None else now - self._last
    self._last = now
    return dt

  def reset(self) -> None:
    self._last = None


def _log_step(writer, step, device_metrics, timer, tokens_per_step, flops_per_step, peak,
              num_devices, check_finite, extra=None):
  device_metrics = dict(device_metrics)
  fp8_stats = device_metrics.pop("fp8", None)
  metrics = {k: float(v) for k, v in jax.device_get(device_metrics).items()}
  state_finite = bool(metrics.pop("state_finite", 1.0))
  if fp8_stats is not None:  # exact operands have SNR +inf: left out of the logs
    metrics.update(telemetry.finite_only(telemetry.summarize(fp8_stats["fwd"], fp8_stats["bwd"])))
  dt = timer.lap()
  check_finite(step, metrics, state_finite)
  metrics["perplexity"] = perplexity(metrics["loss"])
  if dt is not None:
    metrics["step_time_s"] = dt
    metrics["tokens_per_s"] = tokens_per_step / dt
    if peak:
      metrics["mfu"] = flops_per_step / dt / (peak * num_devices)
  metrics.update(extra or {})
  if step % writer.cfg.every_steps == 0:
    writer.write(step, metrics)
  return metrics


def _telemetry_step(cfg, model, optimizer, schedule, shardings, place):
  """The step variant that also measures FP8 numerics, run every telemetry_every_steps."""
  if not cfg.precision.telemetry_every_steps:
    return None, None
  model_t = build_model(cfg, telemetry=True)
  try:
    sinks = telemetry.init_sinks(model_t, jax.random.key(0), jnp.zeros((1, 1), jnp.int32))
  except ValueError:  # no FP8 projection under this recipe: nothing to measure
    return None, None
  sinks = jax.device_put(sinks, place.replicated)
  with place.context():
    step = jax.jit(
        _with_finite_flag(make_train_step(model, optimizer, schedule, cfg.grad_accum_steps,
                                          telemetry_model=model_t,
                                          apply=make_apply(cfg.opt, cfg.steps, optimizer))),
        in_shardings=(shardings, place.batch, place.replicated),
        out_shardings=(shardings, place.replicated), donate_argnums=0)
  return step, sinks


def _initial_state(cfg: TrainConfig, init_fn, optimizer, structs, shardings, place):
  """Step 0's state: random init, or weights from an HF checkpoint / another run, placed
  shard by shard (then no random init is compiled or run). Adam moments start at zero."""
  if cfg.init.hf_checkpoint:
    from infir2_jax import hf  # pylint: disable=g-import-not-at-top
    params = hf.load_params(cfg.init.hf_checkpoint, cfg.model, shardings["params"])
  elif cfg.init.from_run:
    step = None if cfg.init.from_run_step < 0 else cfg.init.from_run_step
    params = restore_params(cfg.init.from_run, structs["params"], step)
  else:
    return parallel.sharded_init(init_fn, optimizer, place.mesh, place.rules,
                                 jax.random.key(cfg.seed))[0]
  with place.context():
    return startup.fresh_state(params, optimizer, shardings)


def _write_config(cfg: TrainConfig, workdir: str) -> None:
  if jax.process_index() == 0:
    rundir.write_config(workdir, cfg)
