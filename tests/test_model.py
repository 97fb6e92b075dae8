"""Qwen2 model: shapes, parameter counts, causality, packed-segment isolation, injection point."""

import dataclasses
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from infir2_jax.model import ModelConfig, Qwen2, init_params

TINY = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                   num_heads=4, num_kv_heads=2, dtype="float32")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def init(cfg, factory=None):
  model = Qwen2(cfg) if factory is None else Qwen2(cfg, factory)
  params = nn.unbox(init_params(model, jax.random.key(0)))
  return model, params


@pytest.mark.parametrize("tie", [True, False])
def test_param_count_matches_config(tie):
  cfg = dataclasses.replace(TINY, tie_embeddings=tie)
  shapes = jax.eval_shape(lambda: Qwen2(cfg).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))
  assert sum(x.size for x in jax.tree.leaves(shapes)) == cfg.num_params()
  assert ("lm_head" in shapes["params"]) != tie


@pytest.mark.parametrize("name,expected", [("1p5b", 1_543_714_304), ("7b", 7_615_616_512)])
def test_real_configs_match_qwen25_parameter_counts(name, expected):
  """Qwen2.5-1.5B has 1.54B parameters (tied), Qwen2.5-7B 7.62B (untied): HF model cards."""
  from infir2_jax.config import load_config
  cfg = load_config(os.path.join(ROOT, "configs", f"{name}.py")).model
  shapes = jax.eval_shape(lambda: Qwen2(cfg).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))
  assert sum(x.size for x in jax.tree.leaves(shapes)) == cfg.num_params() == expected


def test_logits_are_float32_with_bf16_compute():
  cfg = dataclasses.replace(TINY, dtype="bfloat16")
  model, params = init(cfg)
  logits = model.apply({"params": params}, jnp.ones((2, 8), jnp.int32))
  assert logits.shape == (2, 8, cfg.vocab_size) and logits.dtype == jnp.float32
  assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))


def test_causal():
  model, params = init(TINY)
  tokens = jax.random.randint(jax.random.key(1), (1, 16), 0, TINY.vocab_size)
  changed = tokens.at[0, 10].set((tokens[0, 10] + 1) % TINY.vocab_size)
  a = model.apply({"params": params}, tokens)
  b = model.apply({"params": params}, changed)
  np.testing.assert_array_equal(a[0, :10], b[0, :10])
  assert not np.allclose(a[0, 10:], b[0, 10:])


