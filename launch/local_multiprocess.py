"""Runs one command as P cooperating JAX processes on this machine (a multi-host job in small).

  python launch/local_multiprocess.py --num_processes=2 --cpu_devices=4 -- \
      python -m infir2_jax.train --config=configs/default.py:smoke --workdir=runs/mp

Each process gets JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID (read by
infir2_jax.parallel.distributed.initialize) and, on CPU, `cpu_devices` fake devices talking over gloo;
with --gpus_per_process each gets its own GPUs (JAX_LOCAL_DEVICE_IDS). Output lines are
prefixed with [pI seconds]. If one process fails, the others are stopped; the exit status is the
first non-zero one.
"""

import argparse
import os
import re
import socket
import subprocess
import sys
import threading
import time


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def process_env(base: dict[str, str], *, index: int, count: int, port: int,
                cpu_devices: int, gpus_per_process: int) -> dict[str, str]:
  """The environment of process `index`."""
  env = dict(base)
  env.update(JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES=str(count),
             JAX_PROCESS_ID=str(index))
  if gpus_per_process:
    first = index * gpus_per_process
    env["JAX_LOCAL_DEVICE_IDS"] = ",".join(str(first + i) for i in range(gpus_per_process))
  else:
    env["JAX_PLATFORMS"] = "cpu"
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={cpu_devices}".strip()
  return env


def _pump(stream, index: int, start: float, out) -> None:
  for line in iter(stream.readline, b""):
    out.write(f"[p{index} {time.monotonic() - start:6.1f}s] {line.decode(errors='replace')}")
    out.flush()


def launch(command: list[str], *, num_processes: int, cpu_devices: int = 4,
           gpus_per_process: int = 0, port: int = 0, timeout: float | None = None,
           env: dict[str, str] | None = None, out=None) -> int:
  """Runs `command` as `num_processes` processes; returns the first non-zero exit status."""
  if num_processes < 1 or cpu_devices < 1:
    raise ValueError(f"need num_processes >= 1 and cpu_devices >= 1, got {num_processes}, "
                     f"{cpu_devices}")
  if not command:
    raise ValueError("no command given (put it after --)")
  out = sys.stdout if out is None else out
  port = port or free_port()
  start = time.monotonic()
  procs, pumps = [], []
  for i in range(num_processes):
    proc_env = process_env(os.environ if env is None else env, index=i, count=num_processes,
                           port=port, cpu_devices=cpu_devices,
                           gpus_per_process=gpus_per_process)
    p = subprocess.Popen(command, env=proc_env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT)
    procs.append(p)
    pumps.append(threading.Thread(target=_pump, args=(p.stdout, i, start, out), daemon=True))
    pumps[-1].start()
  status = 0
  deadline = None if timeout is None else time.monotonic() + timeout
  try:
    pending = list(procs)
    while pending:
      time.sleep(0.2)
      for p in [p for p in pending if p.poll() is not None]:
        pending.remove(p)
        if p.returncode and not status:
          status = p.returncode
          for other in pending:  # a dead peer would leave the others blocked in collectives
            other.terminate()
      if deadline is not None and time.monotonic() > deadline and pending:
        out.write(f"timed out after {timeout} s; killing {len(pending)} processes\n")
        for p in pending:
          p.kill()
        status = status or 124
        break
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
    for t, p in zip(pumps, procs):
      t.join(timeout=5)
      p.stdout.close()
  return status


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--num_processes", type=int, default=2)
  parser.add_argument("--cpu_devices", type=int, default=4,
                      help="fake CPU devices per process (CPU runs)")
  parser.add_argument("--gpus_per_process", type=int, default=0,
                      help="GPUs per process; 0 = run on CPU")
  parser.add_argument("--port", type=int, default=0, help="coordinator port (0 = a free one)")
  parser.add_argument("--timeout", type=float, default=None, help="seconds before killing all")
  parser.add_argument("command", nargs=argparse.REMAINDER)
  args = parser.parse_args(argv)
  command = args.command[1:] if args.command[:1] == ["--"] else args.command
  return launch(command, num_processes=args.num_processes, cpu_devices=args.cpu_devices,
                gpus_per_process=args.gpus_per_process, port=args.port, timeout=args.timeout)


if __name__ == "__main__":
  sys.exit(main())
