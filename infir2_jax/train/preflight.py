"""Memory pre-flight: will the train step fit, asked before any of its state is allocated.

Two checks, cheap first:
1. the train state (params + optimizer state, each device's shards) and one f32 gradient
   of the params, from abstract shapes: a lower bound known before anything compiles;
2. XLA's memory analysis of the train step compiled ahead of time from abstract shapes
   (`jit(step).lower(structs).compile().memory_analysis()`): arguments + outputs - aliased
   (donated) buffers + temporaries, per device.

Each is compared with what the devices have: on a GPU the allocator's `bytes_limit` (less
what is in use), on a CPU the host's MemAvailable (CPU devices share the host's memory, so
the per-device figure counts once per local device). A step that cannot fit stops with one
line naming what it needs, what there is and what to change, instead of the kernel's OOM
killer or a RESOURCE_EXHAUSTED after minutes of initialisation.

$INFIR2_MEMORY_PREFLIGHT=warn prints the message and goes on; =off skips the checks.
"""

import dataclasses
import math
import os
import time
from typing import Any

import jax
import numpy as np

from infir2_jax.errors import UserError
from infir2_jax.train.background import Background

ENV = "INFIR2_MEMORY_PREFLIGHT"
GIB = 2**30


class InsufficientMemoryError(UserError, RuntimeError):
  """The train step needs more memory than the devices have."""


@dataclasses.dataclass(frozen=True)
class Budget:
  """The memory a run may use: bytes per device (GPU) or for all local devices (CPU host)."""
  available: int
  what: str          # "this host (MemAvailable)" | "GPU 0 (NVIDIA H200)"
  per_device: bool   # False: one pool shared by every local device (CPU)


def host_available_bytes() -> int:
  """MemAvailable of /proc/meminfo (what can be allocated without swapping), else free RAM."""
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def device_budget(devices=None) -> Budget | None:
  """What the local devices can hold; None when it cannot be told (no memory stats)."""
  devices = list(devices or jax.local_devices())
  if devices[0].platform == "cpu":
    return Budget(host_available_bytes(), "this host (MemAvailable)", per_device=False)
  free = []
  for d in devices:
    stats = d.memory_stats() or {}
    if "bytes_limit" not in stats:
      return None
    free.append((stats["bytes_limit"] - stats.get("bytes_in_use", 0), d))
  available, device = min(free, key=lambda x: x[0])
  return Budget(int(available), f"{device.platform.upper()} {device.id} ({device.device_kind})",
                per_device=True)


def shard_bytes(structs) -> int:
  """The most bytes any one device holds of a pytree of ShapeDtypeStructs with shardings."""
  per_device: dict[Any, int] = {}
  for leaf in jax.tree.leaves(structs):
    sharding = leaf.sharding
    nbytes = math.prod(sharding.shard_shape(leaf.shape)) * np.dtype(leaf.dtype).itemsize
    for device in sharding.addressable_devices:
      per_device[device] = per_device.get(device, 0) + nbytes
  return max(per_device.values(), default=0)


@dataclasses.dataclass(frozen=True)
class StepMemory:
  """XLA's memory analysis of one compiled step, bytes per device."""
  argument: int
  output: int
  alias: int
  temp: int
  code: int

  @property
  def peak(self) -> int:
    return self.argument + self.output - self.alias + self.temp + self.code

  @classmethod
  def of(cls, compiled) -> "StepMemory | None":
    try:
      m = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - some backends / cached executables have none
      return None
    if m is None:
      return None
    return cls(m.argument_size_in_bytes, m.output_size_in_bytes, m.alias_size_in_bytes,
               m.temp_size_in_bytes, getattr(m, "generated_code_size_in_bytes", 0))


def _gib(n: float) -> str:
  return f"{n / GIB:.1f} GiB"


def _advice(cfg, activations: bool) -> str:
  """What to change: batch and recomputation shrink the step's temporaries, only sharding
  (or a smaller model) shrinks the state."""
  tips = []
  if activations:
    tips.append(f"a smaller batch (--config.batch_size={cfg.batch_size} -> "
                f"{max(cfg.batch_size // 2, 1)}, or --config.grad_accum_steps="
                f"{cfg.grad_accum_steps * 2} for the same batch)")
    if cfg.model.remat != "full":
      tips.append(f"more recomputation (--config.model.remat=full; now {cfg.model.remat!r})")
  devices = jax.device_count()
  tips.append(f"a mesh that shards the state over more devices (--config.mesh.fsdp=N; "
              f"{devices} device(s) here)")
  if not activations:
    tips.append("a smaller model")
  return "try " + ", ".join(tips)


