"""Evaluation: held-out loss, and exact-match accuracy on math problems with final answers.

  python -m infir2_jax.inference.evaluate --workdir=runs/sft_demo [--step=N] [--limit=20]
  python -m infir2_jax.inference.evaluate --hf=DIR --workdir=runs/sft_demo   # an HF checkpoint instead

Answer extraction from a generation (`extract_answer`), first match wins:
  1. the text after the last "Final answer:" (the format of the shipped SFT data),
  2. the content of the last \\boxed{...} (balanced braces; the usual math-model format;
     none if the generation was cut off inside it),
  3. the last number in the text (integer, decimal or a/b fraction).
Matching (`answers_match`): both sides are normalised (spaces, $, trailing period, case,
\\left/\\right, \\dfrac -> \\frac, \\frac{a}{b} -> a/b, thousands separators removed); equal
strings match, and two numbers match when their values agree (0.5 == 1/2). A reference
answer with alternatives ("2*C(10, 5), or equivalently 504", "900 (i.e., all values)",
"3 is the only possible value") accepts each stated form.
"""

import json
import re
from fractions import Fraction
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from infir2_jax import errors
from infir2_jax.data.sft_sources import ANSWER_PREFIX
from infir2_jax.inference import generate as generate_lib
from infir2_jax.train.loss import cross_entropy_sums

_NUMBER = r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?"


def _last_boxed(text: str) -> str | None:
  start = text.rfind("\\boxed{")
  if start < 0:
    return None
  depth, i = 1, start + len("\\boxed{")
  for j in range(i, len(text)):
    depth += {"{": 1, "}": -1}.get(text[j], 0)
    if depth == 0:
      return text[i:j]
  return None   # unbalanced: the generation was cut off


def extract_answer(text: str) -> str | None:
  """The final answer of a generation (see the module docstring for the rules)."""
  hits = re.findall(re.escape(ANSWER_PREFIX) + r"[ \t]*(.*)", text)
  if hits and hits[-1].strip():
    return hits[-1].strip()
  if "\\boxed{" in text:
    boxed = _last_boxed(text)
    return None if boxed is None else boxed.strip()   # None: cut off inside the box
  numbers = re.findall(_NUMBER, text)
  return numbers[-1] if numbers else None


def normalize(answer: str) -> str:
  s = answer.strip().rstrip(".").strip().strip("$")
  boxed = _last_boxed(s)
  s = boxed if boxed is not None else s
  for a, b in (("\\left", ""), ("\\right", ""), ("\\!", ""), ("\\,", ""), ("\\dfrac", "\\frac"),
               ("\\tfrac", "\\frac"), ("\\cdot", "*"), ("\\times", "*"), ("\\pm", "±")):
    s = s.replace(a, b)
  s = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"(\1)/(\2)", s)
  s = re.sub(r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)", s)
  s = re.sub(r"\s+", "", s).lower()
  s = re.sub(r"\((-?[\d.]+)\)", r"\1", s)          # (3)/(4) -> 3/4
  if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):  # 1,000 -> 1000
    s = s.replace(",", "")
  return s


def _as_number(s: str) -> Fraction | None:
  try:
    return Fraction(s) if re.fullmatch(r"-?\d+(\.\d+)?(/-?\d+)?", s) else None
  except (ValueError, ZeroDivisionError):
    return None


def reference_forms(answer: str) -> list[str]:
  """The accepted forms of a reference answer (itself plus the alternatives it states)."""
  forms = [answer]
  forms += answer.split(", or equivalently ")[1:] + answer.split(", or equivalently ")[:1]
  forms += [re.sub(r"\s*\(i\.e\.,.*\)\s*$", "", answer)]
  for pattern in (r"^(.*?) is the only possible value$", r"is equal to (.*)$"):
    forms += re.findall(pattern, answer)
  return list(dict.fromkeys(f.strip() for f in forms if f.strip()))


def answers_match(predicted: str | None, reference: str) -> bool:
  if predicted is None:
    return False
  got = normalize(predicted)
  for form in reference_forms(reference):
    want = normalize(form)
    if got == want:
      return True
    a, b = _as_number(got), _as_number(want)
    if a is not None and b is not None and a == b:
      return True
  return False


def heldout_loss(model, params, batches) -> dict[str, float]:
  """Per-token loss over batches of {inputs, targets, positions, segment_ids, loss_mask}."""
  @jax.jit
  def sums(params, batch):
    logits = model.apply({"params": params}, batch["inputs"], batch["positions"],
                         batch["segment_ids"])
    return cross_entropy_sums(logits, batch["targets"], batch["loss_mask"])
  loss, tokens = 0.0, 0.0
  for batch in batches:
    s = sums(params, {k: jnp.asarray(v) for k, v in batch.items()})
    loss, tokens = loss + float(s[0]), tokens + float(s[1])
  return {"loss": loss / max(tokens, 1.0), "tokens": tokens}


