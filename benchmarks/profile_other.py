"""The train step's kernels op by op: each one's device time (from a benchmarks/train_step.py
profile) against the bytes it moves (from the same variant's compiled HLO, --hlo_dir), so the
attainable time of the elementwise rest ("other") is known.

  python benchmarks/profile_other.py --step=benchmarks/results/train_step_X.json \
      --hlo_dir=DIR [--label=infir2] [--top=40] [--out=benchmarks/results/other_X.json]

Per kernel: calls, ms, bytes per call (infir2_jax.bench.hlo_bytes), achieved TB/s and the
time it would take at the card's bandwidth (4.8 TB/s, the H200's HBM3e figure), and what
it computes (the HLO metadata's op_name: the JAX op and the module path it came from).
Kernels are grouped by the model part their op_name names (norms, RoPE, SwiGLU, loss, the
optimizer update, ...).
"""
import argparse
import gzip
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from infir2_jax.bench.hlo_bytes import instruction_bytes, kernel_name  # noqa: E402
from infir2_jax.bench.profile import kernel_kind  # noqa: E402

HBM_TBPS = 4.8
# (group, pattern on the op_name), first match wins
GROUPS = [
    ("optimizer update", r"adam|optimizer|apply_updates|scale_by|global_norm|/update|clip"),
    ("loss and logits", r"logsumexp|log_softmax|take_along_axis|cross_entropy|loss|lm_head"),
    ("norms", r"layernorm|rsqrt|norm/|RMSNorm|/norm\b"),
    ("RoPE", r"rope|\bcos\b|\bsin\b|rotate"),
    ("SwiGLU", r"swiglu|logistic|silu|mlp"),
    ("attention glue", r"self_attn|attention|segment|packed"),
    ("embedding", r"embed"),
    ("layer stacking (scan)", r"while|scan|stack|dynamic_update_slice|dynamic_slice"),
]


def op_names(hlo_text: str) -> dict[str, str]:
  """{kernel name: the op_name metadata of the instruction}."""
  out = {}
  for line in hlo_text.splitlines():
    m = re.match(r"^\s*(?:ROOT\s+)?%([\w.\-]+) = .*?op_name=\"([^\"]*)\"", line)
    if m:
      out[kernel_name(m.group(1))] = m.group(2)
  return out


def group_of(name: str, op_name: str, type_text: str = "") -> str:
  """The model part a kernel belongs to: first by what it writes (the AdamW update writes
  param, mu and nu: three equal float32 arrays; the loss writes [rows, length, vocab]
  arrays), then by its op_name."""
  shapes = re.findall(r"(\w+\[[\d,]*\])", type_text)
  if len(shapes) >= 3 and len(set(shapes)) == 1 and shapes[0].startswith("f32"):
    return "optimizer update"
  if any(len(dims.split(",")) == 3 and int(dims.split(",")[-1]) >= 32768
         for dims in re.findall(r"\[([\d,]+)\]", type_text)):
    return "loss and logits"
  text = f"{op_name} {name}"
  for group, pattern in GROUPS:
    if re.search(pattern, text, re.I):
      return group
  if "memcpy" in name or name.startswith("copy"):
    return "copies"
  return "rest"


def _match(kernel: str, table: dict):
  """The HLO entry of a profiled kernel name (profilers may add suffixes)."""
  if kernel in table:
    return table[kernel]
  base = re.sub(r"(_kernel)?(_\d+)?$", "", kernel)
  return table.get(base)


def analyze(variant: dict, hlo_text: str, top: int) -> dict:
  profile = variant["profile"]
  sizes, names = instruction_bytes(hlo_text), op_names(hlo_text)
  rows = []
  for kernel, (ms, calls) in profile["kernels_ms"].items():
    kind = kernel_kind(kernel)
    entry = _match(kernel, sizes)
    per_call = entry["bytes"] if entry else None
    op_name = names.get(kernel) or (names.get(re.sub(r"(_\d+)?$", "", kernel)) or "")
    row = {"kernel": kernel, "kind": kind, "calls": calls, "ms": ms,
           "bytes_per_call": per_call, "op_name": op_name[-160:],
           "group": (group_of(kernel, op_name, entry["type"] if entry else "")
                     if kind == "other" else kind)}
    if per_call:
      total = per_call * calls
      row["gb"] = total / 1e9
      row["tbps"] = total / (ms * 1e-3) / 1e12 if ms else None
      row["attainable_ms"] = total / (HBM_TBPS * 1e12) * 1e3
    rows.append(row)
  rows.sort(key=lambda r: -r["ms"])
  other = [r for r in rows if r["kind"] == "other"]
  groups = {}
  for r in other:
    g = groups.setdefault(r["group"], {"ms": 0.0, "attainable_ms": 0.0, "kernels": 0,
                                       "unsized_ms": 0.0})
    g["ms"] += r["ms"]
    g["kernels"] += 1
    if r.get("attainable_ms") is not None:
      g["attainable_ms"] += r["attainable_ms"]
    else:
      g["unsized_ms"] += r["ms"]
  return {"label": variant["label"], "seq_len": variant["seq_len"],
          "step_ms": 1e3 * variant["median_step_s"],
          "other_ms": sum(r["ms"] for r in other),
          "other_attainable_ms": sum(r.get("attainable_ms") or 0 for r in other),
          "other_unsized_ms": sum(r["ms"] for r in other if r.get("attainable_ms") is None),
          "groups": dict(sorted(groups.items(), key=lambda kv: -kv[1]["ms"])),
          "top_other": other[:top]}


def main(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--step", required=True, help="a benchmarks/train_step.py results JSON")
  p.add_argument("--hlo_dir", required=True)
  p.add_argument("--label", default="", help="only this variant (default: every profiled one)")
  p.add_argument("--top", type=int, default=40)
  p.add_argument("--out", default="")
  args = p.parse_args(argv)
  with open(args.step) as f:
    step = json.load(f)
  results = []
  for v in step["variants"]:
    if "profile" not in v or (args.label and v["label"] != args.label):
      continue
    tag = "".join(c if c.isalnum() or c in "._-" else "_" for c in v["label"])
    path = os.path.join(args.hlo_dir, f"hlo_{tag}_{v['seq_len']}.txt.gz")
    if not os.path.exists(path):
      print(f"{v['label']}: no HLO at {path}", file=sys.stderr)
      continue
    with gzip.open(path, "rt") as f:
      result = analyze(v, f.read(), args.top)
    results.append(result)
    print(f"\n{result['label']} @ {result['seq_len']}: step {result['step_ms']:.1f} ms, other "
          f"{result['other_ms']:.1f} ms, attainable at {HBM_TBPS} TB/s "
          f"{result['other_attainable_ms']:.1f} ms (+{result['other_unsized_ms']:.1f} ms unsized)")
    for g, e in result["groups"].items():
      print(f"  {g:24s} {e['ms']:7.1f} ms  attainable {e['attainable_ms']:6.1f} ms  "
            f"({e['kernels']} kernels)")
    for r in result["top_other"][:args.top]:
      print(f"  {r['ms']:7.2f} ms {r['calls']:4d}x {r.get('gb', 0):7.2f} GB "
            f"{r.get('tbps') or 0:5.2f} TB/s  {r['group']:18s} {r['kernel'][:44]:44s} "
            f"{r['op_name'][-70:]}")
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"source": args.step, "command": " ".join(["python", *sys.argv]),
                 "hbm_tbps": HBM_TBPS, "variants": results}, f, indent=1)


if __name__ == "__main__":
  main(sys.argv[1:])