def _needs(per_device: int, budget: Budget, num_devices: int, detail: str) -> tuple[int, str]:
  """(bytes measured against the budget, how they add up)."""
  if budget.per_device or num_devices == 1:
    return per_device, detail
  return per_device * num_devices, f"{num_devices} devices x {_gib(per_device)}: {detail}"


def _verdict(needed: int, budget: Budget, what: str, detail: str, advice: str) -> str | None:
  if needed <= budget.available:
    return None
  return (f"memory pre-flight: {what} needs {_gib(needed)} ({detail}), "
          f"{budget.what} has {_gib(budget.available)}; {advice}. "
          f"{ENV}=warn runs it anyway.")


def _stop(message: str | None, log) -> None:
  if message is None:
    return
  if os.environ.get(ENV, "").lower() == "warn":
    log(f"warning: {message}")
    return
  raise InsufficientMemoryError(message)


def enabled() -> bool:
  return os.environ.get(ENV, "").lower() not in ("off", "0", "false")


def check_state(cfg, structs, budget: Budget | None, num_devices: int, log=print) -> None:
  """The cheap check: train state + one f32 gradient of the params, before any compile."""
  if budget is None or not enabled():
    return
  state = shard_bytes(structs)
  grads = shard_bytes(structs["params"])
  needed, detail = _needs(state + grads, budget, num_devices,
                          f"state {_gib(state)} + gradients {_gib(grads)}, before activations")
  _stop(_verdict(needed, budget, "the train state alone", detail,
                 _advice(cfg, activations=False)), log)


# The state may be allocated while the train step compiles (the start-up's restore or init
# beside XLA's compile) when it takes at most this share of the devices' memory; a larger
# state waits for the compiled step's check, so a step that cannot fit stops before any of
# its state exists.
STATE_SHARE_BESIDE_COMPILE = 0.5


def state_fits_beside_compile(structs, budget: Budget | None, num_devices: int) -> bool:
  """Whether the train state (and one f32 gradient) leaves at least half of the budget free;
  False when the budget is unknown or the checks are off."""
  if budget is None or not enabled():
    return False
  needed, _ = _needs(shard_bytes(structs) + shard_bytes(structs["params"]), budget, num_devices,
                     "")
  return needed <= STATE_SHARE_BESIDE_COMPILE * budget.available


@dataclasses.dataclass
class CompiledStep:
  """A step compiled ahead of time, with the seconds its tracing and compilation took."""
  compiled: Any
  lower_s: float
  compile_s: float
  memory: StepMemory | None


class PendingStep:
  """A step traced and lowered here, being compiled by XLA in the background
  (train/background.py: the compile releases the GIL, so the start-up's other work runs
  beside it); `result()` waits for it."""

  def __init__(self, lowered, lower_s: float):
    self.lower_s = lower_s
    self._compile = Background(lowered.compile, "compile")

  def result(self) -> CompiledStep:
    compiled = self._compile.result()
    return CompiledStep(compiled, self.lower_s, self._compile.seconds, StepMemory.of(compiled))


def compile_step(jitted, *abstract_args) -> PendingStep:
  """jitted.lower(*abstract_args) now, .compile() in the background: `.result()` is the
  executable the loop then calls (no second compile), timed, with its memory analysis."""
  t0 = time.perf_counter()
  lowered = jitted.lower(*abstract_args)
  return PendingStep(lowered, time.perf_counter() - t0)


def check_step(cfg, step: CompiledStep, budget: Budget | None, num_devices: int,
               log=print) -> str:
  """The exact check, from the compiled step's memory analysis. Returns a summary line."""
  m = step.memory
  if m is None:
    return "memory pre-flight: no memory analysis for this backend; not checked"
  detail = (f"arguments {_gib(m.argument)} + temporaries {_gib(m.temp)} + outputs not "
            f"donated {_gib(max(m.output - m.alias, 0))}")
  if budget is None:
    return f"memory: the train step needs {_gib(m.peak)} per device ({detail})"
  needed, how = _needs(m.peak, budget, num_devices, detail)
  if enabled():
    _stop(_verdict(needed, budget, "the train step", how, _advice(cfg, activations=True)), log)
  return (f"memory: the train step needs {_gib(needed)} ({how}), {budget.what} has "
          f"{_gib(budget.available)}")
