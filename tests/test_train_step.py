"""Train step: exact per-token averaging, gradient accumulation, schedules, decay masks."""

import dataclasses

import flax.linen as nn
import flax.traverse_util
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from infir2_jax.model import ModelConfig, Qwen2, init_params
from infir2_jax.precision import PrecisionConfig, make_dot_general_factory
from infir2_jax.config import OptConfig
from infir2_jax.train.optim import decay_mask, make_optimizer, make_schedule
from infir2_jax.train.step import loss_sums, make_train_step, split_microbatches

TINY = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                   num_heads=4, num_kv_heads=2, dtype="float32")


def make_batch(rows=8, length=16, seed=0):
  rng = np.random.default_rng(seed)
  mask = (rng.random((rows, length)) < 0.6).astype(np.float32)  # uneven tokens per row
  return {"inputs": rng.integers(0, 256, (rows, length), dtype=np.int32),
          "targets": rng.integers(0, 256, (rows, length), dtype=np.int32),
          "segment_ids": np.ones((rows, length), np.int32),
          "positions": np.tile(np.arange(length, dtype=np.int32), (rows, 1)),
          "loss_mask": mask}


def setup(accum=1, tx=None):
  model = Qwen2(TINY)
  params = nn.unbox(init_params(model, jax.random.key(0)))
  opt_cfg = OptConfig(lr=1e-2, warmup_steps=0, clip_norm=0.0)
  tx = tx or make_optimizer(opt_cfg, 10)
  state = {"step": jnp.int32(0), "params": params, "opt_state": tx.init(params)}
  step = jax.jit(make_train_step(model, tx, make_schedule(opt_cfg, 10), accum))
  return model, state, step


