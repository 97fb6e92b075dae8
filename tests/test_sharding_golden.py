"""Golden PartitionSpecs of the real train states (params AND Adam moments), from eval_shape.

Regenerate after an intended change of the rules or the model's logical axes:
  python tests/test_sharding_golden.py          # rewrites tests/golden/sharding_*.json
and review the diff. Identical decoder layers are stored once, as "layers_*".
"""

import functools
import dataclasses
import importlib.util
import json
import os
import re
import sys

if __name__ == "__main__":  # the same 8 fake devices as tests/conftest.py
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import pytest  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN_DIR = os.path.join(ROOT, "tests", "golden")
# name -> (config file, mesh sizes (data, fsdp, tensor)) on 8 devices.
CASES = {
    "1p5b_fsdp4_tensor2": ("1p5b", (1, 4, 2)),
    "1p5b_fsdp2_tensor4": ("1p5b", (1, 2, 4)),   # 2 KV heads < tensor 4: replicated
    "7b_fsdp2_tensor4": ("7b", (1, 2, 4)),
    "7b_fsdp8": ("7b", (1, 8, 1)),
}


def load_config(name: str):
  from infir2_jax.config import TrainConfig
  spec = importlib.util.spec_from_file_location(f"cfg_{name}",
                                                os.path.join(ROOT, "configs", f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return TrainConfig.from_config_dict(module.get_config())


def merge_layers(table: dict) -> dict:
  """Collapses layers_0..layers_{n-1} entries into one "layers_*" entry when all agree."""
  groups: dict[str, list] = {}
  for path, entry in table.items():
    groups.setdefault(re.sub(r"(^|/)layers_\d+/", r"\1layers_*/", path), []).append(entry)
  out = {}
  for path, entries in groups.items():
    if "layers_*" in path and any(e != entries[0] for e in entries):
      raise AssertionError(f"decoder layers differ at {path}: {entries}")
    out[path] = dict(entries[0], count=len(entries)) if "layers_*" in path else entries[0]
  return out


def state_table(case: str) -> dict:
  """JSON-able {"mesh", "rules", "state": {path: {spec, shape, dtype}}} of a case."""
  from infir2_jax import parallel
  from infir2_jax.precision import PrecisionConfig
  from infir2_jax.train.optim import make_optimizer
  from infir2_jax.model import init_params
  from infir2_jax.train.trainer import build_model
  config_name, sizes = CASES[case]
  # The recipe does not change the state; bf16 traces the 28-layer init much faster.
  cfg = dataclasses.replace(load_config(config_name), precision=PrecisionConfig())
  mesh_cfg = parallel.MeshConfig(*sizes)
  mesh = parallel.make_mesh(mesh_cfg, jax.devices()[:8])
  rules = parallel.logical_rules(mesh_cfg, cfg.model, mesh)
  model = build_model(cfg)
  structs, shardings = parallel.abstract_state(
      functools.partial(init_params, model), make_optimizer(cfg.opt, cfg.steps), mesh, rules)
  return {"config": f"configs/{config_name}.py", "mesh": dict(mesh.shape),
          "rules": [[name, list(a) if isinstance(a, tuple) else a] for name, a in rules],
          "state": merge_layers(parallel.spec_table(shardings, structs))}


def golden_path(case: str) -> str:
  return os.path.join(GOLDEN_DIR, f"sharding_{case}.json")


@pytest.mark.parametrize("case", sorted(CASES))
def test_state_partition_specs_match_golden(case):
  with open(golden_path(case)) as f:
    golden = json.load(f)
  table = json.loads(json.dumps(state_table(case)))  # tuples -> lists, as stored
  assert table["mesh"] == golden["mesh"]
  assert table["rules"] == golden["rules"]
  got, want = table["state"], golden["state"]
  assert sorted(got) == sorted(want), (sorted(set(got) ^ set(want)))
  wrong = {p: (got[p], want[p]) for p in want if got[p] != want[p]}
  assert not wrong, f"{len(wrong)} specs changed (got, golden): {dict(list(wrong.items())[:5])}"


def test_kv_heads_replicated_when_tensor_degree_exceeds_them():
  state = json.load(open(golden_path("1p5b_fsdp2_tensor4")))["state"]
  assert state["params/layers_*/self_attn/k_proj/kernel"]["spec"] == ["fsdp", None]
  assert state["params/layers_*/self_attn/q_proj/kernel"]["spec"] == ["fsdp", "tensor"]


def test_adam_moments_and_masters_are_float32_and_sharded_like_params():
  state = json.load(open(golden_path("7b_fsdp2_tensor4")))["state"]
  params = {p[len("params/"):]: e for p, e in state.items() if p.startswith("params/")}
  assert params["layers_*/mlp/down_proj/kernel"]["spec"] == ["tensor", "fsdp"]
  assert params["layers_*/self_attn/k_proj/kernel"]["spec"] == ["fsdp", "tensor"]
  for moment in ("mu", "nu"):
    moments = {p.split(f"/{moment}/", 1)[1]: e for p, e in state.items() if f"/{moment}/" in p}
    assert moments.keys() == params.keys()
    for path, entry in params.items():
      assert entry["dtype"] == moments[path]["dtype"] == "float32"
      assert entry["spec"] == moments[path]["spec"], path


def dumps(table: dict) -> str:
  """JSON with one state entry per line, for readable diffs."""
  head = [f" {json.dumps(k)}: {json.dumps(v)}" for k, v in table.items() if k != "state"]
  lines = [f"  {json.dumps(k)}: {json.dumps(v, sort_keys=True)}"
           for k, v in sorted(table["state"].items())]
  return "{\n" + ",\n".join(head) + ',\n "state": {\n' + ",\n".join(lines) + "\n }\n}\n"


def main():
  os.makedirs(GOLDEN_DIR, exist_ok=True)
  for case in sorted(CASES):
    text = dumps(state_table(case))
    assert json.loads(text)  # round-trips
    with open(golden_path(case), "w") as f:
      f.write(text)
    print(f"wrote {golden_path(case)}")


if __name__ == "__main__":
  sys.path.insert(0, ROOT)
  main()
