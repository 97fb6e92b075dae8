"""Process-level set-up before any computation: multi-host initialisation and the compile cache.

A multi-process job is described, in order of precedence, by
  1. flags  --coordinator_address=host:port --num_processes=N --process_id=I
            [--local_device_ids=0,1,...]  (defined here; any absl entry point parses them),
  2. JAX's environment variables  JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID
            [JAX_LOCAL_DEVICE_IDS]  (launch/local_multiprocess.py sets these),
  3. a SLURM step with more than one task (launch/slurm_train.sbatch): JAX's own SLURM
            detection; one task per GPU, or one task per node seeing all its GPUs.
Anything else is a single-process run and jax.distributed is left alone.
"""

import contextlib
import dataclasses
import os
import threading
from collections.abc import Mapping

import jax
from absl import flags, logging

_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0 for a multi-process run "
    "(overrides $JAX_COORDINATOR_ADDRESS; SLURM jobs need nothing).")
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes", None, "Number of processes of a multi-process run ($JAX_NUM_PROCESSES).")
_PROCESS_ID = flags.DEFINE_integer(
    "process_id", None, "This process's index in [0, num_processes) ($JAX_PROCESS_ID).")
_LOCAL_DEVICE_IDS = flags.DEFINE_list(
    "local_device_ids", None, "Accelerators this process uses, e.g. 0,1 "
    "($JAX_LOCAL_DEVICE_IDS; default: all visible).")


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
  """Arguments of jax.distributed.initialize; None entries are left to JAX's detection."""
  source: str                        # "flags" | "env" | "slurm"
  coordinator_address: str | None = None
  num_processes: int | None = None
  process_id: int | None = None
  local_device_ids: tuple[int, ...] | None = None

  def __post_init__(self):
    if self.source == "slurm":
      return
    missing = [name for name in ("coordinator_address", "num_processes", "process_id")
               if getattr(self, name) is None]
    if missing:
      raise ValueError(f"multi-process set-up from {self.source} is missing {missing}: give "
                       "coordinator_address, num_processes and process_id together")
    if not 0 <= self.process_id < self.num_processes:
      raise ValueError(f"process_id={self.process_id} is not in [0, {self.num_processes})")


def _int(env: Mapping[str, str], name: str) -> int | None:
  value = env.get(name)
  if value in (None, ""):
    return None
  try:
    return int(value)
  except ValueError:
    raise ValueError(f"${name}={value!r} is not an integer") from None


def _ids(value) -> tuple[int, ...] | None:
  if value in (None, "", []):
    return None
  items = value.split(",") if isinstance(value, str) else value
  return tuple(int(i) for i in items)


def _slurm_local_device_ids(env: Mapping[str, str]) -> tuple[int, ...] | None:
  """All GPUs of the node when SLURM runs one task per node (JAX would take only GPU 0)."""
  nodes = _int(env, "SLURM_STEP_NUM_NODES") or _int(env, "SLURM_NNODES") or 1
  tasks = _int(env, "SLURM_STEP_NUM_TASKS") or _int(env, "SLURM_NTASKS") or 1
  gpus = _int(env, "SLURM_GPUS_ON_NODE")
  if tasks == nodes and gpus:
    return tuple(range(gpus))
  return None  # one task per GPU: JAX's default (SLURM_LOCALID) is right


def distributed_config(env: Mapping[str, str] | None = None, *,
                       coordinator_address: str | None = None,
                       num_processes: int | None = None, process_id: int | None = None,
                       local_device_ids=None) -> DistributedConfig | None:
  """How this process joins a multi-process job, or None for a single-process run.

  Explicit arguments (the flags) win over JAX_* variables, which win over SLURM.
  """
  env = os.environ if env is None else env
  if coordinator_address or num_processes is not None or process_id is not None:
    if num_processes == 1:
      return None
    return DistributedConfig("flags", coordinator_address, num_processes, process_id,
                             _ids(local_device_ids) or _ids(env.get("JAX_LOCAL_DEVICE_IDS")))
  if env.get("JAX_COORDINATOR_ADDRESS") or env.get("JAX_NUM_PROCESSES"):
    num = _int(env, "JAX_NUM_PROCESSES")
    if num == 1:
      return None
    return DistributedConfig("env", env.get("JAX_COORDINATOR_ADDRESS"), num,
                             _int(env, "JAX_PROCESS_ID"), _ids(env.get("JAX_LOCAL_DEVICE_IDS")))
  if "SLURM_JOB_ID" in env and (_int(env, "SLURM_NTASKS") or 1) > 1:
    ids = _ids(env.get("JAX_LOCAL_DEVICE_IDS")) or _slurm_local_device_ids(env)
    return DistributedConfig("slurm", local_device_ids=ids)
  return None


