"""KV-cache generation: equals the full forward, full recomputation, and transformers' generate."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infir2_jax.inference import generate as gen
from infir2_jax import hf

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf_tiny")
TIED = os.path.join(FIXTURES, "qwen2_tied")
UNTIED = os.path.join(FIXTURES, "qwen2_untied")   # its greedy continuations do not repeat
N = 10   # new tokens in every generate call (one compilation per prompt shape)


@pytest.fixture(scope="module")
def untied():
  return hf.load_pretrained(UNTIED)


def logits_of(model, params, tokens_BxL):
  """The model's full forward, jitted (eager dispatch is slow on CPU)."""
  return np.asarray(jax.jit(model.apply)({"params": params}, jnp.asarray(tokens_BxL)))


def right_padded(lengths=(5, 9, 3), seed=0):
  rs = np.random.RandomState(seed)
  prompts = [rs.randint(3, 512, n).tolist() for n in lengths]
  tokens = np.zeros((len(prompts), max(lengths)), np.int32)
  mask = np.zeros_like(tokens)
  for b, p in enumerate(prompts):
    tokens[b, :len(p)], mask[b, :len(p)] = p, 1
  return prompts, tokens, mask


@pytest.mark.parametrize("path", [TIED, UNTIED], ids=["tied", "untied"])
def test_incremental_logits_equal_full_forward(path):
  """Prefill 4 tokens (one row left-padded by 2), then feed 6 one at a time."""
  model, params = hf.load_pretrained(path)
  seq = np.random.RandomState(1).randint(0, 512, (2, 10))
  full = logits_of(model, params, seq)
  full_row1 = logits_of(model, params, seq[1:, 2:])
  prompt = seq[:, :4].copy()
  prompt[1, :2] = 0                       # row 1: 2 pads, then seq[1, 2:4]
  lengths = np.array([4, 2])
  cache = gen.init_cache(model, 2, 10)
  step = jax.jit(gen.decode_step, static_argnums=0)
  positions = np.array([[0, 1, 2, 3], [0, 0, 0, 1]])
  segments = np.array([[1, 1, 1, 1], [0, 0, 1, 1]])   # pad slots: segment 0
  logits, cache = step(model, params, cache, jnp.asarray(prompt), jnp.asarray(positions),
                       jnp.asarray(segments))
  np.testing.assert_allclose(logits[0], full[0, 3], atol=1e-5)
  np.testing.assert_allclose(logits[1], full_row1[0, 1], atol=1e-5)
  for t in range(4, 10):
    logits, cache = step(model, params, cache, jnp.asarray(seq[:, t:t + 1]),
                         jnp.asarray(lengths[:, None] + t - 4), jnp.ones((2, 1), jnp.int32))
    np.testing.assert_allclose(logits[0], full[0, t], atol=1e-5)
    np.testing.assert_allclose(logits[1], full_row1[0, t - 2], atol=1e-5)


def greedy_by_recomputation(model, params, prompt, steps, width=32):
  """Greedy decoding that runs the whole model on the whole sequence for every token."""
  forward = jax.jit(model.apply)
  buf = np.zeros((1, width), np.int32)   # one shape for every call; causal: the zeros after
  buf[0, :len(prompt)] = prompt          # position t do not change the logits at t
  for t in range(len(prompt), len(prompt) + steps):
    buf[0, t] = int(np.argmax(forward({"params": params}, jnp.asarray(buf))[0, t - 1]))
  return buf[0, len(prompt):len(prompt) + steps].tolist()


def test_greedy_with_cache_equals_full_recomputation(untied):
  model, params = untied
  prompts, tokens, mask = right_padded()
  out = gen.generate(model, params, tokens, mask, max_new_tokens=N)
  assert out.tokens.shape == (3, N) and list(out.lengths) == [N] * 3 and not out.finished.any()
  for b, prompt in enumerate(prompts):
    assert out.tokens[b].tolist() == greedy_by_recomputation(model, params, prompt, N)
  assert len(set(out.tokens[0].tolist())) > 3   # a continuation that actually varies


