"""Autoregressive generation with the model's KV cache: greedy or temperature/top-k/top-p, jitted.

The decoding forward is the model itself (Qwen2 with decode=True and its "cache" collection);
this module pads and aligns prompts, samples and runs the loop. tests/test_generate.py checks
it against the full forward of `Qwen2` and against transformers' `generate`.

Prompts are left-aligned internally (right- or left-padded input both work): row b's real
tokens end at slot P-1, pad slots carry segment id 0 (real tokens 1), so no real token
attends to them, and positions count real tokens only: every row sees exactly what it would
see alone. Then each step writes one token at slot P+t of the cache for all rows at once.

Shape legend: B batch, P prompt slots, S cache slots (P + N), N new tokens, V vocabulary.
"""

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from infir2_jax.model import Qwen2


@dataclasses.dataclass(frozen=True)
class GenerateOutput:
  tokens: np.ndarray      # [B, N] generated ids (the stop token included), pad_id after a stop
  lengths: np.ndarray     # [B] generated tokens per row, the stop token included
  finished: np.ndarray    # [B] whether the row stopped at a stop token (else hit N)


def init_cache(model: Qwen2, batch: int, slots: int):
  """Zero KV caches of `slots` positions for `batch` rows (shapes from an abstract init)."""
  shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((batch, slots),
                                                                          jnp.int32),
                                             decode=True))["cache"]
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def decode_step(model: Qwen2, params, cache, tokens_BxT, positions_BxT, segment_ids_BxT):
  """Feeds T tokens at the cache's next slots; returns (logits_BxV float32 of the last, cache)."""
  hidden_BxTxD, variables = model.apply(
      {"params": params, "cache": cache}, tokens_BxT, positions_BxT, segment_ids_BxT,
      return_hidden=True, decode=True, mutable=["cache"])
  logits_BxV = model.head_logits(params, hidden_BxTxD[:, -1])
  return logits_BxV.astype(jnp.float32), variables["cache"]


