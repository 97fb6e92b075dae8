"""User errors on the command line (issue 37): one `error:` line, no traceback, a non-zero
exit; --debug / INFIR2_DEBUG=1 show the traceback; --help succeeds; typos get a suggestion."""

import json
import os
import re
import subprocess
import sys

import pytest

from infir2_jax import errors
from infir2_jax.config import flat_keys, suggest_key

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = ("-m", "infir2_jax.train")


def _env(**extra):
  # One CPU device, as a laptop has: the mesh case needs it, the others do not care.
  env = {k: v for k, v in os.environ.items() if k != errors.DEBUG_ENV}
  return dict(env, XLA_FLAGS="", JAX_PLATFORMS="cpu", INFIR2_COMPILATION_CACHE="", **extra)


def _run_all(commands: dict[str, list[str]], env=None) -> dict[str, subprocess.CompletedProcess]:
  """Runs the commands side by side (each is mostly Python start-up and imports)."""
  procs = {name: subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env or _env(),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for name, args in commands.items()}
  out = {}
  for name, proc in procs.items():
    stdout, stderr = proc.communicate(timeout=300)
    out[name] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
  return out


def test_user_errors_are_one_error_line_without_a_traceback(tmp_path):
  broken = tmp_path / "broken.jsonl"
  broken.write_text("not json\n{\"text\": \"\"}\n")
  run = lambda name: f"--workdir={tmp_path / name}"
  cases = {  # name: (command, what the error line must say)
      "negative lr": ([*TRAIN, "--config.opt.lr=-1", run("a")], "opt.lr=-1.0 is out of range"),
      "unknown recipe": ([*TRAIN, "--config.precision.recipe=fp9", run("b")],
                         "precision.recipe='fp9'; valid: "),
      "unknown variant": ([*TRAIN, "--config=configs/default.py:tiny", run("c")],
                          "unknown variant 'tiny' of configs/default.py; valid: 'smoke'"),
      "missing config file": ([*TRAIN, "--config=configs/nope.py", run("d")],
                              "config file 'configs/nope.py' does not exist"),
      "broken data": ([*TRAIN, f"--config.data.source={broken}", run("e")],
                      f"no usable records in '{broken}'"),
      "mesh on one CPU": ([*TRAIN, "--config.mesh.fsdp=2", run("f")],
                          "XLA_FLAGS=--xla_force_host_platform_device_count=N"),
      "synonym key": ([*TRAIN, "--config.opt.learning_rate=1e-3"],
                      "Did you mean 'opt.lr'?"),
      "generate, no run": (["-m", "infir2_jax.generate", f"--workdir={tmp_path / 'none'}",
                            "--prompt=hi"], "config.json not found"),
      "prepare, no docs": (["-m", "infir2_jax.data.prepare", f"--source={broken}",
                            f"--out={tmp_path / 'prep'}", "--no-progress", "--workers=1"],
                           "yields no documents"),
  }
  results = _run_all({name: command for name, (command, _) in cases.items()})
  for name, (_, says) in cases.items():
    proc = results[name]
    assert proc.returncode == 1, (name, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, (name, proc.stderr[-2000:])
    error_lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(error_lines) == 1 and says in error_lines[0], (name, proc.stderr[-2000:])
  # No run directory holding only a lock file is left behind by a failed start.
  assert not any((tmp_path / name).exists() for name in "abcdef")


def test_debug_flag_and_env_show_the_traceback(tmp_path):
  results = _run_all({
      "flag": [*TRAIN, "--config.opt.lr=-1", "--debug", f"--workdir={tmp_path}/a"]})
  results.update(_run_all({"env": [*TRAIN, "--config.opt.lr=-1", f"--workdir={tmp_path}/b"]},
                          env=_env(**{errors.DEBUG_ENV: "1"})))
  for name, proc in results.items():
    assert proc.returncode == 1, name
    assert "Traceback" in proc.stderr and "ConfigError: opt.lr=-1.0" in proc.stderr, name


def test_help_exits_0_and_names_the_recipes_and_the_debug_flag():
  proc = subprocess.run([sys.executable, *TRAIN, "--help"], cwd=ROOT, env=_env(),
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  from infir2_jax.precision import recipes
  listed = re.search(r"^Precision recipes \(.*?\): (.*?)\n\n", proc.stdout, re.M | re.S)
  assert listed, proc.stdout[-3000:]
  assert listed.group(1).split() == [f"{n}," for n in recipes.recipe_names()[:-1]] + [
      recipes.recipe_names()[-1]]
  assert "--[no]debug: Show the traceback of a user error" in proc.stdout


@pytest.mark.parametrize("typo, meant", [
    ("opt.learning_rate", "opt.lr"), ("learning_rate", "opt.lr"), ("opt.lrr", "opt.lr"),
    ("max_steps", "steps"), ("model.num_hidden_layers", "model.num_layers"),
    ("hidden_size", "model.hidden_size"), ("eval_steps", "eval.every_steps"),
    ("modle.hidden_size", "model.hidden_size"), ("opt.beta2", "opt.b2")])
def test_did_you_mean_knows_synonyms_and_sections(typo, meant):
  assert suggest_key(typo, flat_keys()) == meant


def test_user_error_types_are_still_the_builtin_ones():
  """Callers that caught ValueError / FileNotFoundError before still do."""
  assert issubclass(errors.ConfigError, ValueError)
  assert issubclass(errors.DataError, ValueError)
  assert issubclass(errors.NotFound, FileNotFoundError)
  json.dumps(str(errors.NotFound("x")))
