"""Reading HF Qwen2/Llama checkpoints (config.json + safetensors) into our params.

Loading never materialises a whole model on the host: tensors are read lazily with
safetensors' `safe_open`, and with target shardings each device reads only its own slice.
Block-scaled FP8 checkpoints (float8 weights with `weight_scale_inv`, e.g. our own --fp8
export or DeepSeek-V3-style FP8 releases) are dequantized while reading: w = q * scale_inv
per block, the blocks covering the slice read only.
"""

import json
import os
from collections.abc import Iterator
from typing import Any

import flax.traverse_util
import jax
import jax.numpy as jnp
import ml_dtypes  # also registers bfloat16 with numpy for safetensors' reader
import numpy as np
from safetensors import safe_open

from infir2_jax import errors
from infir2_jax.errors import DataError, NotFound
from infir2_jax.hf.convert import (
    FP8_DEFAULT_BLOCK, FP8_SCALE_SUFFIX, IGNORED_SUFFIXES, TensorSpec, check_compatible,
    fp8_block_size, model_config_from_hf, tensor_specs)
from infir2_jax.model import ModelConfig, Qwen2, param_shapes

_FP8_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}
_REFETCH = "download or export the checkpoint again (a copy cut short, or a disk that filled)"


def _safe_open(file: str):
  """safetensors' safe_open; a truncated or corrupt file is a DamagedFile naming it."""
  try:
    return safe_open(file, "numpy")
  except Exception as e:  # safetensors raises its own SafetensorError for every bad header
    if type(e).__name__ != "SafetensorError":
      raise
    raise errors.damaged_file(file, f"{os.path.getsize(file)} bytes, {e}", _REFETCH) from None


class _MappedSlice:
  """A float8 tensor of a .safetensors file, memory-mapped: [idx] reads only that part."""

  def __init__(self, file: str, name: str, dtype):
    with open(file, "rb") as f:
      header_len = int.from_bytes(f.read(8), "little")
      entry = json.loads(f.read(header_len))[name]
    begin, end = entry["data_offsets"]
    self._array = np.memmap(file, np.uint8, "r", offset=8 + header_len + begin,
                            shape=(end - begin,)).view(dtype).reshape(entry["shape"])

  def get_shape(self) -> list[int]:
    return list(self._array.shape)

  def __getitem__(self, index):
    return np.array(self._array[index])


class SafetensorsReader:
  """Lazy reader of a checkpoint's tensors: model.safetensors or shards with an index."""

  def __init__(self, path: str):
    self.path = path
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
      weight_map = errors.read_json_file(index, _REFETCH).get("weight_map")
      if not isinstance(weight_map, dict):
        raise errors.damaged_file(index, "no weight_map", _REFETCH)
      self.files = {name: os.path.join(path, file) for name, file in weight_map.items()}
    else:
      files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
      if not files:
        raise NotFound(f"no *.safetensors files in {path}")
      self.files = {}
      for file in files:
        with _safe_open(os.path.join(path, file)) as f:
          self.files.update({name: os.path.join(path, file) for name in f.keys()})
    self._open: dict[str, Any] = {}
    # Block-scaled FP8 weights: the block of their weight_scale_inv (None: no FP8 weights).
    self.fp8_block = None
    if any(name.endswith(FP8_SCALE_SUFFIX) for name in self.files):
      has_config = os.path.isfile(os.path.join(path, "config.json"))
      self.fp8_block = fp8_block_size(path) if has_config else FP8_DEFAULT_BLOCK

  def names(self) -> list[str]:
    return list(self.files)

  def slice(self, name: str):
    """safetensors' lazy slice of a tensor: .get_shape(), and [idx] reads only that part."""
    file = self.files[name]
    if file not in self._open:
      self._open[file] = _safe_open(file)
    tensor = self._open[file].get_slice(name)
    if tensor.get_dtype() in _FP8_DTYPES:  # safetensors' numpy reader has no float8 types
      return _MappedSlice(file, name, _FP8_DTYPES[tensor.get_dtype()])
    return tensor

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self.slice(name).get_shape())


def _bounds(index: slice, size: int) -> tuple[int, int]:
  start, stop, step = index.indices(size)
  if step != 1:
    raise ValueError(f"strided reads are not supported, got {index}")
  return start, stop