def sample_logits(logits_BxV, rng, temperature: float = 0.0, top_p: float = 1.0,
                  top_k: int = 0):
  """Next tokens [B]: argmax if temperature == 0, else a draw from the filtered softmax.

  top_k keeps the k largest logits; top_p keeps the smallest set of most likely tokens whose
  probability reaches top_p (the most likely token always stays).
  """
  if temperature == 0.0:
    return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
  logits = logits_BxV.astype(jnp.float32) / temperature
  if top_k > 0:
    kth_Bx1 = jax.lax.top_k(logits, top_k)[0][:, -1:]
    logits = jnp.where(logits < kth_Bx1, -jnp.inf, logits)
  if top_p < 1.0:
    sorted_BxV = jnp.sort(logits, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(sorted_BxV, axis=-1)
    keep = (jnp.cumsum(probs, axis=-1) - probs) < top_p   # mass before this token < top_p
    threshold_Bx1 = jnp.min(jnp.where(keep, sorted_BxV, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits < threshold_Bx1, -jnp.inf, logits)
  return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("model", "max_new_tokens", "temperature", "top_p",
                                             "top_k"))
def _generate(model, params, prompt_BxP, lengths_B, rng, stop_ids, pad_id, *, max_new_tokens,
              temperature, top_p, top_k):
  batch, prompt_len = prompt_BxP.shape
  slots = prompt_len + max_new_tokens
  first_real_B = prompt_len - lengths_B
  segment_ids_BxP = (jnp.arange(prompt_len)[None, :] >= first_real_B[:, None]).astype(jnp.int32)
  positions_BxP = jnp.maximum(jnp.arange(prompt_len)[None, :] - first_real_B[:, None], 0)
  cache = init_cache(model, batch, slots)
  logits_BxV, cache = decode_step(model, params, cache, prompt_BxP, positions_BxP,
                                  segment_ids_BxP)

  def cond(carry):
    t, done_B = carry[0], carry[-1]
    return (t < max_new_tokens) & ~jnp.all(done_B)

  def body(carry):
    t, rng, logits_BxV, cache, out_BxN, done_B = carry
    rng, step_rng = jax.random.split(rng)
    token_B = jnp.where(done_B, pad_id, sample_logits(logits_BxV, step_rng, temperature, top_p,
                                                      top_k))
    out_BxN = out_BxN.at[:, t].set(token_B)
    done_B = done_B | jnp.isin(token_B, stop_ids)
    logits_BxV, cache = decode_step(model, params, cache, token_B[:, None],
                                    (lengths_B + t)[:, None], jnp.ones((batch, 1), jnp.int32))
    return t + 1, rng, logits_BxV, cache, out_BxN, done_B

  out_BxN = jnp.full((batch, max_new_tokens), pad_id, jnp.int32)
  carry = (jnp.int32(0), rng, logits_BxV, cache, out_BxN, jnp.zeros((batch,), jnp.bool_))
  carry = jax.lax.while_loop(cond, body, carry)
  out_BxN = carry[-2]
  is_stop_BxN = jnp.isin(out_BxN, stop_ids)
  finished_B = jnp.any(is_stop_BxN, axis=1)
  lengths_out_B = jnp.where(finished_B, jnp.argmax(is_stop_BxN, axis=1) + 1, max_new_tokens)
  # Rows finished early never wrote their tail: it is still pad_id.
  return out_BxN, lengths_out_B, finished_B


def left_align(prompt_BxP: np.ndarray, mask_BxP: np.ndarray, pad_id: int = 0):
  """Moves each row's real tokens (one contiguous run, left- or right-padded) to the right end.

  Returns (tokens_BxP, lengths_B).
  """
  prompt_BxP, mask_BxP = np.asarray(prompt_BxP), np.asarray(mask_BxP).astype(bool)
  if prompt_BxP.shape != mask_BxP.shape or prompt_BxP.ndim != 2:
    raise ValueError(f"prompt {prompt_BxP.shape} and mask {mask_BxP.shape} must be equal [B, P]")
  lengths_B = mask_BxP.sum(axis=1)
  if np.any(lengths_B == 0):
    raise ValueError(f"prompt rows {np.flatnonzero(lengths_B == 0).tolist()} are empty; every "
                     "row needs at least one token")
  out = np.full_like(prompt_BxP, pad_id)
  for b, (row, m) in enumerate(zip(prompt_BxP, mask_BxP)):
    idx = np.flatnonzero(m)
    if idx[-1] - idx[0] + 1 != len(idx):
      raise ValueError(f"prompt row {b} has padding between real tokens (mask {m.astype(int)}); "
                       "only left or right padding is supported")
    out[b, out.shape[1] - len(idx):] = row[idx]
  return out, lengths_B.astype(np.int32)


def generate(model: Qwen2, params: Any, prompt_BxP, prompt_mask_BxP=None, *,
             max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
             top_k: int = 0, stop_ids: tuple[int, ...] = (), pad_id: int = 0,
             rng: jax.Array | None = None) -> GenerateOutput:
  """Generates up to max_new_tokens per prompt with a KV cache, in one jitted loop.

  Args:
    model: the Qwen2 module (its config and dot_general factory are used).
    params: its params.
    prompt_BxP: int token ids; with prompt_mask_BxP (1 = real token) rows may be left- or
      right-padded. Without a mask every slot is real.
    max_new_tokens: N, the length of the output.
    temperature: 0 = greedy; else sample from softmax(logits / temperature).
    top_p, top_k: nucleus and top-k filtering (1.0 / 0 = off); only when sampling.
    stop_ids: tokens that end a row (e.g. <|im_end|> and <|endoftext|>); kept in the output.
    pad_id: written after a row stops.
    rng: PRNG key for sampling (default key 0).

  Returns:
    GenerateOutput (numpy) with tokens [B, N], lengths [B], finished [B].
  """
  if max_new_tokens <= 0:
    raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
  if temperature < 0 or not 0.0 < top_p <= 1.0 or top_k < 0:
    raise ValueError(f"need temperature >= 0, 0 < top_p <= 1, top_k >= 0; got "
                     f"{temperature}, {top_p}, {top_k}")
  prompt_BxP = np.asarray(prompt_BxP)
  mask = np.ones_like(prompt_BxP) if prompt_mask_BxP is None else prompt_mask_BxP
  tokens_BxP, lengths_B = left_align(prompt_BxP, mask, pad_id)
  rng = jax.random.key(0) if rng is None else rng
  # Stop ids and pad id are traced (padded to 4 ids), so changing them does not recompile.
  padded = max(4, -(-len(stop_ids) // 4) * 4)
  stops = [int(i) for i in stop_ids] + [-1] * (padded - len(stop_ids))
  out, lengths, finished = _generate(
      model, params, jnp.asarray(tokens_BxP, jnp.int32), jnp.asarray(lengths_B), rng,
      jnp.asarray(stops, jnp.int32), jnp.int32(pad_id), max_new_tokens=int(max_new_tokens),
      temperature=float(temperature), top_p=float(top_p), top_k=int(top_k))
  return GenerateOutput(np.asarray(out), np.asarray(lengths), np.asarray(finished))


def pad_prompts(prompts: list, pad_id: int, multiple: int = 32, batch_size: int = 0):
  """Left-pads id lists into (tokens_BxP, mask_BxP), P rounded up to a multiple.

  Rounding P (and filling the batch to batch_size with copies of the first prompt) lets
  batches of similar length share one compilation.
  """
  prompts = list(prompts) + [prompts[0]] * max(0, batch_size - len(prompts))
  width = -(-max(len(p) for p in prompts) // multiple) * multiple
  tokens = np.full((len(prompts), width), pad_id, np.int32)
  mask = np.zeros((len(prompts), width), np.int32)
  for b, row in enumerate(prompts):
    tokens[b, width - len(row):], mask[b, width - len(row):] = row, 1
  return tokens, mask


def generate_text(model: Qwen2, params, tokenizer, prompts: list[str], **kwargs) -> list[str]:
  """Tokenizes prompts (a `tokenizers.Tokenizer`), generates, decodes without the stop token.

  kwargs go to `generate` (max_new_tokens, stop_ids, pad_id, temperature, ...).
  """
  ids = [tokenizer.encode(p, add_special_tokens=False).ids for p in prompts]
  tokens, mask = pad_prompts(ids, kwargs.setdefault("pad_id", 0))
  out = generate(model, params, tokens, mask, **kwargs)
  stops = set(kwargs.get("stop_ids", ()))
  return [tokenizer.decode([int(t) for t in row[:n] if t not in stops])
          for row, n in zip(out.tokens, out.lengths)]