def test_left_and_right_padding_agree(untied):
  model, params = untied
  _, tokens, mask = right_padded()
  left, _ = gen.left_align(tokens, mask)
  left_mask = (left != 0).astype(np.int32)
  a = gen.generate(model, params, tokens, mask, max_new_tokens=N)
  b = gen.generate(model, params, left, left_mask, max_new_tokens=N)
  np.testing.assert_array_equal(a.tokens, b.tokens)


def test_greedy_and_stop_tokens_equal_transformers_generate(untied):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  model, params = untied
  _, tokens, mask = right_padded()
  free = gen.generate(model, params, tokens, mask, max_new_tokens=N)
  stop = int(free.tokens[1, 4])            # row 1 must stop at its 5th token
  out = gen.generate(model, params, tokens, mask, max_new_tokens=N, stop_ids=(stop,), pad_id=0)
  first = np.argmax(free.tokens[1] == stop)
  assert out.finished[1] and out.lengths[1] == first + 1
  assert (out.tokens[1, first + 1:] == 0).all()
  np.testing.assert_array_equal(out.tokens[1, :first + 1], free.tokens[1, :first + 1])

  left, lengths = gen.left_align(tokens, mask)
  attention = (np.arange(left.shape[1])[None] >= left.shape[1] - lengths[:, None])
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(UNTIED, dtype=torch.float32)
  with torch.no_grad():
    theirs = hf_model.generate(
        torch.tensor(left, dtype=torch.long),
        attention_mask=torch.tensor(attention.astype(np.int64)),
        max_new_tokens=N, do_sample=False, eos_token_id=stop, pad_token_id=0)
  theirs = theirs[:, left.shape[1]:].numpy()
  theirs = np.pad(theirs, ((0, 0), (0, N - theirs.shape[1])))   # HF stops when all rows stop
  np.testing.assert_array_equal(out.tokens, theirs)


def test_sampling_is_reproducible_and_degenerates_to_greedy(untied):
  model, params = untied
  _, tokens, mask = right_padded()
  greedy = gen.generate(model, params, tokens, mask, max_new_tokens=N).tokens
  kw = dict(max_new_tokens=N, temperature=1.0, rng=jax.random.key(3))
  a = gen.generate(model, params, tokens, mask, top_p=0.9, top_k=50, **kw).tokens
  b = gen.generate(model, params, tokens, mask, top_p=0.9, top_k=50, **kw).tokens
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, greedy)
  np.testing.assert_array_equal(gen.generate(model, params, tokens, mask, top_k=1, **kw).tokens,
                                greedy)


def test_top_k_and_top_p_keep_the_right_tokens():
  logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]] * 4000))
  rng = jax.random.key(0)
  top_p = np.asarray(gen.sample_logits(logits, rng, 1.0, top_p=0.7))
  assert set(top_p.tolist()) == {0, 1}     # 0.5 < 0.7 so token 1 is needed; 0.8 >= 0.7 stops
  np.testing.assert_allclose(np.mean(top_p == 0), 0.5 / 0.8, atol=0.03)
  top_k = np.asarray(gen.sample_logits(logits, rng, 1.0, top_k=3))
  assert set(top_k.tolist()) == {0, 1, 2}
  np.testing.assert_allclose(np.mean(top_k == 2), 0.15 / 0.95, atol=0.03)
  plain = np.asarray(gen.sample_logits(logits, rng, 1.0))
  np.testing.assert_allclose(np.bincount(plain, minlength=4) / 4000, [0.5, 0.3, 0.15, 0.05],
                             atol=0.03)


def test_bad_prompts_are_rejected():
  with pytest.raises(ValueError, match="padding between real tokens"):
    gen.left_align(np.ones((1, 4)), np.array([[1, 0, 1, 1]]))
  with pytest.raises(ValueError, match="empty"):
    gen.left_align(np.ones((2, 4)), np.array([[1, 1, 0, 0], [0, 0, 0, 0]]))