def test_loss_is_the_per_token_mean_over_the_whole_batch():
  model, state, step = setup()
  batch = make_batch()
  _, metrics = step(state, batch)
  logits = np.asarray(model.apply({"params": state["params"]}, batch["inputs"]), np.float64)
  logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1,
                                                                             keepdims=True)) \
      - logits.max(-1, keepdims=True)
  nll = -np.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]
  expected = (nll * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
  np.testing.assert_allclose(float(metrics["loss"]), expected, rtol=1e-5)
  assert float(metrics["loss_tokens"]) == batch["loss_mask"].sum()


@pytest.mark.parametrize("accum", [2, 4])
def test_gradient_accumulation_equals_one_big_batch(accum):
  batch = make_batch()
  sgd = optax.sgd(1.0)  # params move by exactly -grads: compares the averaged gradients
  _, state1, step1 = setup(1, sgd)
  _, state_k, step_k = setup(accum, sgd)
  new1, m1 = step1(state1, batch)
  new_k, m_k = step_k(state_k, batch)
  np.testing.assert_allclose(m1["loss"], m_k["loss"], rtol=1e-5)
  np.testing.assert_allclose(m1["grad_norm"], m_k["grad_norm"], rtol=1e-5)
  for a, b in zip(jax.tree.leaves(new1["params"]), jax.tree.leaves(new_k["params"])):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_microbatches_take_strided_rows():
  batch = {"x": np.arange(8)[:, None]}
  split = split_microbatches(batch, 2)["x"][..., 0]
  np.testing.assert_array_equal(split, [[0, 2, 4, 6], [1, 3, 5, 7]])


def test_masked_tokens_do_not_contribute():
  model, state, _ = setup()
  batch = make_batch()
  grad = jax.grad(lambda p, b: loss_sums(model, p, b)[0])
  changed = dict(batch, targets=np.where(batch["loss_mask"] > 0, batch["targets"],
                                         (batch["targets"] + 7) % 256))
  for a, b in zip(jax.tree.leaves(grad(state["params"], batch)),
                  jax.tree.leaves(grad(state["params"], changed))):
    np.testing.assert_array_equal(a, b)


def test_wsd_schedule_shape():
  cfg = OptConfig(lr=1.0, schedule="wsd", warmup_steps=10, decay_fraction=0.2, min_lr_ratio=0.1)
  lr = make_schedule(cfg, 100)
  np.testing.assert_allclose([lr(0), lr(5), lr(10), lr(50), lr(80), lr(90), lr(100)],
                             [0.0, 0.5, 1.0, 1.0, 1.0, 0.55, 0.1], atol=1e-6)


def test_cosine_schedule_shape():
  cfg = OptConfig(lr=1.0, schedule="cosine", warmup_steps=5, min_lr_ratio=0.1)
  lr = make_schedule(cfg, 105)
  np.testing.assert_allclose([lr(0), lr(5), lr(55), lr(105)], [0.0, 1.0, 0.55, 0.1], atol=1e-6)


def test_no_weight_decay_on_norms_and_biases():
  params = {"kernel": jnp.ones((4, 4)), "bias": jnp.ones((4,)), "scale": jnp.ones((4,))}
  assert decay_mask(params) == {"kernel": True, "bias": False, "scale": False}
  tx = make_optimizer(OptConfig(lr=0.1, warmup_steps=0, weight_decay=0.5, clip_norm=0.0), 10)
  zeros = jax.tree.map(jnp.zeros_like, params)
  updates, _ = tx.update(zeros, tx.init(params), params)
  new = optax.apply_updates(params, updates)
  assert float(new["kernel"][0, 0]) < 1.0
  assert float(new["bias"][0]) == 1.0 and float(new["scale"][0]) == 1.0


def test_gradients_are_clipped_by_global_norm_before_adam():
  # b1 = b2 = 0 and eps = 1 make Adam's step g / (|g| + 1) elementwise, so it shows the clip:
  # g = (30, 40) has norm 50 -> clipped to (0.6, 0.8) -> step 0.6 / 1.6 = 0.375 (not 30/31).
  params = {"w": jnp.zeros((2,))}
  tx = make_optimizer(OptConfig(lr=1.0, warmup_steps=0, weight_decay=0.0, clip_norm=1.0,
                                b1=0.0, b2=0.0, eps=1.0), 10)
  updates, _ = tx.update({"w": jnp.array([30.0, 40.0])}, tx.init(params), params)
  np.testing.assert_allclose(updates["w"], [-0.6 / 1.6, -0.8 / 1.8], rtol=1e-6)


def test_bad_optimizer_config():
  with pytest.raises(ValueError, match="schedule"):
    OptConfig(schedule="linear-ish")


def loss_problem(**model_overrides):
  """(model config, batch, params) where the LM head dominates: a 2048-word vocabulary,
  4 rows of 64 positions with uneven loss masks."""
  vocab = 2048
  cfg = dataclasses.replace(TINY, vocab_size=vocab, **model_overrides)
  batch = make_batch(rows=4, length=64)
  batch["targets"] = (batch["targets"] * 7) % vocab
  params = nn.unbox(init_params(Qwen2(cfg), jax.random.key(0)))
  return cfg, batch, params


@pytest.mark.parametrize("tie", [True, False])
def test_chunked_loss_equals_whole_rows_and_holds_fewer_logits(tie):
  """model.loss_chunk: the same loss sums and gradients (float32), and XLA's temporaries
  shrink by about the whole-row logits it no longer keeps."""
  cfg, batch, params = loss_problem(tie_embeddings=tie)
  vocab, length = cfg.vocab_size, batch["targets"].shape[1]
  results, temps = {}, {}
  for chunk in (0, 16):
    chunked = Qwen2(dataclasses.replace(cfg, loss_chunk=chunk))
    fn = jax.jit(jax.value_and_grad(lambda p, b: loss_sums(chunked, p, b), has_aux=True))
    results[chunk] = fn(params, batch)
    temps[chunk] = fn.lower(params, batch).compile().memory_analysis().temp_size_in_bytes
  (loss0, count0), grads0 = results[0]
  (loss1, count1), grads1 = results[16]
  assert float(count0) == float(count1) == batch["loss_mask"].sum()
  np.testing.assert_allclose(float(loss1), float(loss0), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(grads0), jax.tree.leaves(grads1)):  # f32 summation order
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.linalg.norm(b - a) <= 1e-5 * np.linalg.norm(a)
  logits_bytes = 4 * length * vocab * 4  # rows x length x vocab float32
  assert temps[16] < temps[0] - logits_bytes, temps


@pytest.mark.parametrize("vocab_axis", [0, 1])
def test_fused_head_loss_is_the_whole_row_loss_bit_for_bit(vocab_axis):
  """train/loss.py's fused head and loss on bf16 operands (tied [V, D] / untied [D, V]
  head): the loss sums and both gradients equal the whole-row head + loss's bit for bit
  (the bf16 GEMMs, the float32 cotangent rounded to bf16), where the recomputing chunked
  loss sums the head's gradient in bf16 per chunk and is only close."""
  from infir2_jax.precision import gemm  # pylint: disable=import-outside-toplevel
  from infir2_jax.train import loss as loss_lib  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(0)
  rows, length, d, vocab = 2, 64, 32, 100
  hidden = jnp.asarray(rng.standard_normal((rows, length, d)), jnp.bfloat16)
  shape = (vocab, d) if vocab_axis == 0 else (d, vocab)
  weight = jnp.asarray(rng.standard_normal(shape) * 0.3, jnp.bfloat16)
  targets = jnp.asarray(rng.integers(0, vocab, (rows, length)), jnp.int32)
  mask = jnp.asarray(rng.random((rows, length)) < 0.7, jnp.float32)   # SFT-like, uneven
  dims = (((2,), (1 - vocab_axis,)), ((), ()))
  head = lambda h, w: gemm.bf16_dot_general(h, w, dims, preferred_element_type=jnp.float32)
  forms = {
      "whole": lambda h, w: loss_lib.cross_entropy_sums(head(h, w), targets, mask),
      "chunked": lambda h, w: loss_lib.chunked_cross_entropy_sums(
          lambda x: head(x, w), h, targets, mask, 16),
      "fused": lambda h, w: loss_lib.fused_head_cross_entropy_sums(
          h, w, targets, mask, 16, vocab_axis)}
  out = {k: jax.device_get(jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(
      hidden, weight)) for k, f in forms.items()}
  (loss, count), grads = out["whole"]
  assert float(count) == float(mask.sum())
  assert out["fused"][0] == (loss, count)
  for got, want in zip(out["fused"][1], grads):
    assert got.dtype == want.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert not np.array_equal(out["chunked"][1][1], grads[1])   # bf16 sums per chunk
  # a power-of-two cotangent scales the saved gradients exactly, as the whole row's
  _, vjp = jax.vjp(lambda h, w: forms["fused"](h, w)[0], hidden, weight)
  whole_vjp = jax.vjp(lambda h, w: forms["whole"](h, w)[0], hidden, weight)[1]
  for got, want in zip(vjp(jnp.float32(0.25)), whole_vjp(jnp.float32(0.25))):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("tie", [True, False])
def test_fused_loss_in_the_model_equals_whole_rows_without_their_logits(tie):
  """model.loss_fused in the model (float32 compute): the loss sums and gradients of whole
  rows (float32 summation order apart); XLA's temporaries drop by about the whole-row
  logits, and the compiled step has fewer GEMMs than the recomputing chunked loss."""
  cfg, batch, params = loss_problem(tie_embeddings=tie)
  vocab, length = cfg.vocab_size, batch["targets"].shape[1]
  results, temps, dots = {}, {}, {}
  for name, kw in (("whole", {}), ("chunked", {"loss_chunk": 16}),
                   ("fused", {"loss_chunk": 16, "loss_fused": True})):
    variant = Qwen2(dataclasses.replace(cfg, **kw))
    fn = jax.jit(jax.value_and_grad(lambda p, b, m=variant: loss_sums(m, p, b), has_aux=True))
    results[name] = jax.device_get(fn(params, batch))
    compiled = fn.lower(params, batch).compile()
    temps[name] = compiled.memory_analysis().temp_size_in_bytes
    dots[name] = compiled.as_text().count(" dot(")
  (loss, count), grads = results["whole"]
  (f_loss, f_count), f_grads = results["fused"]
  assert float(f_count) == float(count) == batch["loss_mask"].sum()
  np.testing.assert_allclose(float(f_loss), float(loss), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(f_grads)):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.linalg.norm(b - a) <= 1e-5 * np.linalg.norm(a)
  logits_bytes = 4 * length * vocab * 4
  assert temps["fused"] < temps["whole"] - logits_bytes, temps
  assert dots["fused"] < dots["chunked"], dots   # no LM-head GEMM recomputed


def test_fused_loss_needs_a_chunk_and_a_bf16_head():
  from infir2_jax.config import ConfigError, load_config  # pylint: disable=import-outside-toplevel
  with pytest.raises(ConfigError, match="loss_fused=True needs model.loss_chunk"):
    dataclasses.replace(TINY, loss_fused=True)
  # (key=value overrides: a "--config." prefix is an unknown key whose error lists every
  # valid key, quantize_lm_head included, which matched here before session 21)
  with pytest.raises(ConfigError, match="loss_fused computes a BF16 LM head"):
    load_config("configs/default.py", ["model.loss_chunk=64", "model.loss_fused=True",
                                       "precision.quantize_lm_head=True"])


def test_loss_chunk_must_divide_the_sequence():
  model = Qwen2(dataclasses.replace(TINY, loss_chunk=5))
  params = nn.unbox(init_params(model, jax.random.key(0)))
  with pytest.raises(ValueError, match="loss_chunk=5 must divide the sequence length 16"):
    loss_sums(model, params, make_batch())
  with pytest.raises(ValueError, match="loss_chunk must be >= 0"):
    dataclasses.replace(TINY, loss_chunk=-1)
  # ... and the config says so before anything is built; configs/1p5b.py chunks its loss
  # by 2048 positions, so a shorter seq_len names the fix (its smoke variant makes it).
  from infir2_jax.config import ConfigError, load_config  # pylint: disable=import-outside-toplevel
  with pytest.raises(ConfigError, match="loss_chunk=2048 must divide seq_len=1000"):
    load_config("configs/1p5b.py", ["seq_len=1000"])
  smoke = load_config("configs/1p5b.py:smoke")
  assert smoke.seq_len % smoke.model.loss_chunk == 0 and smoke.model.loss_fused


# --- warm-up that fits the run (issue 22 item 5) ---------------------------------------------

def test_smoke_run_leaves_warm_up_and_decays_without_a_warning():
  """configs/default.py:smoke is 20 steps: with the default 30 warm-up steps it used to end at
  the peak lr, then warned about its own warm-up (issue 37). It sets a warm-up that fits."""
  import warnings  # pylint: disable=import-outside-toplevel
  from infir2_jax.config import load_config  # pylint: disable=import-outside-toplevel
  cfg = load_config("configs/default.py:smoke", [])
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    lr = make_schedule(cfg.opt, cfg.steps)
  last = float(lr(cfg.steps - 1))   # the lr of the run's last update
  assert last < 0.5 * cfg.opt.lr, last
  np.testing.assert_allclose(float(lr(cfg.steps)), cfg.opt.lr * cfg.opt.min_lr_ratio, rtol=1e-6)
  assert max(float(lr(s)) for s in range(cfg.steps)) == pytest.approx(cfg.opt.lr)  # reached


@pytest.mark.parametrize("schedule", ["wsd", "cosine", "constant"])
def test_warm_up_longer_than_the_run_is_shortened_for_every_schedule(schedule):
  cfg = OptConfig(lr=1.0, schedule=schedule, warmup_steps=50, min_lr_ratio=0.1)
  with pytest.warns(UserWarning, match="opt.warmup_steps=50"):
    lr = make_schedule(cfg, 40)
  peak_at = int(np.argmax([float(lr(s)) for s in range(41)]))
  assert float(lr(peak_at)) == pytest.approx(1.0)
  if schedule == "constant":
    assert peak_at == 20 and float(lr(39)) == pytest.approx(1.0)  # half the run at its lr
  else:
    assert float(lr(40)) == pytest.approx(0.1) and float(lr(39)) < 0.5   # it decays


def test_a_warm_up_that_fits_is_kept_without_a_warning():
  import warnings  # pylint: disable=import-outside-toplevel
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    lr = make_schedule(OptConfig(lr=1.0, warmup_steps=30), 250)   # the default run
    make_schedule(OptConfig(lr=1.0, warmup_steps=2), 10)          # the sweep's tiny variant
  assert float(lr(15)) == pytest.approx(0.5) and float(lr(30)) == pytest.approx(1.0)


# --- gradients in the compute dtype (issue 25 item 2) ----------------------------------------

def _bf16_gradient_params(model, params) -> set[str]:
  from infir2_jax.train.grads import compute_dtypes  # pylint: disable=import-outside-toplevel
  found = compute_dtypes(lambda p, b: loss_sums(model, p, b), params, make_batch())
  flat = jax.tree_util.tree_flatten_with_path(found, is_leaf=lambda x: x is None)[0]
  assert {v for _, v in flat} <= {None, jnp.dtype(jnp.bfloat16)}
  return {"/".join(k.key for k in path) for path, v in flat if v is not None}


def test_bf16_gradients_where_they_are_a_gemm_output_or_a_scanned_slice():
  cfg = dataclasses.replace(TINY, dtype="bfloat16", tie_embeddings=False, remat="full")
  model = Qwen2(cfg)
  params = nn.unbox(init_params(model, jax.random.key(0)))
  names = set(flax.traverse_util.flatten_dict(params, sep="/"))
  kernels = {n for n in names if n.endswith("/kernel")}
  # unrolled layers: the projections' kernels (GEMM operands) and the untied embedding (its
  # lookup's backward sums in float32 and rounds once: layers.embed_lookup, marked); not
  # the norms or biases (elementwise cotangents XLA may keep in float32)
  embedding = {"embed_tokens/embedding"}
  assert _bf16_gradient_params(model, params) == kernels | embedding
  # scanned layers: every layer param is a slice of the loop's bf16 gradient
  scanned = Qwen2(dataclasses.replace(cfg, scan_layers=True))
  assert _bf16_gradient_params(scanned, params) == {
      n for n in names if n.startswith("layers_")} | {"lm_head/kernel"} | embedding
  # the LM head inside model.loss_chunk's scan is cast in every chunk: a float32 sum
  chunked = Qwen2(dataclasses.replace(cfg, loss_chunk=8))
  assert _bf16_gradient_params(chunked, params) == (kernels - {"lm_head/kernel"}) | embedding
  # ... but the fused head and loss write the head's gradient once, in bf16 (its backward is
  # marked precision.cotangents.cotangent_is_buffer): no float32 copy of the [D, V] gradient
  fused = Qwen2(dataclasses.replace(cfg, loss_chunk=8, loss_fused=True))
  assert _bf16_gradient_params(fused, params) == kernels | embedding
  # infir2's FP8 projections and fused MLP write dW in bf16 (their backwards are marked):
  # unrolled, every projection's kernel too, composed or fused
  for fused_mlp in (True, False):
    fp8 = Qwen2(cfg, make_dot_general_factory(PrecisionConfig(
        recipe="infir2", backend="xla", fused_mlp=fused_mlp)))
    assert _bf16_gradient_params(fp8, params) == kernels | embedding, fused_mlp
  # the tied embedding's cast copy is used twice (lookup and head): a summed cotangent
  tied = Qwen2(dataclasses.replace(cfg, tie_embeddings=True))
  tied_params = nn.unbox(init_params(tied, jax.random.key(0)))
  assert "embed_tokens/embedding" not in _bf16_gradient_params(tied, tied_params)
  # a float32 model casts nothing
  assert not _bf16_gradient_params(Qwen2(dataclasses.replace(cfg, dtype="float32")), params)


@pytest.mark.parametrize("scan,fused,recipe,grad_inputs", [
    (False, False, "bf16", "cast"), (True, False, "bf16", "cast"),
    (False, True, "bf16", "cast"), (False, False, "infir2", "cast"),
    (False, False, "infir2~fused_mlp=False", "cast"),
    (False, False, "infir2", "master"), (True, False, "bf16", "master"),
    (False, True, "infir2", "master")])
def test_bf16_gradients_are_the_float32_gradients_bit_for_bit(scan, fused, recipe, grad_inputs,
                                                              monkeypatch):
  """The compute-dtype gradients, converted, equal those of the float32 params exactly; the
  step built on them matches one differentiating the float32 params (to float32 rounding
  of two differently fused optimizer graphs). Accumulation: test_gradient_accumulation_*.
  infir2: the FP8 projections' and fused MLP's wgrad GEMMs write dW in bf16.
  grad_inputs "master" (INFIR2_GRAD_INPUTS): the masters differentiated with their
  gradients routed to bf16 deltas, under full remat (what it is for): the same bits."""
  from infir2_jax.train import step as step_lib  # pylint: disable=import-outside-toplevel
  from infir2_jax.train.step import compute_dtype_grad_fn  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(step_lib, "GRAD_INPUTS", grad_inputs)
  cfg = dataclasses.replace(TINY, dtype="bfloat16", tie_embeddings=False, scan_layers=scan,
                            **({"loss_chunk": 8, "loss_fused": True} if fused else {}),
                            **({"remat": "full"} if grad_inputs == "master" else {}))
  name, *fused_mlp = recipe.split("~fused_mlp=")
  model = Qwen2(cfg, make_dot_general_factory(PrecisionConfig(
      recipe=name, backend="xla", fused_mlp=not fused_mlp)))
  params = nn.unbox(init_params(model, jax.random.key(0)))
  batch = make_batch()
  (sums, grads) = jax.jit(compute_dtype_grad_fn(model))(params, batch)
  if fused:
    assert grads["lm_head"]["kernel"].dtype == jnp.bfloat16
  (ref_sums, ref_grads) = jax.jit(jax.value_and_grad(
      lambda p, b: loss_sums(model, p, b), has_aux=True))(params, batch)
  assert float(sums[0]) == float(ref_sums[0])
  assert any(g.dtype == jnp.bfloat16 for g in jax.tree.leaves(grads))
  for g, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_array_equal(np.asarray(g, np.float32), ref)

  opt_cfg = OptConfig(lr=1e-2, warmup_steps=0)
  tx = make_optimizer(opt_cfg, 10)
  state = {"step": jnp.int32(0), "params": params, "opt_state": tx.init(params)}
  new, _ = jax.jit(make_train_step(model, tx, make_schedule(opt_cfg, 10)))(state, batch)
  g = jax.tree.map(lambda x: x / batch["loss_mask"].sum(), ref_grads)
  updates, ref_opt = jax.jit(tx.update)(g, state["opt_state"], params)
  for a, b in zip(jax.tree.leaves((new["params"], new["opt_state"])),
                  jax.tree.leaves((optax.apply_updates(params, updates), ref_opt))):
    np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-8)


