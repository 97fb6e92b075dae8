"""Input pipelines: pre-training and chat/SFT data, tokenizers, the embedded default corpus."""

from infir2_jax.data.chat import chat_template, prompt_ids
from infir2_jax.data.chat import render as render_chat
from infir2_jax.data.config import DataConfig
from infir2_jax.data.sft_sources import load_math_eval
from infir2_jax.data.tokenizer import SpecialIds, load_tokenizer, special_ids

__all__ = [
    "Data", "DataConfig", "SpecialIds", "chat_template", "load_math_eval", "load_tokenizer",
    "make_data", "prompt_ids", "render_chat", "special_ids",
]


def __getattr__(name: str):
  # The pipeline imports grain (and with it JAX), seconds that prepare's tokenizing worker
  # processes, which import this package, do not need.
  if name in ("Data", "make_data"):
    from infir2_jax.data import pipeline  # pylint: disable=g-import-not-at-top
    return getattr(pipeline, name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
