"""What researchers reach for (issue 37 item 4): a profiler switch, W&B / MLflow logging when
the package is there, perplexity beside the loss."""

import glob
import gzip
import json
import math
import os
import sys
import types

import pytest

from infir2_jax.config import TrainConfig, apply_overrides, default_config
from infir2_jax.train import rundir
from infir2_jax.train.trainer import train


def tiny_config(**overrides):
  c = default_config()
  c.steps, c.batch_size, c.seq_len = 2, 8, 64
  c.model.hidden_size, c.model.intermediate_size = 128, 256
  c.model.num_layers, c.model.num_heads, c.model.num_kv_heads = 2, 2, 1
  c.opt.warmup_steps = 1
  c.checkpoint.every_steps = 2
  c.eval.every_steps, c.eval.batches = 2, 1
  c.log.progress_bar = False
  return TrainConfig.from_config_dict(apply_overrides(c, overrides))


def rows(workdir):
  return [json.loads(line) for line in open(os.path.join(workdir, rundir.METRICS_FILE))]


def test_profile_traces_the_chosen_step_into_the_run_directory(tmp_path, capsys):
  workdir = str(tmp_path / "run")
  train(tiny_config(steps=3, **{"profile.start_step": 2, "profile.steps": 1}), workdir)
  assert f"profile: steps 2-2 traced to {workdir}/profile" in capsys.readouterr().out
  (trace,) = glob.glob(os.path.join(workdir, rundir.PROFILE_DIR, "plugins", "profile", "*",
                                    "*.trace.json.gz"))
  assert glob.glob(os.path.join(os.path.dirname(trace), "*.xplane.pb"))
  events = json.loads(gzip.decompress(open(trace, "rb").read()))["traceEvents"]
  names = {e.get("name", "") for e in events}
  assert any("train_step" in n for n in names), sorted(names)[:50]   # the step ran in it


class _Recorder(types.ModuleType):
  """A stand-in tracker package: records every call as (name, args, kwargs)."""

  def __init__(self, name, **returns):
    super().__init__(name)
    self.calls, self._returns = [], returns

  def __getattr__(self, attr):
    if attr.startswith("_"):
      raise AttributeError(attr)

    def call(*args, **kwargs):
      self.calls.append((attr, args, kwargs))
      return self._returns.get(attr)
    return call

  def named(self, attr):
    return [(args, kwargs) for name, args, kwargs in self.calls if name == attr]


def _fakes(monkeypatch):
  run = types.SimpleNamespace(id="wb-1", info=types.SimpleNamespace(run_id="ml-1"))
  wandb = _Recorder("wandb", init=run)
  mlflow = _Recorder("mlflow", start_run=run)
  monkeypatch.setitem(sys.modules, "wandb", wandb)
  monkeypatch.setitem(sys.modules, "mlflow", mlflow)
  return wandb, mlflow


def test_wandb_and_mlflow_get_every_row_and_the_config(tmp_path, monkeypatch):
  wandb, mlflow = _fakes(monkeypatch)
  workdir = str(tmp_path / "run")
  cfg = tiny_config(**{"log.wandb": True, "log.mlflow": True, "log.project": "p37"})
  train(cfg, workdir)
  ((_, init),) = wandb.named("init")
  assert init["project"] == "p37" and init["name"] == "run" and init["id"] is None
  assert init["config"]["opt"]["lr"] == cfg.opt.lr and init["resume"] == "allow"
  logged = [(kw["step"], args[0]) for args, kw in wandb.named("log")]
  assert [step for step, _ in logged] == [0, 1, 2, 2]   # eval 0, steps 1 and 2, eval 2
  on_disk = rows(workdir)
  assert [set(m) for _, m in logged] == [{k for k, v in r.items() if k != "step"
                                          and isinstance(v, (int, float))} for r in on_disk]
  assert len(wandb.named("finish")) == 1
  assert mlflow.named("set_experiment") == [(("p37",), {})]
  ((_, start),) = mlflow.named("start_run")
  assert start == {"run_id": None, "run_name": "run"}
  ((params,), _), = mlflow.named("log_params")
  assert params["opt.lr"] == str(cfg.opt.lr) and params["steps"] == "2"
  assert [kw["step"] for _, kw in mlflow.named("log_metrics")] == [0, 1, 2, 2]
  assert len(mlflow.named("end_run")) == 1
  assert rundir.read_json(os.path.join(workdir, rundir.TRACKERS_FILE)) == {
      "wandb": "wb-1", "mlflow": "ml-1"}

  # A resumed run logs to the same tracker runs, and MLflow's params are not rewritten.
  wandb.calls.clear(), mlflow.calls.clear()
  train(tiny_config(steps=3, **{"log.wandb": True, "log.mlflow": True,
                                "log.project": "p37"}), workdir)
  assert wandb.named("init")[0][1]["id"] == "wb-1"
  assert mlflow.named("start_run")[0][1]["run_id"] == "ml-1"
  assert not mlflow.named("log_params")


def test_perplexity_is_logged_beside_the_loss(tmp_path):
  workdir = str(tmp_path / "run")
  train(tiny_config(), workdir)
  records = rows(workdir)
  train_rows = [r for r in records if "loss" in r]
  eval_rows = [r for r in records if "eval_loss" in r]
  assert train_rows and eval_rows
  for r in train_rows:
    assert r["perplexity"] == pytest.approx(math.exp(r["loss"]), rel=1e-12)
  for r in eval_rows:
    assert r["eval_perplexity"] == pytest.approx(math.exp(r["eval_loss"]), rel=1e-12)


def test_a_tracker_asked_for_without_its_package_stops_before_any_work(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "mlflow", None)   # `import mlflow` raises ImportError
  with pytest.raises(ValueError, match=r"log.mlflow=True but the 'mlflow' package is not "
                     r"installed: `pip install mlflow`"):
    train(tiny_config(**{"log.mlflow": True}), str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()