def _flag(holder):
  return holder.value if flags.FLAGS.is_parsed() else None


def initialize(*, coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, local_device_ids=None) -> None:
  """Joins a multi-process job when one is configured, lets the GPU allocator take 95% of
  device memory (default_memory_fraction), and enables the compilation cache.

  Call before any JAX computation. Arguments default to this module's flags (when parsed),
  then the environment (see the module docstring). Idempotent.
  """
  default_memory_fraction()
  cfg = distributed_config(
      coordinator_address=coordinator_address or _flag(_COORDINATOR),
      num_processes=num_processes if num_processes is not None else _flag(_NUM_PROCESSES),
      process_id=process_id if process_id is not None else _flag(_PROCESS_ID),
      local_device_ids=local_device_ids or _flag(_LOCAL_DEVICE_IDS))
  if cfg is not None and not jax.distributed.is_initialized():
    # CPU processes talk over gloo (JAX's default; set so a site-wide setting cannot break it).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=cfg.coordinator_address, num_processes=cfg.num_processes,
        process_id=cfg.process_id,
        local_device_ids=list(cfg.local_device_ids) if cfg.local_device_ids else None)
    logging.info("joined a %d-process job (from %s) as process %d with %d local devices",
                 jax.process_count(), cfg.source, jax.process_index(), jax.local_device_count())
  enable_compilation_cache()


DEFAULT_MEMORY_FRACTION = "0.95"


def default_memory_fraction() -> str:
  """Sets XLA_PYTHON_CLIENT_MEM_FRACTION to 0.95 unless the user set it; returns its value.

  JAX's allocator takes 75% of GPU memory by default. A step that needs more fails with
  RESOURCE_EXHAUSTED although it fits the card: the 1.5B step at remat=none (2 x 8192) needs
  102 GiB, the H200's 75% is 104 GiB, and the allocation of its 76-GiB temporary failed
  (benchmarks/NOTES_e2e.md). Takes effect only before the first GPU computation."""
  return os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", DEFAULT_MEMORY_FRACTION)


def enable_compilation_cache() -> str:
  """JAX's persistent compilation cache in $INFIR2_COMPILATION_CACHE (default
  ~/.cache/infir2_jax/jax_cache; empty disables it). Returns the directory ("" if off).

  Programs that compile in 2 s or more are kept, so a restarted run, or a benchmark's next
  process with the same init, does not compile them again (the 1.5B init alone takes ~85 s
  to compile for the H200: XLA compiles a kernel per parameter array)."""
  cache_dir = os.environ.get("INFIR2_COMPILATION_CACHE",
                             os.path.expanduser("~/.cache/infir2_jax/jax_cache"))
  if cache_dir:
    install_atomic_cache_writes()
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 2.0)
  return cache_dir


def install_atomic_cache_writes() -> bool:
  """Makes JAX's persistent-cache writes atomic (a temporary file, then os.replace), and lets
  a rewrite replace an entry that is already there. Returns whether the patch is in place.

  JAX 0.11's LRUCache.put writes the entry in place and never rewrites a key that exists.
  So a process killed mid-write, a full disk or a file-size limit (EFBIG) leaves a truncated
  entry behind, and it stays. Every later start that needs that program warns "Error
  reading persistent compilation cache entry ... truncated stream" and compiles it again,
  and the warm start-up is lost for good (found by scripts/fault_injection.py's disk
  family, session 18). JAX only writes a key after its read missed or failed, so replacing
  the file heals such an entry; a concurrent writer of the same key writes the same program.
  Only the local, unbounded cache is patched (jax_compilation_cache_max_size unset): with
  eviction on, JAX's own put and its lock stay."""
  from jax._src import lru_cache  # pylint: disable=g-import-not-at-top
  cls = getattr(lru_cache, "LRUCache", None)
  original = getattr(cls, "put", None)
  if original is None:
    return False
  if getattr(original, "infir2_atomic", False):
    return True
  suffix = getattr(lru_cache, "_CACHE_SUFFIX", "-cache")

  def put(self, key: str, value: bytes) -> None:
    if (not key or getattr(self, "eviction_enabled", True)
        or not getattr(self, "_is_local", False)):
      return original(self, key, value)
    path = os.path.join(str(self.path), f"{key}{suffix}")
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
    try:
      with open(tmp, "wb") as f:
        f.write(value)
      os.replace(tmp, path)
    except BaseException:
      with contextlib.suppress(OSError):
        os.remove(tmp)
      raise

  put.infir2_atomic = True
  cls.put = put
  return True
