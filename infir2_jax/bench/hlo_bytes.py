"""Bytes each kernel of a compiled XLA program moves, from its optimized HLO text: the
yardstick a profile's times are read against (a kernel's attainable time is its bytes over
the card's bandwidth).

Per instruction that becomes a kernel (fusion, copy, custom call, ...): the bytes of its
result plus those of its operands, with corrections for what a kernel really touches:
- an operand a fusion only reads through dynamic-slices (a layer's slice of a stacked scan
  buffer) counts as the slices it reads;
- a loop fusion reads each operand at most once per output element, so no operand counts
  more than the result;
- an in-place dynamic-update-slice writes only the update: the buffer it updates is not
  counted, the update is counted twice (read and written). Names are normalized as profilers
show kernels ("loop_add_fusion.34" -> "loop_add_fusion_34").
"""

import re

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1,
               "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4,
               "f64": 8, "s64": 8, "u64": 8, "token": 0}
_ARRAY = re.compile(r"\b(" + "|".join(DTYPE_BYTES) + r")\[([\d,]*)\]")
_DEF = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+) = ")
_KERNEL_OPS = ("fusion", "copy", "custom-call", "transpose", "reduce", "scatter", "gather",
               "sort", "dynamic-update-slice", "concatenate", "broadcast", "select-and-scatter")


def type_bytes(type_text: str) -> int:
  """Bytes of an HLO type: an array type or a tuple of them."""
  total = 0
  for dtype, dims in _ARRAY.findall(type_text):
    n = 1
    for d in filter(None, dims.split(",")):
      n *= int(d)
    total += n * DTYPE_BYTES[dtype]
  return total


def split_type(rest: str) -> tuple[str, str]:
  """(type, the rest after it) of 'TYPE op(operands), attrs'."""
  if rest.startswith("("):
    depth = 0
    for i, ch in enumerate(rest):
      depth += ch == "("
      depth -= ch == ")"
      if depth == 0:
        return rest[:i + 1], rest[i + 1:].lstrip()
  head, _, tail = rest.partition(" ")
  return head, tail


def tuple_element(type_text: str, index: int) -> str:
  """The type of element `index` of a tuple type '(T0, T1, ...)' (nested tuples kept whole);
  a non-tuple type is returned as it is."""
  if not type_text.startswith("("):
    return type_text
  elements, depth, start = [], 0, 1
  for i, ch in enumerate(type_text):
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
      if depth == 0:
        elements.append(type_text[start:i].strip())
        break
    elif ch == "," and depth == 1:
      elements.append(type_text[start:i].strip())
      start = i + 1
  return elements[index] if index < len(elements) else ""


def _operand_type(types: dict, operand: str) -> str:
  """An operand's type; '%t#3' (one element of the tuple %t) is that element's type."""
  name, _, index = operand.partition("#")
  type_text = types.get(name, "")
  return tuple_element(type_text, int(index)) if index else type_text


def _operands(call: str) -> list[str]:
  """The %names inside the op's own parentheses (not those of its attributes); an element
  of a tuple keeps its '#index'."""
  start = call.find("(")
  depth, end = 0, len(call)
  for i in range(start, len(call)):
    depth += call[i] == "("
    depth -= call[i] == ")"
    if depth == 0:
      end = i
      break
  return re.findall(r"%([\w.\-]+(?:#\d+)?)", call[start:end])


def kernel_name(hlo_name: str) -> str:
  return hlo_name.replace(".", "_").replace("-", "_")


_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%([\w.\-]+) \(.*\{\s*$")


def _sliced_parameters(body: list[tuple[str, str, str, str]], types) -> dict[int, int]:
  """{parameter index: bytes read} of a fused computation's parameters that are read only
  through dynamic-slices."""
  params = {}
  for name, _, op, call in body:
    if op == "parameter":
      params[name] = int(re.match(r"parameter\((\d+)\)", call).group(1))
  reads: dict[str, list[int | None]] = {p: [] for p in params}
  for name, type_text, op, call in body:
    for i, operand in enumerate(_operands(call)):
      if operand in reads:
        sliced = op == "dynamic-slice" and i == 0
        reads[operand].append(type_bytes(type_text) if sliced else None)
  return {params[p]: sum(r) for p, r in reads.items() if r and None not in r}


def instruction_bytes(hlo_text: str) -> dict[str, dict]:
  """{kernel name: {"bytes", "op", "kind", "type"}} of the kernel-like instructions."""
  types, defs, bodies, current = {}, [], {}, None
  for line in hlo_text.splitlines():
    c = _COMPUTATION.match(line)
    if c:
      current = bodies.setdefault(c.group(1), [])
      continue
    m = _DEF.match(line)
    if not m:
      continue
    name, rest = m.group(1), line[m.end():]
    type_text, call = split_type(rest)
    types[name] = type_text
    op = re.match(r"([\w\-]+)\(", call)
    if op:
      defs.append((name, type_text, op.group(1), call))
      if current is not None:
        current.append(defs[-1])
  out = {}
  for name, type_text, op, call in defs:
    if op not in _KERNEL_OPS:
      continue
    kind = re.search(r"kind=(k\w+)", call)
    kind = kind.group(1) if kind else ""
    result = type_bytes(type_text)
    operand_bytes = [type_bytes(_operand_type(types, o)) for o in _operands(call)]
    callee = re.search(r"calls=%([\w.\-]+)", call)
    if op == "fusion" and callee and callee.group(1) in bodies:
      for i, read in _sliced_parameters(bodies[callee.group(1)], types).items():
        if i < len(operand_bytes):
          operand_bytes[i] = read
    in_place = "dynamic_update_slice" in name or "dynamic-update-slice" in name or (
        op == "dynamic-update-slice")
    if in_place and result in operand_bytes:
      operand_bytes.remove(result)
      total = 2 * sum(operand_bytes)
    else:
      if kind == "kLoop":
        operand_bytes = [min(b, result) for b in operand_bytes]
      total = result + sum(operand_bytes)
    out[kernel_name(name)] = {"bytes": total, "op": op, "kind": kind, "type": type_text[:300]}
  return out