def test_bf16_gradients_of_per_shard_fp8_projections_are_the_float32_ones_over_8_devices():
  """infir2's projections and fused MLP run per shard (shard_map) over data 2 x fsdp 2 x
  tensor 2: the analysis follows the weights into the shard_map, finds every projection's
  kernel, and its bf16 gradients (summed over the batch axes in bf16 by shard_map's
  transpose, as before) equal the float32 path's bit for bit."""
  import functools  # pylint: disable=import-outside-toplevel
  from infir2_jax import parallel  # pylint: disable=import-outside-toplevel
  from infir2_jax.train.step import compute_dtype_grad_fn  # pylint: disable=import-outside-toplevel
  cfg = dataclasses.replace(TINY, dtype="bfloat16", tie_embeddings=False, hidden_size=256,
                            intermediate_size=512, num_heads=2, num_kv_heads=2)
  model = Qwen2(cfg, make_dot_general_factory(PrecisionConfig(recipe="infir2", backend="xla")))
  mesh_cfg = parallel.MeshConfig(data=2, fsdp=2, tensor=2)
  mesh = parallel.make_mesh(mesh_cfg)
  rules = parallel.logical_rules(mesh_cfg, cfg, mesh)
  state, shardings = parallel.sharded_init(functools.partial(init_params, model),
                                           optax.sgd(0.1), mesh, rules, jax.random.key(0))
  batch = make_batch()
  loss_fn = lambda p, b: loss_sums(model, p, b)
  from infir2_jax.train.grads import compute_dtypes  # pylint: disable=import-outside-toplevel
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    found = compute_dtypes(loss_fn, state["params"], batch)
    bf16 = {"/".join(k.key for k in path) for path, v in
            jax.tree_util.tree_flatten_with_path(found, is_leaf=lambda x: x is None)[0]
            if v is not None}
    assert bf16 == {n for n in flax.traverse_util.flatten_dict(state["params"], sep="/")
                    if n.endswith("/kernel")} | {"embed_tokens/embedding"}
    jaxpr = str(jax.make_jaxpr(loss_fn)(state["params"], batch))
    assert "shard_map" in jaxpr   # the per-shard path, not XLA's partitioner
    in_sh = (shardings["params"], parallel.batch_sharding(mesh, rules))
    (_, grads) = jax.jit(compute_dtype_grad_fn(model), in_shardings=in_sh)(
        state["params"], batch)
    (_, want) = jax.jit(jax.value_and_grad(loss_fn, has_aux=True), in_shardings=in_sh)(
        state["params"], batch)
  assert any(g.dtype == jnp.bfloat16 for g in jax.tree.leaves(grads))
  for g, ref in zip(jax.tree.leaves(jax.device_get(grads)), jax.tree.leaves(jax.device_get(want))):
    np.testing.assert_array_equal(np.asarray(g, np.float32), ref)


