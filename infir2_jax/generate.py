"""Generate text from a run's checkpoint or an HF checkpoint directory.

  python -m infir2_jax.generate --workdir=runs/default --prompt='ROMEO:' [--prompt=...]
  python -m infir2_jax.generate --workdir=runs/sft_demo1 --prompt='What is 7 * 8?'  # chat run
  python -m infir2_jax.generate --hf=runs/sft_demo1/hf --chat --prompt='What is 7 * 8?'
  ... [--max_new_tokens=64] [--temperature=0.8 --top_p=0.95 --top_k=50 --seed=1] [--step=N]
      [--json]   # one {"prompt", "completion"} object per line

A run's prompts are chat turns (the Qwen2.5 template of its training data) when it trained on
chat data, plain text otherwise; --chat / --nochat decide for an HF directory (default: chat
when its tokenizer_config.json has a chat template). Greedy unless --temperature > 0.
The library behind it: infir2_jax.inference.generate.
"""

import dataclasses
import json
import os

import flax.linen as nn
import jax

from infir2_jax import errors, hf
from infir2_jax.data import load_tokenizer, prompt_ids, special_ids
from infir2_jax.inference import generate as generate_lib
from infir2_jax.model import Qwen2, abstract_params
from infir2_jax.parallel import distributed
from infir2_jax.train import rundir
from infir2_jax.train.checkpoint import restore_params


@dataclasses.dataclass
class Generator:
  """A model, its params and tokenizer, and how prompts are rendered."""
  model: Qwen2
  params: object
  tokenizer: object
  chat: bool
  system_prompt: str
  source: str      # what was loaded, for the console


def from_run(workdir: str, step: int | None = None) -> Generator:
  """The run's checkpoint (latest, or `step`) with the tokenizer and template it trained with."""
  cfg = rundir.read_config(workdir)
  _, step = rundir.checkpoint_item(workdir, step)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device),
                          nn.unbox(abstract_params(cfg.model)))
  params = restore_params(workdir, abstract, step)
  tokenizer = load_tokenizer(cfg.data.tokenizer, cache_dir=cfg.data.cache_dir)
  return Generator(Qwen2(cfg.model), params, tokenizer, cfg.data.format == "chat",
                   cfg.data.system_prompt, f"{workdir} step {step}")


def from_hf(path: str, chat: bool | None = None, system_prompt: str = "") -> Generator:
  """An HF checkpoint directory (bf16 or block-scaled FP8) with its tokenizer.json."""
  model, params = hf.load_pretrained(path, dtype="bfloat16")
  if chat is None:
    config_file = os.path.join(path, "tokenizer_config.json")
    chat = os.path.isfile(config_file) and "chat_template" in json.load(open(config_file))
  return Generator(model, params, load_tokenizer(path), chat, system_prompt, path)


def complete(gen: Generator, prompts: list[str], **sampling) -> list[str]:
  """One completion per prompt (the stop token left out). sampling: generate's arguments."""
  special = special_ids(gen.tokenizer)
  if gen.chat:
    ids = [prompt_ids(gen.tokenizer, [{"role": "user", "content": p}], gen.system_prompt)
           for p in prompts]
  else:
    ids = [gen.tokenizer.encode(p, add_special_tokens=False).ids for p in prompts]
  stops = tuple(i for i in (special.im_end, special.eos) if i is not None)
  tokens, mask = generate_lib.pad_prompts([list(i) for i in ids], special.pad)
  out = generate_lib.generate(gen.model, gen.params, tokens, mask, stop_ids=stops,
                              pad_id=special.pad, **sampling)
  return [gen.tokenizer.decode([int(t) for t in row[:n] if t not in stops])
          for row, n in zip(out.tokens, out.lengths)]


def main(argv):
  from absl import flags  # pylint: disable=g-import-not-at-top
  with errors.cli_errors(flags.FLAGS.debug or errors.debug_requested()):
    _main(argv)


def _main(argv):
  from absl import flags  # pylint: disable=g-import-not-at-top
  from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top
  if len(argv) > 1:
    raise SystemExit(f"error: unexpected arguments {argv[1:]}; prompts go in --prompt=...")
  f = flags.FLAGS
  if bool(f.workdir) == bool(f.hf):
    raise SystemExit("error: give exactly one of --workdir (a run) and --hf (an HF directory)")
  if not f.prompt:
    raise SystemExit("error: give at least one --prompt='...'")
  absl_logging.set_verbosity(absl_logging.WARNING)   # orbax logs every read at INFO
  distributed.enable_compilation_cache()
  chat = None if f["chat"].using_default_value else f.chat
  gen = (from_run(f.workdir, None if f.step < 0 else f.step) if f.workdir
         else from_hf(f.hf, chat, f.system_prompt))
  if f.workdir and chat is not None:
    gen.chat = chat
  sampling = dict(max_new_tokens=f.max_new_tokens, temperature=f.temperature, top_p=f.top_p,
                  top_k=f.top_k, rng=jax.random.key(f.seed))
  completions = complete(gen, list(f.prompt), **sampling)
  if f.json:
    for prompt, text in zip(f.prompt, completions):
      print(json.dumps({"prompt": prompt, "completion": text}), flush=True)
    return
  print(f"# {gen.source}, {'chat' if gen.chat else 'text'} prompts, "
        + ("greedy" if f.temperature == 0 else f"temperature {f.temperature}"), flush=True)
  for prompt, text in zip(f.prompt, completions):
    print(f">>> {prompt}\n{text}\n", flush=True)


def _define_flags():
  from absl import flags  # pylint: disable=g-import-not-at-top
  flags.DEFINE_string("workdir", "", "Run directory (config.json + checkpoints/).")
  flags.DEFINE_integer("step", -1, "Checkpoint step of --workdir (-1 = the latest).")
  flags.DEFINE_string("hf", "", "An HF checkpoint directory instead of a run.")
  flags.DEFINE_multi_string("prompt", [], "A prompt; repeat the flag for several.")
  flags.DEFINE_bool("chat", False, "Render prompts as a user turn of the chat template "
                    "(default: as the run trained / as the HF tokenizer has a template).")
  flags.DEFINE_string("system_prompt", "", "The chat's system turn for --hf (a run uses its own).")
  flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate per prompt.")
  flags.DEFINE_float("temperature", 0.0, "0 = greedy; else sample softmax(logits / T).")
  flags.DEFINE_float("top_p", 1.0, "Nucleus sampling: keep the most likely tokens up to p.")
  flags.DEFINE_integer("top_k", 0, "Keep the k most likely tokens (0 = all).")
  flags.DEFINE_integer("seed", 0, "Sampling seed.")
  flags.DEFINE_bool("json", False, "Print one JSON object {prompt, completion} per line.")
  flags.DEFINE_bool("debug", False, "Show the traceback of a user error, not only its "
                    "`error:` line (also INFIR2_DEBUG=1).")


if __name__ == "__main__":
  from absl import app  # pylint: disable=g-import-not-at-top
  _define_flags()
  app.run(main)
