"""Continuing a run with more steps (issue 37): the lr goes on where the run left it.

The tiny run: 8 steps, wsd, warm-up 2, decay_fraction 0.25 -> steps 1-7 at warm-up/stable
lr, the decay over steps 8-9 (step 8 trains at the midpoint, step 9 on at the final lr).
Its checkpoints: every 2 steps, keep 1; checkpoint 6, the last before the decay, is kept
beyond checkpoint.keep: [6, 8].
"""

import json
import os
import shutil

import pytest

from infir2_jax.config import TrainConfig, apply_overrides, default_config
from infir2_jax.train import continuation, rundir
from infir2_jax.train.optim import make_schedule, stable_end
from infir2_jax.train.trainer import train

LR, FINAL = 3e-3, 3e-4   # opt.lr and lr * opt.min_lr_ratio


def tiny_config(**overrides):
  c = default_config()
  c.steps, c.batch_size, c.seq_len = 8, 8, 64
  c.model.hidden_size, c.model.intermediate_size = 128, 256
  c.model.num_layers, c.model.num_heads, c.model.num_kv_heads = 2, 2, 1
  c.opt.warmup_steps, c.opt.decay_fraction = 2, 0.25
  c.checkpoint.every_steps, c.checkpoint.keep = 2, 1
  c.eval.every_steps = 0
  c.log.progress_bar = c.log.tensorboard = False
  return TrainConfig.from_config_dict(apply_overrides(c, overrides))


def lrs(workdir) -> dict[int, float]:
  rows = [json.loads(line) for line in open(os.path.join(workdir, rundir.METRICS_FILE))]
  return {r["step"]: r["lr"] for r in rows if "lr" in r}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("finished") / "run")
  train(tiny_config(), workdir)
  return workdir


def _copy(run, tmp_path, name="run"):
  target = str(tmp_path / name)
  shutil.copytree(run, target, ignore=shutil.ignore_patterns(".lock"))
  return target


def test_the_run_keeps_its_last_checkpoint_before_the_decay(finished):
  assert stable_end(tiny_config().opt, 8) == 7
  assert rundir.checkpoint_steps(finished) == [6, 8]   # keep=1, and 6 for a rewind
  got = lrs(finished)
  assert got[7] == pytest.approx(LR) and FINAL < got[8] < LR


def test_more_steps_after_the_decay_go_on_at_the_final_lr(finished, tmp_path, capsys):
  """Before the fix the 12-step schedule was recomputed: step 9 trained at the stable lr
  again (3e-3 after 1.65e-3 at step 8)."""
  run = _copy(finished, tmp_path)
  train(tiny_config(steps=12), run)
  out = capsys.readouterr().out
  got, before = lrs(run), lrs(finished)
  assert [got[s] for s in range(1, 9)] == [before[s] for s in range(1, 9)]
  old_schedule = make_schedule(tiny_config().opt, 8)
  for step in range(9, 13):   # what the run's own schedule gives these steps: its final lr
    assert got[step] == pytest.approx(float(old_schedule(step - 1))) == pytest.approx(FINAL)
  assert ("schedule: the run's decay began after step 7: it stays where it was (steps 8-8); "
          "steps 9-12 train at the final lr 0.0003") in out
  assert "warning: the learning rate jumps" not in out
  assert rundir.config_dict(run)["opt"]["schedule_steps"] == 8
  # Killed and re-run with the same command: the same schedule again.
  assert "goes on at the final lr 0.0003" in out


def test_a_second_resume_of_the_continued_run_keeps_its_schedule(finished, tmp_path):
  run = _copy(finished, tmp_path)
  train(tiny_config(steps=12, **{"checkpoint.keep": 2}), run)
  shutil.rmtree(rundir.step_dir(run, 12))       # as if killed after its step-10 checkpoint
  train(tiny_config(steps=12, **{"checkpoint.keep": 2}), run)
  assert [lrs(run)[s] for s in (11, 12)] == pytest.approx([FINAL, FINAL])


def test_more_steps_in_the_stable_phase_move_the_decay_to_the_new_end(finished, tmp_path,
                                                                        capsys):
  run = _copy(finished, tmp_path)
  shutil.rmtree(rundir.step_dir(run, 8))   # as if stopped after its step-6 checkpoint
  train(tiny_config(steps=16), run)
  out = capsys.readouterr().out
  got = lrs(run)
  assert got[7] == got[6] == pytest.approx(LR)
  assert stable_end(tiny_config(steps=16).opt, 16) == 13
  assert [got[s] for s in range(7, 14)] == pytest.approx([LR] * 7)
  assert got[14] < LR and got[16] < got[15] < got[14]
  assert "the decay moves to the new end, steps 14-16" in out


def test_rewind_to_stable_restarts_before_the_decay_and_decays_at_the_new_end(finished,
                                                                               tmp_path, capsys):
  run = _copy(finished, tmp_path)
  train(tiny_config(steps=16, **{"opt.rewind_to_stable": True}), run)
  out = capsys.readouterr().out
  got, before = lrs(run), lrs(finished)
  assert "restarting from checkpoint 6, the last before the decay" in out
  assert os.path.isdir(os.path.join(run, rundir.REWOUND_DIR, "8"))
  assert [got[s] for s in range(1, 7)] == [before[s] for s in range(1, 7)]
  assert [got[s] for s in range(7, 14)] == pytest.approx([LR] * 7)   # stable again
  assert got[16] < got[15] < got[14] < LR
  superseded = [json.loads(line)["step"] for line in
                open(os.path.join(run, rundir.SUPERSEDED_METRICS_FILE))]
  assert 8 in superseded


def test_a_deliberate_lr_change_on_resume_is_warned_about(finished, tmp_path):
  plan = continuation.plan(tiny_config(steps=12, **{"opt.lr": 0.1}), _copy(finished, tmp_path))
  assert any(n.startswith("warning: the learning rate jumps at step 9: the run's schedule "
                          "gives 0.0003 there") for n in plan.notes), plan.notes


def test_a_new_run_or_an_unchanged_schedule_is_left_alone(finished, tmp_path):
  cfg = tiny_config()
  assert continuation.plan(cfg, str(tmp_path / "new")) == continuation.Plan(cfg)
  assert continuation.plan(cfg, finished) == continuation.Plan(cfg)
