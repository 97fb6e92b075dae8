"""`python -m infir2_jax.generate`: a run's checkpoint or an HF directory, prompts as flags."""

import json
import os
import subprocess
import sys

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

from infir2_jax import export
from infir2_jax.config import CheckpointConfig, TrainConfig
from infir2_jax.data import load_tokenizer, special_ids
from infir2_jax.inference.generate import generate_text
from infir2_jax.model import ModelConfig, Qwen2, init_params
from infir2_jax.train import rundir
from infir2_jax.train.checkpoint import Checkpointer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ModelConfig(hidden_size=128, intermediate_size=256, num_layers=2, num_heads=2,
                    num_kv_heads=1)
PROMPTS = ["ROMEO:", "To be, or not to be"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """A run directory as the trainer leaves it, with random weights (larger than init's, so
  greedy decoding is not one token repeated)."""
  workdir = str(tmp_path_factory.mktemp("run"))
  rundir.write_config(workdir, TrainConfig(model=MODEL))
  params = jax.tree.map(lambda p: p * 20.0 if p.ndim == 2 else p,
                        nn.unbox(init_params(Qwen2(MODEL), jax.random.key(1))))
  state = {"step": np.int32(3), "params": params, "opt_state": optax.adamw(1e-3).init(params)}
  ckpt = Checkpointer(workdir, CheckpointConfig(async_save=False))
  ckpt.save(3, state, None)
  ckpt.close()
  return workdir, params


def cli(*args, env=None):
  proc = subprocess.run([sys.executable, "-m", "infir2_jax.generate", *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=300,
                        env=dict(os.environ, XLA_FLAGS="", **(env or {})))
  return proc


@pytest.mark.slow
def test_generates_what_the_library_generates(run, tmp_path):
  workdir, params = run
  cache = tmp_path / "jax_cache"
  proc = cli(f"--workdir={workdir}", *[f"--prompt={p}" for p in PROMPTS], "--max_new_tokens=12",
             "--json", env={"INFIR2_COMPILATION_CACHE": str(cache)})
  assert proc.returncode == 0, proc.stderr[-3000:]
  got = [json.loads(line) for line in proc.stdout.splitlines()]
  tok = load_tokenizer("default")
  special = special_ids(tok)
  expected = generate_text(Qwen2(MODEL), params, tok, PROMPTS, max_new_tokens=12,
                           stop_ids=(special.eos,), pad_id=special.pad)
  assert [g["prompt"] for g in got] == PROMPTS
  assert [g["completion"] for g in got] == expected
  assert len(set(expected[0].split())) > 1   # real text, not one token over and over
  assert cache.is_dir()                      # the entry point switched the cache on

  text = cli(f"--workdir={workdir}", f"--prompt={PROMPTS[0]}", "--max_new_tokens=12")
  assert text.returncode == 0, text.stderr[-3000:]
  assert text.stdout.startswith(f"# {workdir} step 3, text prompts, greedy\n")
  assert f">>> {PROMPTS[0]}\n{expected[0]}\n" in text.stdout


@pytest.mark.slow
def test_generates_from_an_hf_export_and_reads_its_chat_template(run, tmp_path):
  workdir, _ = run
  hf_dir = str(tmp_path / "hf")
  export.export_run(workdir, hf_dir, fp8=True)
  proc = cli(f"--hf={hf_dir}", f"--prompt={PROMPTS[0]}", "--max_new_tokens=8")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.startswith(f"# {hf_dir}, chat prompts, greedy\n")
  assert f">>> {PROMPTS[0]}\n" in proc.stdout
  plain = cli(f"--hf={hf_dir}", "--nochat", f"--prompt={PROMPTS[0]}", "--max_new_tokens=8")
  assert plain.stdout.startswith(f"# {hf_dir}, text prompts, greedy\n")


def test_errors_say_what_is_missing(run):
  workdir, _ = run
  assert "give at least one --prompt" in cli(f"--workdir={workdir}").stderr
  assert "exactly one of --workdir" in cli("--prompt=x").stderr