def test_fused_loss_evaluated_without_gradients_makes_none():
  """An eval step (no jax.grad) of model.loss_fused runs the chunks' loss alone: the same
  sums, and no more GEMMs than the recomputing chunked loss's forward (one per chunk)."""
  cfg, batch, params = loss_problem(loss_chunk=16)
  model = Qwen2(cfg)
  fused = Qwen2(dataclasses.replace(cfg, loss_fused=True))
  evals = [jax.jit(lambda p, b, m=m: loss_sums(m, p, b)) for m in (model, fused)]
  sums = [jax.device_get(f(params, batch)) for f in evals]
  np.testing.assert_allclose(np.asarray(sums[1]), np.asarray(sums[0]), rtol=1e-6)
  dots = [f.lower(params, batch).compile().as_text().count(" dot(") for f in evals]
  assert dots[1] == dots[0], dots


def test_fused_loss_sharded_over_fsdp_and_tensor_equals_one_device():
  """model.loss_fused on 8 devices (fsdp 2 x tensor 4: the head's vocabulary split over
  tensor, its float32 gradient accumulator placed by propagation): the loss sums and
  gradients of one device, float32 summation order apart, the head's gradient split too."""
  import functools  # pylint: disable=import-outside-toplevel
  from infir2_jax import parallel  # pylint: disable=import-outside-toplevel
  cfg, batch, _ = loss_problem(loss_chunk=16, loss_fused=True)
  model = Qwen2(cfg)
  mesh_cfg = parallel.MeshConfig(data=1, fsdp=2, tensor=4)
  mesh = parallel.make_mesh(mesh_cfg)
  rules = parallel.logical_rules(mesh_cfg, cfg, mesh)
  state, shardings = parallel.sharded_init(functools.partial(init_params, model),
                                           optax.sgd(0.1), mesh, rules, jax.random.key(0))
  grad_fn = jax.value_and_grad(lambda p, b: loss_sums(model, p, b), has_aux=True)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    (loss, count), grads = jax.jit(grad_fn, in_shardings=(shardings["params"], None))(
        state["params"], batch)
    head = grads["embed_tokens"]["embedding"]
    assert head.addressable_shards[0].data.shape[0] == cfg.vocab_size // 4   # split over tensor
  params = jax.device_get(state["params"])
  (want_loss, want_count), want = jax.jit(grad_fn)(params, batch)
  assert float(count) == float(want_count)
  np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(jax.device_get(grads))):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.linalg.norm(b - a) <= 1e-5 * np.linalg.norm(a)


