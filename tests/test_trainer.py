"""Trainer end to end on the embedded data: metrics, checkpoints, resume, NaN stop, CLI errors."""

import json
import os
import subprocess
import sys

import pytest

from infir2_jax.train import checkpoint as checkpoint_lib
from infir2_jax.config import TrainConfig, apply_overrides, check_override_flags, default_config
from infir2_jax.train.trainer import NonFiniteLossError, train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_config(**overrides):
  c = default_config()
  c.steps = 8
  c.batch_size = 8
  c.seq_len = 64
  c.model.hidden_size = 128
  c.model.intermediate_size = 256
  c.model.num_layers = 2
  c.model.num_heads = 2
  c.model.num_kv_heads = 1
  c.opt.warmup_steps = 2
  c.checkpoint.every_steps = 4
  c.eval.every_steps = 4
  c.eval.batches = 2
  c.log.progress_bar = False
  return TrainConfig.from_config_dict(apply_overrides(c, overrides))


def read_metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def train_losses(workdir):
  """step -> loss of the LAST time that step was logged (a resumed run re-logs nothing)."""
  return {m["step"]: m["loss"] for m in read_metrics(workdir) if "loss" in m}


def test_train_writes_metrics_checkpoints_and_events(tmp_path):
  workdir = str(tmp_path)
  last = train(tiny_config(), workdir)
  metrics = read_metrics(workdir)
  steps = [m["step"] for m in metrics if "loss" in m]
  assert steps == list(range(1, 9))
  evals = [m for m in metrics if "eval_loss" in m]
  assert [m["step"] for m in evals] == [0, 4, 8]
  assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]  # it learns something in 8 steps
  assert all(k in metrics[-1] or k in metrics[-2] for k in ("lr", "grad_norm"))
  assert any("tokens_per_s" in m and "step_time_s" in m for m in metrics)
  assert last["eval_loss"] == evals[-1]["eval_loss"]
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["4", "8"]
  assert any(f.startswith("events.out.tfevents") for f in os.listdir(os.path.join(workdir, "tb")))
  with open(os.path.join(workdir, "config.json")) as f:
    assert json.load(f)["steps"] == 8


class _Killed(Exception):
  pass


def test_resume_after_interruption_is_bit_identical(tmp_path, monkeypatch):
  """A run stopped right after its step-4 checkpoint, re-run with the same command, continues
  exactly: the losses of steps 5-8 equal the uninterrupted run's bit for bit (CPU)."""
  full = str(tmp_path / "full")
  train(tiny_config(**{"eval.every_steps": 0}), full)

  resumed = str(tmp_path / "resumed")
  _train_until_killed_after(4, tiny_config(**{"eval.every_steps": 0}), resumed, monkeypatch)
  assert max(train_losses(resumed)) == 4
  train(tiny_config(**{"eval.every_steps": 0}), resumed)

  expected, got = train_losses(full), train_losses(resumed)
  assert sorted(got) == list(range(1, 9))
  for step in range(1, 9):
    assert got[step] == expected[step], (step, got[step], expected[step])


def _train_until_killed_after(step, cfg, workdir, monkeypatch):
  """Runs `cfg` in `workdir` and stops it right after its checkpoint at `step`."""
  save = checkpoint_lib.Checkpointer.save

  def save_then_die(self, at, state, data_iterator):
    save(self, at, state, data_iterator)
    if at == step:
      self.wait()
      raise _Killed()

  monkeypatch.setattr(checkpoint_lib.Checkpointer, "save", save_then_die)
  with pytest.raises(_Killed):
    train(cfg, workdir)
  monkeypatch.setattr(checkpoint_lib.Checkpointer, "save", save)


@pytest.mark.slow
def test_resume_on_another_mesh(tmp_path, monkeypatch):
  """A checkpoint written on one mesh (data 2 x fsdp 2 x tensor 2) resumes on another (data
  8): orbax reshards it into the new layout, and steps 5-8 follow the data-8 run that never
  stopped, to f32 reduction-order differences (a restart would repeat step 1's loss, ~0.5
  higher than step 5's)."""
  plain = {"eval.every_steps": 0}
  full = str(tmp_path / "full")
  train(tiny_config(**plain), full)

  moved = str(tmp_path / "moved")
  _train_until_killed_after(
      4, tiny_config(**plain, **{"mesh.fsdp": 2, "mesh.tensor": 2}), moved, monkeypatch)
  assert max(train_losses(moved)) == 4
  train(tiny_config(**plain), moved)

  expected, got = train_losses(full), train_losses(moved)
  assert sorted(got) == list(range(1, 9))
  assert expected[1] - expected[5] > 0.3  # so a restart could not pass the check below
  for step in range(5, 9):
    assert got[step] == pytest.approx(expected[step], rel=1e-3), (step, got[step], expected[step])


def test_nan_loss_stops_with_the_last_good_checkpoint(tmp_path):
  workdir = str(tmp_path)
  cfg = tiny_config(**{"opt.lr": 1e30, "opt.warmup_steps": 0, "checkpoint.every_steps": 1,
                       "eval.every_steps": 0})
  with pytest.raises(NonFiniteLossError) as error:
    train(cfg, workdir)
  message = str(error.value)
  bad_step = int(message.split(" at step ")[1].split(";")[0])
  saved = sorted(int(s) for s in os.listdir(os.path.join(workdir, "checkpoints")) if s.isdigit())
  assert saved and max(saved) == bad_step - 1, (message, saved)
  assert f"Last good checkpoint: step {bad_step - 1}" in message


