"""The package's import graph: no circles, and each part imports only the parts below it.

Every `import` in infir2_jax counts, also those inside functions (a lazy import is still a
dependency). The parts, lowest first (README.md, "Where things are"):

  errors                              (the user-error types; imports nothing)
  precision (kernels at its bottom)   data
  model, parallel                     (precision)
  hf                                  (model, data, precision)
  config                              (the sections' owners)
  train                               (config and everything under it)
  inference, export, generate,        (train and below)
  ablation, bench
"""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "infir2_jax"

# part -> the parts it may import (besides itself)
ALLOWED = {
    "errors": set(),
    "precision": set(),
    "data": set(),
    "model": {"precision"},
    "parallel": {"precision"},
    "hf": {"model", "data", "precision"},
    "config": {"model", "data", "precision", "parallel"},
    "train": {"config", "model", "data", "precision", "parallel", "hf"},
    "inference": {"train", "config", "model", "data", "precision", "hf"},
    "export": {"train", "config", "model", "data", "hf"},
    "generate": {"inference", "train", "model", "data", "hf", "parallel"},
    "ablation": {"train", "config"},
    "bench": {"train", "config", "model", "data", "precision", "parallel"},
}
# The user-error types (errors.py) sit below everything: any part may raise them.
for _part_name in ALLOWED:
  if _part_name != "errors":
    ALLOWED[_part_name].add("errors")
# Finer rules inside a part: module prefix -> the only package modules it may import.
KERNELS = f"{PACKAGE}.precision.kernels"
ONLY = {KERNELS: (KERNELS, f"{PACKAGE}.precision.formats")}
# The model knows neither the mesh nor the kernels (precision gets the axes it needs as data).
NEVER = {f"{PACKAGE}.model": (f"{PACKAGE}.parallel", KERNELS)}


def _module_files() -> dict[str, str]:
  """{dotted module name: path} of every module of the package."""
  out = {}
  for dirpath, _, files in os.walk(os.path.join(ROOT, PACKAGE)):
    for f in files:
      if f.endswith(".py"):
        rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[:-3].split(os.sep)
        if rel[-1] == "__init__":
          rel = rel[:-1]
        out[".".join(rel)] = os.path.join(dirpath, f)
  return out


MODULES = _module_files()


def _imports(path: str) -> set[str]:
  """Package modules that the file at `path` imports (`from pkg import mod` -> pkg.mod)."""
  out = set()
  for node in ast.walk(ast.parse(open(path).read())):
    if isinstance(node, ast.Import):
      out |= {a.name for a in node.names if a.name.split(".")[0] == PACKAGE}
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      if node.module.split(".")[0] != PACKAGE:
        continue
      for alias in node.names:
        sub = f"{node.module}.{alias.name}"
        out.add(sub if sub in MODULES else node.module)
  return out


GRAPH = {name: {m for m in _imports(path) if m != name} for name, path in MODULES.items()}


def _part(module: str) -> str | None:
  parts = module.split(".")
  return parts[1] if len(parts) > 1 else None


def test_every_import_names_a_module_of_the_package():
  missing = {(m, d) for m, deps in GRAPH.items() for d in deps if d not in MODULES}
  assert not missing, missing


def test_no_import_circles():
  # Depth-first search; a back edge is a circle.
  state, circles = {}, []

  def visit(module, stack):
    state[module] = "open"
    stack.append(module)
    for dep in sorted(GRAPH.get(module, ())):
      if state.get(dep) == "open":
        circles.append(stack[stack.index(dep):] + [dep])
      elif dep not in state:
        visit(dep, stack)
    stack.pop()
    state[module] = "done"

  for module in sorted(GRAPH):
    if module not in state:
      visit(module, [])
  assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)


def test_parts_import_only_the_parts_below_them():
  assert set(ALLOWED) == {_part(m) for m in MODULES if _part(m)}, "a part without a rule"
  bad = []
  for module, deps in GRAPH.items():
    part = _part(module)
    for dep in deps:
      other = _part(dep)
      if part and other and other != part and other not in ALLOWED[part]:
        bad.append(f"{module} imports {dep}")
  assert not bad, "\n".join(bad)


@pytest.mark.parametrize("prefix", sorted(set(ONLY) | set(NEVER)))
def test_finer_rules(prefix):
  for module, deps in GRAPH.items():
    if not (module == prefix or module.startswith(prefix + ".")):
      continue
    for dep in deps:
      if prefix in ONLY:
        assert dep.startswith(ONLY[prefix]), f"{module} imports {dep}"
      for banned in NEVER.get(prefix, ()):
        assert not (dep == banned or dep.startswith(banned + ".")), f"{module} imports {dep}"


def test_the_checks_see_a_circle():
  """The circle search itself: a graph with one circle in it."""
  global GRAPH
  saved = GRAPH
  try:
    GRAPH = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    with pytest.raises(AssertionError, match="a -> b -> c -> a"):
      test_no_import_circles()
  finally:
    GRAPH = saved