def test_fused_fp8_step_equals_the_chain_and_runs_sharded_over_fsdp():
  """opt.moments=fp8 with the Pallas kernel: the step applies optim.make_apply's fused
  update from the raw bf16 gradient sums; its params, state and grad norm are the generic
  chain's (to float32 rounding: fp8_adam.true_div), on one device and over fsdp 8 (there
  against the sharded chain: the sharded backward's bf16 sums differ in their last bits, and
  Adam's first step nearly takes their sign)."""
  from infir2_jax import parallel  # pylint: disable=import-outside-toplevel
  from infir2_jax.train.optim import make_apply  # pylint: disable=import-outside-toplevel
  model = Qwen2(dataclasses.replace(TINY, dtype="bfloat16"))
  params = nn.unbox(init_params(model, jax.random.key(0)))
  opt_cfg = OptConfig(lr=1e-2, warmup_steps=0, clip_norm=1.0, moments="fp8",
                      moments_kernel="auto")
  tx, schedule = make_optimizer(opt_cfg, 10), make_schedule(opt_cfg, 10)
  state = {"step": jnp.int32(0), "params": params, "opt_state": tx.init(params)}
  batch = make_batch()
  run = lambda apply: jax.device_get(jax.jit(make_train_step(model, tx, schedule,
                                                             apply=apply))(state, batch))
  (chain, chain_m), (fused, fused_m) = run(None), run(make_apply(opt_cfg, 10, tx))
  close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
  jax.tree.map(close, fused["params"], chain["params"])
  close(fused_m["grad_norm"], chain_m["grad_norm"])
  assert jax.tree.structure(fused["opt_state"]) == jax.tree.structure(chain["opt_state"])
  mesh_cfg = parallel.MeshConfig(data=1, fsdp=8, tensor=1)
  mesh = parallel.make_mesh(mesh_cfg)
  rules = parallel.logical_rules(mesh_cfg, TINY, mesh)
  init = lambda key: model.init(key, jnp.zeros((1, 8), jnp.int32))["params"]
  sharded, shardings = parallel.sharded_init(init, tx, mesh, rules, jax.random.key(0))
  def run_sharded(apply):
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
      step = jax.jit(make_train_step(model, tx, schedule, apply=apply),
                     in_shardings=(shardings, parallel.batch_sharding(mesh, rules)),
                     out_shardings=(shardings, parallel.replicated(mesh)))
      return jax.device_get(step(sharded, batch))
  (want, want_m), (got, got_m) = run_sharded(None), run_sharded(make_apply(opt_cfg, 10, tx))
  jax.tree.map(close, got["params"], want["params"])
  close(got_m["grad_norm"], want_m["grad_norm"])