def math_exact_match(model, params, tokenizer, problems: list[tuple[str, str]], *,
                     system_prompt: str, batch_size: int = 8, max_new_tokens: int = 256,
                     **sampling) -> dict[str, Any]:
  """Greedy (by default) answers to (question, answer) problems, scored by exact match.

  Prompts use the Qwen2.5 chat template exactly as in training (infir2_jax.data.chat);
  generation stops at <|im_end|> or <|endoftext|>.

  Returns:
    {"accuracy", "correct", "total", "samples": [{question, answer, generation, extracted,
    correct}]}.
  """
  from infir2_jax.data import prompt_ids, special_ids  # pylint: disable=g-import-not-at-top
  special = special_ids(tokenizer)
  stops = tuple(i for i in (special.im_end, special.eos) if i is not None)
  samples = []
  for lo in range(0, len(problems), batch_size):
    chunk = problems[lo:lo + batch_size]
    ids = [prompt_ids(tokenizer, [{"role": "user", "content": q}], system_prompt) for q, _ in chunk]
    tokens, mask = generate_lib.pad_prompts(ids, special.pad, multiple=64, batch_size=batch_size)
    out = generate_lib.generate(model, params, tokens, mask, max_new_tokens=max_new_tokens,
                                stop_ids=stops, pad_id=special.pad, **sampling)
    for (question, answer), row, n in zip(chunk, out.tokens, out.lengths):
      text = tokenizer.decode([int(t) for t in row[:n] if t not in stops])
      extracted = extract_answer(text)
      samples.append({"question": question, "answer": answer, "generation": text,
                      "extracted": extracted, "correct": answers_match(extracted, answer)})
  correct = sum(s["correct"] for s in samples)
  return {"accuracy": correct / max(len(samples), 1), "correct": correct,
          "total": len(samples), "samples": samples}


def _load(workdir: str, step: int | None, hf_dir: str):
  """(TrainConfig, model, params): the run's checkpoint, or an HF directory."""
  from infir2_jax import hf  # pylint: disable=g-import-not-at-top
  from infir2_jax.model import Qwen2, abstract_params  # pylint: disable=g-import-not-at-top
  from infir2_jax.train import rundir  # pylint: disable=g-import-not-at-top
  from infir2_jax.train.checkpoint import restore_params  # pylint: disable=g-import-not-at-top
  cfg = rundir.read_config(workdir)
  if hf_dir:
    model, params = hf.load_pretrained(hf_dir, dtype=cfg.model.dtype)
    return cfg, model, params
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device),
                          nn.unbox(abstract_params(cfg.model)))
  return cfg, Qwen2(cfg.model), restore_params(workdir, abstract, step)


def main(argv):
  from absl import flags  # pylint: disable=g-import-not-at-top
  with errors.cli_errors(flags.FLAGS.debug or errors.debug_requested()):
    _main(argv)


def _main(argv):
  from absl import flags  # pylint: disable=g-import-not-at-top
  from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top
  from infir2_jax.data import load_math_eval, make_data  # pylint: disable=g-import-not-at-top
  del argv
  absl_logging.set_verbosity(absl_logging.WARNING)   # orbax logs every read at INFO
  f = flags.FLAGS
  cfg, model, params = _load(f.workdir, None if f.step < 0 else f.step, f.hf)
  data = make_data(cfg.data, seq_len=cfg.seq_len, global_batch_size=cfg.batch_size,
                   seed=cfg.seed)
  result = {"heldout": heldout_loss(model, params, data.eval_batches(f.eval_batches))}
  problems = load_math_eval(f.split, cache_dir=cfg.data.cache_dir)[:f.limit or None]
  math = math_exact_match(model, params, data.tokenizer, problems,
                          system_prompt=cfg.data.system_prompt, batch_size=f.batch_size,
                          max_new_tokens=f.max_new_tokens)
  result["math"] = {k: math[k] for k in ("accuracy", "correct", "total")}
  for s in math["samples"][:f.show]:
    print(f"Q: {s['question'][:200]}\nA: {s['generation'][:400]}\n-> {s['extracted']!r} vs "
          f"{s['answer']!r}: {'OK' if s['correct'] else 'wrong'}\n")
  print(json.dumps(result, indent=2))
  if f.out:
    with open(f.out, "w") as fh:
      json.dump(dict(result, samples=math["samples"]), fh, indent=2)


if __name__ == "__main__":
  from absl import app, flags  # pylint: disable=g-import-not-at-top
  flags.DEFINE_string("workdir", None, "Run directory (config.json, checkpoints/).", required=True)
  flags.DEFINE_integer("step", -1, "Checkpoint step (-1 = the latest).")
  flags.DEFINE_string("hf", "", "Evaluate this HF checkpoint directory instead of the run's.")
  flags.DEFINE_integer("eval_batches", 0, "Validation batches for the held-out loss (0 = all).")
  flags.DEFINE_string("split", "heldout", "Math problems: heldout | train | all.")
  flags.DEFINE_integer("limit", 0, "Evaluate only the first N problems (0 = all).")
  flags.DEFINE_integer("batch_size", 8, "Prompts per generate call.")
  flags.DEFINE_integer("max_new_tokens", 256, "Generation budget per problem.")
  flags.DEFINE_integer("show", 3, "Print this many generations.")
  flags.DEFINE_string("out", "", "Write the results with every generation to this JSON file.")
  flags.DEFINE_bool("debug", False, "Show the traceback of a user error, not only its "
                    "`error:` line (also INFIR2_DEBUG=1).")
  app.run(main)
