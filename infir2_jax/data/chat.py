"""Chat records -> Qwen2.5 chat template -> token ids with an assistant-token mask.

Qwen2.5's template (no tools): if the first message is not a system message, a system
turn with the default prompt is inserted; then every message is rendered as
`<|im_start|>{role}\\n{content}<|im_end|>\\n`. The loss covers each assistant turn's content
and its closing <|im_end|>, nothing else.

We encode the text between special tokens piece by piece (which is what HF tokenizers do
with a rendered string: added tokens are split out first) and insert the special ids
ourselves, so a literal "<|im_end|>" inside a message stays text and cannot forge a turn.
The mask comes from token offsets; a token that straddles the header's "\\n" and the
content (content starting with a newline) carries no loss.
"""

from typing import Any

import numpy as np
import tokenizers

from infir2_jax.data import tokenizer as tokenizer_lib
from infir2_jax.data.config import QWEN_SYSTEM_PROMPT
from infir2_jax.data.tokenizer import SpecialIds

ROLES = ("system", "user", "assistant")


def validate(record: Any, messages_key: str = "messages") -> tuple[list[dict] | None, str]:
  """Returns (messages, "") for a good record, (None, reason) for a bad one."""
  if not isinstance(record, dict) or not isinstance(record.get(messages_key), list):
    return None, f"not a conversation: no {messages_key!r} list"
  messages = record[messages_key]
  if not messages:
    return None, "not a conversation: no messages"
  for i, m in enumerate(messages):
    if not isinstance(m, dict) or "role" not in m or "content" not in m:
      return None, f"bad message: message {i} is not an object with 'role' and 'content'"
    if m["role"] not in ROLES:
      return None, f"unknown role: {str(m['role'])[:20]!r} (valid: {', '.join(ROLES)})"
    if not isinstance(m["content"], str):
      return None, f"content not a string: message {i} is {type(m['content']).__name__}"
    if not m["content"].strip():
      return None, f"empty content: message {i} ({m['role']})"
  if not any(m["role"] == "assistant" for m in messages):
    return None, "no assistant turn"
  return [{"role": m["role"], "content": m["content"]} for m in messages], ""


def with_system(messages: list[dict], system_prompt: str) -> list[dict]:
  """Inserts the default system turn, as Qwen2.5's template does, unless one exists."""
  if system_prompt and (not messages or messages[0]["role"] != "system"):
    return [{"role": "system", "content": system_prompt}] + list(messages)
  return list(messages)


def render(messages: list[dict], system_prompt: str,
           add_generation_prompt: bool = False) -> str:
  """The Qwen2.5 chat template as a string (for display and reference)."""
  out = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
                for m in with_system(messages, system_prompt))
  return out + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def chat_template(system_prompt: str = QWEN_SYSTEM_PROMPT) -> str:
  """A jinja chat template equal to `render` (for tokenizer_config.json of an HF export)."""
  head = ""
  if system_prompt:
    head = ("{%- if not messages or messages[0]['role'] != 'system' %}{{- '<|im_start|>system\\n"
            + system_prompt.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n")
            + "<|im_end|>\\n' }}{%- endif %}")
  return (head + "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + "
          "'\\n' + message['content'] + '<|im_end|>\\n' }}{%- endfor %}"
          "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def encode(tok: tokenizers.Tokenizer, special: SpecialIds, conversations: list[list[dict]],
           system_prompt: str) -> list[tuple[np.ndarray, np.ndarray]]:
  """Token ids and loss masks of whole conversations.

  Args:
    tok: a tokenizer that encodes special-token strings as text (`literal_copy`).
    special: ids of <|im_start|>/<|im_end|>.
    conversations: validated message lists.
    system_prompt: inserted when a conversation has no system turn ("" = none).

  Returns:
    Per conversation (ids uint32 [n], mask uint8 [n]); mask is 1 on assistant content
    tokens and on the <|im_end|> closing an assistant turn.
  """
  if special.im_start is None or special.im_end is None:
    raise ValueError("chat data needs a tokenizer with <|im_start|> and <|im_end|> tokens")
  turns = [with_system(c, system_prompt) for c in conversations]
  pieces = [f"{m['role']}\n{m['content']}" for t in turns for m in t]
  encodings = tok.encode_batch(pieces, add_special_tokens=False) if pieces else []
  newline = tok.encode("\n", add_special_tokens=False).ids
  out, k = [], 0
  for t in turns:
    ids, mask = [], []
    for m in t:
      enc = encodings[k]
      k += 1
      body = len(m["role"]) + 1  # content starts after "role\n"
      trained = m["role"] == "assistant"
      ids.append(special.im_start)
      mask.append(0)
      ids.extend(enc.ids)
      mask.extend(int(trained and start >= body) for start, _ in enc.offsets)
      ids.append(special.im_end)
      mask.append(int(trained))
      ids.extend(newline)
      mask.extend([0] * len(newline))
    out.append((np.asarray(ids, np.uint32), np.asarray(mask, np.uint8)))
  return out


def encode_prompt(tok: tokenizers.Tokenizer, special: SpecialIds, messages: list[dict],
                  system_prompt: str) -> np.ndarray:
  """Ids of a conversation followed by `<|im_start|>assistant\\n` (for generation)."""
  ids = encode(tok, special, [messages], system_prompt)[0][0]
  head = tok.encode("assistant\n", add_special_tokens=False).ids
  return np.concatenate([ids, np.asarray([special.im_start] + head, np.uint32)]).astype(np.int32)


def prompt_ids(tok: tokenizers.Tokenizer, messages: list[dict],
               system_prompt: str = QWEN_SYSTEM_PROMPT) -> np.ndarray:
  """int32 ids to generate the next assistant turn from; stop at `special_ids(tok).im_end`.

  Example: `prompt_ids(data.tokenizer, [{"role": "user", "content": question}])`.
  """
  return encode_prompt(tokenizer_lib.literal_copy(tok), tokenizer_lib.special_ids(tok),
                       messages, system_prompt)