def test_packed_segments_do_not_attend_to_each_other():
  """Two documents packed in one row give the same logits as each document alone."""
  model, params = init(TINY)
  doc1 = jax.random.randint(jax.random.key(2), (1, 7), 0, TINY.vocab_size)
  doc2 = jax.random.randint(jax.random.key(3), (1, 9), 0, TINY.vocab_size)
  packed = jnp.concatenate([doc1, doc2], axis=1)
  segments = jnp.array([[1] * 7 + [2] * 9])
  positions = jnp.array([list(range(7)) + list(range(9))])
  out = model.apply({"params": params}, packed, positions, segments)
  alone1 = model.apply({"params": params}, doc1)
  alone2 = model.apply({"params": params}, doc2)
  np.testing.assert_allclose(out[:, :7], alone1, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(out[:, 7:], alone2, atol=1e-5, rtol=1e-5)



def test_causal_attention_mask_attends_across_packed_documents():
  """attention_mask="causal": the second document sees the first (no segment mask), which is
  the whole row as one document; the first document is unchanged either way."""
  model, params = init(TINY)
  causal = Qwen2(dataclasses.replace(TINY, attention_mask="causal"))
  tokens = jax.random.randint(jax.random.key(4), (1, 16), 0, TINY.vocab_size)
  segments = jnp.array([[1] * 7 + [2] * 9])
  positions = jnp.array([list(range(7)) + list(range(9))])
  doc = model.apply({"params": params}, tokens, positions, segments)
  across = causal.apply({"params": params}, tokens, positions, segments)
  one_segment = model.apply({"params": params}, tokens, positions, jnp.ones_like(segments))
  np.testing.assert_allclose(across, one_segment, atol=1e-6, rtol=1e-6)
  np.testing.assert_allclose(across[:, :7], doc[:, :7], atol=1e-6, rtol=1e-6)
  assert not np.allclose(across[:, 7:], doc[:, 7:], atol=1e-3)
  with pytest.raises(ValueError, match="attention_mask='none'.*'document', 'causal'"):
    dataclasses.replace(TINY, attention_mask="none")

def test_rope_theta_matters():
  model_a, params = init(TINY)
  model_b = Qwen2(dataclasses.replace(TINY, rope_theta=10.0))
  tokens = jax.random.randint(jax.random.key(4), (1, 16), 0, TINY.vocab_size)
  a = model_a.apply({"params": params}, tokens)
  b = model_b.apply({"params": params}, tokens)
  assert not np.allclose(a[0, 1:], b[0, 1:])


@pytest.mark.parametrize("tie", [True, False])
def test_every_projection_uses_the_injected_dot_general(tie):
  cfg = dataclasses.replace(TINY, tie_embeddings=tie)
  seen = []

  def factory(path, axes=None):
    seen.append(path)
    def dot_general(lhs, rhs, dims, precision=None, preferred_element_type=None):
      # A recognisable change: every projection's output doubled.
      return 2 * lax.dot_general(lhs, rhs, dims, precision=precision,
                                 preferred_element_type=preferred_element_type)
    return dot_general

  _, params = init(cfg)
  seen.clear()
  tokens = jnp.ones((1, 8), jnp.int32)
  doubled = Qwen2(cfg, factory).apply({"params": params}, tokens)
  expected = {f"layers_{i}/{block}/{name}" for i in range(cfg.num_layers)
              for block, names in (("self_attn", "qkvo"), ("mlp", ("gate", "up", "down")))
              for name in (f"{n}_proj" for n in names)} | {"lm_head"}
  assert set(seen) == expected
  plain = Qwen2(cfg).apply({"params": params}, tokens)
  assert not np.allclose(doubled, plain)


@pytest.mark.parametrize("remat", ["save_dots", "full"])
def test_remat_gives_the_same_gradients(remat):
  tokens = jax.random.randint(jax.random.key(5), (2, 16), 0, TINY.vocab_size)
  model, params = init(TINY)
  loss = lambda m: lambda p: jnp.mean(m.apply({"params": p}, tokens) ** 2)
  g_plain = jax.grad(loss(model))(params)
  g_remat = jax.grad(loss(Qwen2(dataclasses.replace(TINY, remat=remat))))(params)
  for a, b in zip(jax.tree.leaves(g_plain), jax.tree.leaves(g_remat)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_bad_model_config_is_a_clear_error():
  with pytest.raises(ValueError, match="num_kv_heads"):
    ModelConfig(num_heads=4, num_kv_heads=3)
  with pytest.raises(ValueError, match="remat"):
    ModelConfig(remat="sometimes")


@pytest.mark.parametrize("remat", ["none", "save_dots", "full"])
def test_scan_layers_gives_the_unrolled_logits_and_gradients(remat):
  """One lax.scan over stacked layer params computes what the unrolled layers compute."""
  tokens = jax.random.randint(jax.random.key(5), (2, 16), 0, TINY.vocab_size)
  unrolled, params = init(dataclasses.replace(TINY, remat=remat))
  scanned = Qwen2(dataclasses.replace(TINY, remat=remat, scan_layers=True))
  assert jax.tree.structure(params) == jax.tree.structure(
      nn.unbox(init_params(scanned, jax.random.key(0))))  # same checkpoints
  np.testing.assert_allclose(scanned.apply({"params": params}, tokens),
                             unrolled.apply({"params": params}, tokens), rtol=1e-5, atol=1e-5)
  loss = lambda m: lambda p: jnp.mean(m.apply({"params": p}, tokens) ** 2)
  for a, b in zip(jax.tree.leaves(jax.grad(loss(unrolled))(params)),
                  jax.tree.leaves(jax.grad(loss(scanned))(params))):
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-7)
  hlo = jax.jit(jax.grad(loss(scanned))).lower(params).as_text()
  assert "stablehlo.while" in hlo


def test_scan_layers_runs_fp8_recipes_and_refuses_per_layer_precision():
  from infir2_jax.precision import PrecisionConfig, make_dot_general_factory
  tokens = jax.random.randint(jax.random.key(5), (2, 128), 0, TINY.vocab_size)
  cfg = dataclasses.replace(TINY, hidden_size=128, intermediate_size=256, head_dim=32)
  factory = make_dot_general_factory(PrecisionConfig(recipe="infir2", backend="xla"))
  _, params = init(cfg)   # the params do not depend on the recipe (a BF16 init is cheaper)
  unrolled = Qwen2(cfg, factory)
  scanned = Qwen2(dataclasses.replace(cfg, scan_layers=True), factory)
  # Jitted: op by op, the FP8 quantization's many small ops took most of this test's time.
  apply = lambda model: jax.jit(model.apply)({"params": params}, tokens)
  np.testing.assert_allclose(apply(scanned), apply(unrolled), rtol=1e-4, atol=1e-4)
  per_layer = make_dot_general_factory(
      PrecisionConfig(recipe="infir2", backend="xla", overrides=("layers_0/=bf16",)))
  with pytest.raises(ValueError, match="scan_layers.*layers.*self_attn"):
    Qwen2(dataclasses.replace(cfg, scan_layers=True), per_layer).apply({"params": params},
                                                                        tokens)


def _flat_config(path):
  from infir2_jax.config import load_config
  flat = lambda d, p="": ({k2: v2 for k, v in d.items() for k2, v2 in flat(v, p + k + ".").items()}
                          if isinstance(d, dict) else {p[:-1]: d})
  return flat(dataclasses.asdict(load_config(path)))


def _step_rows(name):
  """{label: row} of a committed train_step benchmark result, failed rows left out."""
  import json
  with open(os.path.join(ROOT, "benchmarks", "results", name)) as f:
    return {r["label"]: r for r in json.load(f)["variants"] if "error" not in r}


def test_1p5b_default_is_the_measured_fast_step_and_scanned_the_old_default():
  """configs/1p5b.py is the unrolled save_dots_fp8 step; :scanned changes exactly the two
  settings of the old default; :fast (the default's old name) is the default. In session 22's
  run (all rows with the fused loss) the default's row is >= 10% faster than the scanned
  row and within 2% of the fastest infir2 row (remat none, at the same peak: one run, the
  clocks 1% apart, not enough to change the default)."""
  path = os.path.join(ROOT, "configs", "1p5b.py")
  base, scanned, fast = (_flat_config(path + v) for v in ("", ":scanned", ":fast"))
  assert fast == base
  assert (base["model.scan_layers"], base["model.remat"]) == (False, "save_dots_fp8")
  changed = {k: scanned[k] for k in scanned if scanned[k] != base.get(k)}
  assert changed == {"model.scan_layers": True, "model.remat": "save_dots"}
  rows = _step_rows("train_step_h200_1p5b_s22_8k_remat.json")
  infir2 = {l: r for l, r in rows.items() if r["recipe"] == "infir2"}
  setting = lambda r: ("model.scan_layers=False" not in r["overrides"], r["remat"])
  (default,) = [r for r in infir2.values() if setting(r) == (False, "save_dots_fp8")]
  (old,) = [r for r in infir2.values() if setting(r) == (True, "save_dots")]
  assert default["median_step_s"] <= 0.9 * old["median_step_s"]
  assert default["median_step_s"] <= 1.02 * min(r["median_step_s"] for r in infir2.values())


def test_1p5b_lean_variant_is_the_measured_low_memory_step():
  """configs/1p5b.py:lean is the default with FP8 moments, and the row of the committed
  result with its settings peaks under 0.8x bf16's memory in less time than bf16's step in
  the same run."""
  path = os.path.join(ROOT, "configs", "1p5b.py")
  base, lean = _flat_config(path), _flat_config(path + ":lean")
  changed = {k: lean[k] for k in lean if lean[k] != base.get(k)}
  assert changed == {"opt.moments": "fp8"}
  rows = _step_rows("train_step_h200_1p5b_s21_8k_fusedloss.json")
  overrides = lambda label: dict(o.split("=") for o in label.split("~")[1:])
  (label,) = [l for l in rows if l.startswith("infir2~") and "opt.moments" in overrides(l)
              and all(str(lean[k]) == v for k, v in overrides(l).items())]
  assert overrides(label)["model.scan_layers"] == "False"
  assert overrides(label)["model.remat"] == "save_dots_fp8"
  bf16 = rows["bf16~model.scan_layers=False"]
  assert rows[label]["peak_memory_gib"] <= 0.8 * bf16["peak_memory_gib"]
  assert rows[label]["median_step_s"] < bf16["median_step_s"]


def test_7b_default_keeps_its_measured_loss_and_lean_is_the_78_gib_candidate():
  """configs/7b.py inherits 1p5b's training setup but not its fused loss (its rows were
  measured with whole rows, scanned, full remat). :lean is issue 35's <= 78 GiB
  configuration: unrolled full remat, FP8 moments, the fused head and loss 1024 tokens at a
  time, the row of the committed deviceless buffer assignment that allocates under 78 GiB
  less the 4.4 GiB the H200's autotuned compile added in session 25."""
  import json
  from infir2_jax.config import load_config
  path = os.path.join(ROOT, "configs", "7b.py")
  cfg, lean = load_config(path), load_config(path + ":lean")
  assert (cfg.model.loss_fused, cfg.model.loss_chunk) == (False, 0)
  assert (cfg.model.scan_layers, cfg.model.remat) == (True, "full")
  assert (lean.model.loss_fused, lean.model.loss_chunk, lean.opt.moments) == (True, 1024, "fp8")
  assert (lean.model.scan_layers, lean.model.remat) == (False, "full")
  with open(os.path.join(ROOT, "benchmarks", "results",
                         "peak_buffers_7b_s26_bf16_fp8_grads.json")) as f:
    rows = json.load(f)["rows"]
  settings = lambda label: dict(o.split("=") for o in label.split("~")[1:])
  (row,) = [r for label, r in rows.items() if label.startswith("infir2~") and settings(label) == {
      "model.scan_layers": "False", "opt.moments": "fp8", "model.loss_chunk": "1024",
      "model.loss_fused": "True"}]
  assert row["allocated_gib"] <= 78 - 4.4