def _dequantized(reader, name: str, hf_index: tuple[slice, slice], block: tuple[int, int]):
  """float32 q * scale_inv of the part hf_index ([out, in] layout) of an FP8 weight."""
  tensor = reader.slice(name)
  (r0, r1), (c0, c1) = (_bounds(i, n) for i, n in zip(hf_index, tensor.get_shape()))
  q = tensor[r0:r1, c0:c1].astype(np.float32)
  (b0, b1), (s0, t0) = block, (r0 // block[0], c0 // block[1])
  scale = reader.slice(name + FP8_SCALE_SUFFIX)[s0:-(-r1 // b0), t0:-(-c1 // b1)]
  scale = np.repeat(np.repeat(np.asarray(scale, np.float32), b0, axis=0), b1, axis=1)
  return q * scale[r0 - s0 * b0:r1 - s0 * b0, c0 - t0 * b1:c1 - t0 * b1]


def _read(reader: SafetensorsReader, spec: TensorSpec, index: tuple[slice, ...], dtype):
  """The part `index` (in our layout) of a tensor, converted to dtype (dequantized first
  when it is a block-scaled FP8 weight)."""
  hf_index = (index[1], index[0]) if spec.transpose else index
  if reader.fp8_block is not None and spec.name + FP8_SCALE_SUFFIX in reader.files:
    value = _dequantized(reader, spec.name, hf_index, reader.fp8_block)
  else:
    value = reader.slice(spec.name)[hf_index]
  if spec.transpose:
    return np.ascontiguousarray(value.T).astype(dtype)
  return value.astype(dtype)


def _check_scales(reader: SafetensorsReader, block: tuple[int, int], wanted: set[str]) -> None:
  """Every weight_scale_inv belongs to a 2-D weight the model reads, in the block's shape."""
  for name in reader.names():
    if not name.endswith(FP8_SCALE_SUFFIX):
      continue
    weight = name[:-len(FP8_SCALE_SUFFIX)]
    if weight not in wanted:
      continue  # reported with the other tensors the model has no place for
    shape = reader.shape(weight)
    expected = tuple(-(-d // b) for d, b in zip(shape, block))
    if len(shape) != 2 or reader.shape(name) != expected:
      raise ValueError(f"HF FP8 tensor {name} has shape {reader.shape(name)}; {weight} "
                       f"{shape} in {block[0]}x{block[1]} blocks needs {expected} (check "
                       "quantization_config.weight_block_size)")


def _check_tensors(reader: SafetensorsReader, specs: dict[str, TensorSpec],
                   shapes: dict[str, tuple[int, ...]]) -> None:
  wanted = {s.name for s in specs.values()}
  available = set(reader.names())
  missing = sorted(wanted - available)
  if missing:
    raise DataError(f"HF checkpoint {reader.path} lacks {len(missing)} tensors the config "
                    f"needs, e.g. {missing[:5]}")
  scales = {n for n in available
            if n.endswith(FP8_SCALE_SUFFIX) and n[:-len(FP8_SCALE_SUFFIX)] in wanted}
  extra = sorted(n for n in available - wanted - scales
                 if not n.endswith(IGNORED_SUFFIXES) and n != "lm_head.weight")
  if extra:
    raise DataError(f"HF checkpoint {reader.path} has {len(extra)} tensors the model has no "
                    f"place for (unsupported architecture?), e.g. {extra[:5]}")
  for path, spec in specs.items():
    stored = reader.shape(spec.name)
    expected = shapes[path][::-1] if spec.transpose else shapes[path]
    if stored != tuple(expected):
      raise DataError(f"HF tensor {spec.name} has shape {stored}, expected {tuple(expected)} "
                      f"for {path}")


def _iter_params(path: str, cfg: ModelConfig) -> Iterator[tuple[Any, str, TensorSpec, tuple]]:
  """(reader, param path, HF tensor, param shape) for every param, after checking them all."""
  reader = SafetensorsReader(path)
  specs = tensor_specs(cfg)
  shapes = param_shapes(cfg)
  _check_tensors(reader, specs, shapes)
  if reader.fp8_block is not None:
    _check_scales(reader, reader.fp8_block, {s.name for s in specs.values()})
  for name, spec in specs.items():
    yield reader, name, spec, shapes[name]


def load_params(path: str, model_cfg: ModelConfig, shardings=None):
  """Reads an HF checkpoint's tensors into our param tree, one tensor at a time.

  Args:
    path: HF checkpoint directory (config.json, model.safetensors or shards + index).
    model_cfg: the model to load into; its architecture must match config.json
      (a ValueError names each field that does not).
    shardings: optional pytree of NamedSharding matching the params (e.g.
      `sharding.state_shardings(...)["params"]`). With it each tensor is built with
      jax.make_array_from_callback, and every device reads only its own slice from disk;
      without it, tensors land on the default device.

  Returns:
    The (unboxed) params pytree in model_cfg.param_dtype (FP8 weights dequantized).
  """
  check_compatible(model_config_from_hf(path), model_cfg, path)
  dtype = np.dtype(model_cfg.param_dtype)
  flat_shardings = (None if shardings is None
                    else flax.traverse_util.flatten_dict(shardings, sep="/"))
  out = {}
  for reader, name, spec, shape in _iter_params(path, model_cfg):
    if flat_shardings is None:
      out[name] = jnp.asarray(_read(reader, spec, (slice(None),) * len(shape), dtype))
      continue
    sharding = flat_shardings[name]
    cache = {}   # replicated shards ask for the same index on every device: read it once

    def callback(index, reader=reader, spec=spec, cache=cache):
      key = tuple((s.start, s.stop, s.step) for s in index)
      if key not in cache:
        cache[key] = _read(reader, spec, index, dtype)
      return cache[key]
    out[name] = jax.make_array_from_callback(shape, sharding, callback)
  return flax.traverse_util.unflatten_dict(out, sep="/")


def load_pretrained(path: str, *, dtype: str = "float32", param_dtype: str = "float32",
                    **overrides) -> tuple[Qwen2, Any]:
  """(model, params) from an HF Qwen2/Llama checkpoint directory.

  `model.apply({"params": params}, tokens_BxL)` returns float32 logits [B, L, V]. The compute
  dtype defaults to float32 (exact comparison with transformers); pass dtype="bfloat16" for speed.
  """
  cfg = model_config_from_hf(path, dtype=dtype, param_dtype=param_dtype, **overrides)
  return Qwen2(cfg), load_params(path, cfg)