def test_telemetry_step_gives_the_same_bits_with_the_masters_differentiated(monkeypatch):
  """The telemetry step (FP8 stats every N steps) under INFIR2_GRAD_INPUTS=master: the
  gradients and the forward and backward statistics equal the cast copies' bit for bit; an
  unknown INFIR2_GRAD_INPUTS is named."""
  from infir2_jax.precision import telemetry  # pylint: disable=import-outside-toplevel
  from infir2_jax.train import step as step_lib  # pylint: disable=import-outside-toplevel
  cfg = dataclasses.replace(TINY, dtype="bfloat16", tie_embeddings=False, remat="full")
  model_t = Qwen2(cfg, make_dot_general_factory(
      PrecisionConfig(recipe="infir2", backend="xla"), telemetry=True))
  params = nn.unbox(init_params(model_t, jax.random.key(0)))
  sinks = telemetry.init_sinks(model_t, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
  batch = make_batch()
  got = {}
  for mode in ("cast", "master"):
    monkeypatch.setattr(step_lib, "GRAD_INPUTS", mode)
    got[mode] = jax.jit(step_lib._telemetry_grad_fn(model_t))(params, sinks, batch)  # pylint: disable=protected-access
  leaves = [jax.tree.leaves(got[m]) for m in ("cast", "master")]
  assert len(leaves[0]) == len(leaves[1]) > 10
  for a, b in zip(*leaves):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  monkeypatch.setattr(step_lib, "GRAD_INPUTS", "copies")
  with pytest.raises(ValueError, match="INFIR2_GRAD_INPUTS='copies': one of"):
    step_lib.compute_dtype_grad_fn(model_t)(params, batch)


@pytest.mark.parametrize("scan", [False, True])
def test_gradients_leave_through_a_barrier_only_where_layers_are_scanned(scan, monkeypatch):
  """INFIR2_GRAD_BARRIER "auto": the scanned model's gradients leave the backward through an
  optimization barrier (else XLA fuses their float32 conversion into the fusions that
  unstack them, float32 copies at the 7B's peak); the unrolled model's do not, so XLA fuses
  their slicing and sums into the optimizer's update (session 32). "always" and "never"
  override it, and the values are the same either way."""
  from infir2_jax.train import step as step_lib  # pylint: disable=import-outside-toplevel
  cfg = dataclasses.replace(TINY, dtype="bfloat16", scan_layers=scan)
  model = Qwen2(cfg, make_dot_general_factory(PrecisionConfig(recipe="infir2", backend="xla")))
  params = nn.unbox(init_params(model, jax.random.key(0)))
  batch = make_batch()

  def barrier_on_grads(mode):
    monkeypatch.setattr(step_lib, "GRAD_BARRIER", mode)
    fn = step_lib.compute_dtype_grad_fn(model)
    jaxpr = jax.make_jaxpr(fn)(params, batch).jaxpr
    grads_out = {id(v) for v in jaxpr.outvars[2:]}
    barriers = [e for e in jaxpr.eqns if e.primitive.name == "optimization_barrier"
                and any(id(v) in grads_out for v in e.outvars)]
    return bool(barriers), jax.jit(fn)(params, batch)

  auto, grads = barrier_on_grads("auto")
  assert auto == scan
  assert barrier_on_grads("always")[0] and not barrier_on_grads("never")[0]
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(barrier_on_grads("never")[1])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  monkeypatch.setattr(step_lib, "GRAD_BARRIER", "0")
  with pytest.raises(ValueError, match="INFIR2_GRAD_BARRIER"):
    step_lib.compute_dtype_grad_fn(model)
