"""Every config key with its default and meaning, read from the config dataclasses' comments.

The comments next to each field (or the class docstring's Attributes section) are the keys'
documentation; `python -m infir2_jax.train --help` lists them all, so nobody has to open
the source to find a key.
"""

import ast
import dataclasses
import functools
import inspect
import io
import re
import textwrap
import tokenize
import typing

from infir2_jax.config import TrainConfig
from infir2_jax.precision.recipes import recipe_names


def _attributes(docstring: str | None) -> dict[str, str]:
  """{name: text} of a Google-style docstring's "Attributes:" section ("a, b: text" too)."""
  out: dict[str, str] = {}
  names, indent = None, None
  lines = (docstring or "").splitlines()
  start = next((i + 1 for i, l in enumerate(lines) if l.strip() == "Attributes:"), len(lines))
  for line in lines[start:]:
    depth = len(line) - len(line.lstrip())
    if not line.strip() or (indent is not None and depth < indent):
      break
    m = re.match(r"\s*(\w+(?:,\s*\w+)*):\s*(.*)", line)
    if m and (indent is None or depth == indent):
      indent, names = depth, [n.strip() for n in m.group(1).split(",")]
      out.update({n: m.group(2).strip() for n in names})
    elif names:
      out.update({n: f"{out[n]} {line.strip()}" for n in names})
  return out


@functools.cache
def field_docs(cls) -> dict[str, str]:
  """{field: its comment} of a dataclass: the comments above a field and on its line, else
  the docstring's Attributes entry."""
  source = textwrap.dedent(inspect.getsource(cls))
  lines = source.splitlines()
  comments = {tok.start[0]: tok.string.lstrip("#").strip()
              for tok in tokenize.generate_tokens(io.StringIO(source).readline)
              if tok.type == tokenize.COMMENT}
  classdef = ast.parse(source).body[0]
  attributes = _attributes(ast.get_docstring(classdef))
  docs = {}
  for node in classdef.body:
    if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
      continue
    above, line = [], node.lineno - 1
    while line >= 1 and lines[line - 1].strip().startswith("#"):
      above.insert(0, comments.get(line, ""))
      line -= 1
    trailing = [comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments]
    text = " ".join(above + trailing) or attributes.get(node.target.id, "")
    docs[node.target.id] = text
  return docs


def config_keys(cls=TrainConfig, prefix: str = "", obj=None) -> list[tuple[str, object, str]]:
  """[(dotted key, default, comment)] of every leaf field, in declaration order."""
  obj = cls() if obj is None else obj
  hints = typing.get_type_hints(cls)
  docs = field_docs(cls)
  out = []
  for field in dataclasses.fields(cls):
    value = getattr(obj, field.name)
    if dataclasses.is_dataclass(hints[field.name]):
      out += config_keys(hints[field.name], f"{prefix}{field.name}.", value)
    else:
      out.append((prefix + field.name, value, docs.get(field.name, "")))
  return out


def reference(width: int = 100) -> str:
  """The --help text of the config keys: one entry per key, wrapped at `width`."""
  lines = ["Config keys: --config.KEY=VALUE (defaults as in configs/default.py; a config file "
           "changes some):"]
  for key, default, doc in config_keys():
    head = f"  --config.{key}={default!r}"
    lines.append(textwrap.fill(doc, width, initial_indent=f"{head}  ", subsequent_indent=" " * 6,
                               break_long_words=False) if doc else head)
  lines.append(textwrap.fill(
      "Precision recipes (--config.precision.recipe=NAME, and NAME in precision.overrides): "
      + ", ".join(recipe_names()), width, subsequent_indent="  "))
  return "\n".join(lines) + "\n"
