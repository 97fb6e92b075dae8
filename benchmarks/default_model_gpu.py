"""The embedded default model trained on the GPU with each FP8 execution path, in one process.

  python benchmarks/default_model_gpu.py --steps=40 --out=DIR

Runs the real trainer (real data, real shapes) for: bf16; infir2 on the XLA path; infir2 on
the Pallas kernels; fp8_tensorwise. Writes each run's metrics.jsonl and a summary JSON with
the loss curves, median step times and, from XLA's HLO dump, the FP8 GEMMs each run compiled
to (cuBLASLt `$f8` calls and Mosaic GPU kernels). Answers: do the kernels give the XLA path's
loss curve, and does per-tensor FP8 hit XLA's native FP8 GEMM.
"""

import argparse
import glob
import json
import os
import re
import shutil
import sys
import time

VARIANTS = (("bf16", "xla"), ("infir2", "xla"), ("infir2", "pallas"), ("fp8_tensorwise", "xla"))


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--steps", type=int, default=40)
  p.add_argument("--out", required=True)
  p.add_argument("--variants", default=",".join(f"{r}:{b}" for r, b in VARIANTS))
  p.add_argument("--override", action="append", default=[])
  args = p.parse_args()
  dump = os.path.join("/tmp", f"infir2_hlo_dump_{os.getpid()}")  # runs side by side
  shutil.rmtree(dump, ignore_errors=True)
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + f" --xla_dump_to={dump} --xla_dump_hlo_as_text"
                             " --xla_dump_hlo_module_re=.*train_step.*").strip()
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  from infir2_jax.bench import tools as benchtools
  from infir2_jax.config import load_config
  from infir2_jax.precision import hlo_fp8_gemm_count
  from infir2_jax.train.trainer import train

  os.makedirs(args.out, exist_ok=True)
  summary = {**benchtools.run_info(sys.argv), "runs": []}
  for variant in args.variants.split(","):
    recipe, backend = variant.split(":")
    workdir = os.path.join("/tmp", f"infir2_default_{recipe}_{backend}")
    shutil.rmtree(workdir, ignore_errors=True)
    before = set(glob.glob(os.path.join(dump, "*after_optimizations.txt")))
    cfg = load_config("", [f"steps={args.steps}", f"precision.recipe={recipe}",
                           f"precision.backend={backend}", "checkpoint.every_steps=0",
                           f"eval.every_steps={args.steps}", "eval.batches=4",
                           "log.progress_bar=False", "log.tensorboard=False", *args.override])
    t0 = time.perf_counter()
    last = train(cfg, workdir)
    wall = time.perf_counter() - t0
    hlo = "".join(open(f).read() for f in
                  sorted(set(glob.glob(os.path.join(dump, "*after_optimizations.txt"))) - before))
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      lines = [json.loads(l) for l in f]
    shutil.copy(os.path.join(workdir, "metrics.jsonl"),
                os.path.join(args.out, f"metrics_{recipe}_{backend}.jsonl"))
    times = sorted(m["step_time_s"] for m in lines if "step_time_s" in m)
    summary["runs"].append({
        "recipe": recipe, "backend": backend, "wall_s": wall,
        "losses": [m["loss"] for m in lines if "loss" in m],
        "eval_losses": {m["step"]: m["eval_loss"] for m in lines if "eval_loss" in m},
        "median_step_s": times[len(times) // 2] if times else None,
        **{f"hlo_{k}": v for k, v in hlo_fp8_gemm_count(hlo).items()},
        "hlo_mosaic_gpu_calls": len(re.findall(r'custom_call_target="mosaic_gpu', hlo)),
        "final": last})
    print(json.dumps({k: v for k, v in summary["runs"][-1].items() if k != "losses"}),
          flush=True)
    with open(os.path.join(args.out, "default_model_gpu.json"), "w") as f:  # after every run
      json.dump(summary, f, indent=1)
  print(f"{'recipe':16} {'backend':7} {'ms/step':>8} {'loss@end':>9} {'eval@end':>9} "
        f"{'$f8':>4} {'mosaic':>6}")
  for r in summary["runs"]:
    ms = 1e3 * r["median_step_s"] if r["median_step_s"] else float("nan")
    ev = list(r["eval_losses"].values())[-1]
    print(f"{r['recipe']:16} {r['backend']:7} {ms:8.1f} {r['losses'][-1]:9.4f} {ev:9.4f} "
          f"{r['hlo_cublaslt_f8']:>4} {r['hlo_mosaic_gpu_calls']:>6}")



if __name__ == "__main__":
  main()