def test_unknown_config_key_lists_valid_keys():
  with pytest.raises(ValueError, match="Did you mean 'opt.lr'") as error:
    check_override_flags(["train", "--config.opt.lrr=1"])
  assert "model.hidden_size" in str(error.value)
  check_override_flags(["train", "--config.opt.lr=1", "--workdir=x"])
  bad = default_config()
  bad.unlock()
  bad.opt.momentum = 0.9
  with pytest.raises(ValueError, match="opt.momentum"):
    TrainConfig.from_config_dict(bad)


def test_cli_rejects_unknown_key_and_reports_it():
  result = subprocess.run(
      [sys.executable, "-m", "infir2_jax.train", "--config.modle.hidden_size=3"],
      cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert result.returncode != 0
  assert "Unknown config key 'modle.hidden_size'" in result.stderr
  assert "model.hidden_size" in result.stderr


def test_init_from_another_run_starts_from_its_weights(tmp_path, monkeypatch):
  """init.from_run loads the other run's final float32 params: the new run's step-0 eval
  loss equals the old run's final eval loss (workdirs given relative, as on a command line)."""
  monkeypatch.chdir(tmp_path)
  last = train(tiny_config(**{"steps": 4}), "first")
  second = str(tmp_path / "second")
  # 4 steps, as the first run: its compiled train step is reused; step 0's eval is compared.
  train(tiny_config(**{"steps": 4, "init.from_run": "first"}), second)
  step0 = [m for m in read_metrics(second) if "eval_loss" in m and m["step"] == 0]
  assert step0 and abs(step0[0]["eval_loss"] - last["eval_loss"]) < 1e-6


@pytest.mark.slow
def test_fp8_run_logs_telemetry_on_its_interval(tmp_path):
  workdir = str(tmp_path)
  train(tiny_config(**{"steps": 4, "seq_len": 128, "precision.recipe": "infir2",
                       "precision.telemetry_every_steps": 2, "eval.every_steps": 0}), workdir)
  lines = {m["step"]: m for m in read_metrics(workdir) if "loss" in m}
  key = "fp8/layers_1/mlp/down_proj/wgrad/dy/snr_db"
  assert key in lines[2] and key in lines[4] and key not in lines[1] and key not in lines[3]
  # E4M3 with 1x128 tiles: a few tens of dB, never exact, never garbage.
  assert 15 < lines[2][key] < 60
  assert 0 <= lines[2]["fp8/worst/fprop/x/max_flush_frac"] < 0.5


@pytest.mark.parametrize("signal_at", ["last_eval", "last_step"])
def test_stop_signal_as_the_run_ends_completes_it_with_exit_0(tmp_path, monkeypatch, capsys,
                                                             signal_at):
  """SIGTERM during the last step's evaluation (after the loop's last stop check), or
  before that step's stop check: nothing is left to stop. The run completes with its final
  checkpoint, says the signal came as it ended, and returns (exit 0: a scheduler must not
  requeue a finished job). It used to print "saving a checkpoint at the next step boundary"
  and then either exit 0 without a word (fault_injection: "unclear error") or 143."""
  import signal
  from infir2_jax.train import preemption, trainer
  cfg = tiny_config(**{"steps": 4, "checkpoint.every_steps": 100, "eval.every_steps": 4})
  if signal_at == "last_eval":
    evaluate = trainer._Loop.evaluate
    def evaluate_then_signal(self, params):
      out = evaluate(self, params)
      if self.evals_done == 1:   # the step-0 evaluation came first
        os.kill(os.getpid(), signal.SIGTERM)
      self.evals_done += 1
      return out
    monkeypatch.setattr(trainer._Loop, "evals_done", 0, raising=False)
    monkeypatch.setattr(trainer._Loop, "evaluate", evaluate_then_signal)
  else:
    _sigterm_at_stop_check(monkeypatch, 4)
  workdir = str(tmp_path)
  train(cfg, workdir)   # no Preempted (SystemExit 143)
  out = capsys.readouterr().out
  assert f"received SIGTERM {preemption.AFTER_LAST_STEP}: all 4 steps are done" in out, out
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["4"]
  assert max(train_losses(workdir)) == 4


def _sigterm_at_stop_check(monkeypatch, at_step):
  """SIGTERM to this process just before the loop asks whether to stop after `at_step`."""
  import signal
  from infir2_jax.train import preemption
  stop_at = preemption.StopRequests.stop_at
  def stop_at_signal(self, step):
    if step == at_step:
      os.kill(os.getpid(), signal.SIGTERM)
    return stop_at(self, step)
  monkeypatch.setattr(preemption.StopRequests, "stop_at", stop_at_signal)


def test_stop_signal_mid_run_still_stops_with_143(tmp_path, monkeypatch):
  from infir2_jax.train import preemption
  _sigterm_at_stop_check(monkeypatch, 2)
  workdir = str(tmp_path)
  with pytest.raises(preemption.Preempted) as stopped:
    train(tiny_config(**{"steps": 4, "eval.every_steps": 0}), workdir)
  assert stopped.value.code == 143
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["2"]
