"""Reading HF Qwen2/Llama checkpoints (config.json + safetensors) into our params.

Loading never materialises a whole model on the host: tensors are read lazily with
safetensors' `safe_open`, and with target shardings each device reads only its own slice.
"""

import json
import os
from collections.abc import Iterator
from typing import Any

import flax.traverse_util
import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16/float8 with numpy for safetensors' reader)
import numpy as np
from safetensors import safe_open

from infir2_jax.hf.convert import (
    IGNORED_SUFFIXES, TensorSpec, check_compatible, model_config_from_hf, tensor_specs)
from infir2_jax.model import ModelConfig, Qwen2, param_shapes

class SafetensorsReader:
  """Lazy reader of a checkpoint's tensors: model.safetensors or shards with an index."""

  def __init__(self, path: str):
    self.path = path
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
      with open(index) as f:
        self.files = {name: os.path.join(path, file)
                      for name, file in json.load(f)["weight_map"].items()}
    else:
      files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
      if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
      self.files = {}
      for file in files:
        with safe_open(os.path.join(path, file), "numpy") as f:
          self.files.update({name: os.path.join(path, file) for name in f.keys()})
    self._open: dict[str, Any] = {}

  def names(self) -> list[str]:
    return list(self.files)

  def slice(self, name: str):
    """safetensors' lazy slice of a tensor: .get_shape(), and [idx] reads only that part."""
    file = self.files[name]
    if file not in self._open:
      self._open[file] = safe_open(file, "numpy")
    return self._open[file].get_slice(name)

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self.slice(name).get_shape())


def _read(reader: SafetensorsReader, spec: TensorSpec, index: tuple[slice, ...], dtype):
  """The part `index` (in our layout) of a tensor, converted to dtype."""
  tensor = reader.slice(spec.name)
  if spec.transpose:
    return np.ascontiguousarray(tensor[index[1], index[0]].T).astype(dtype)
  return tensor[index].astype(dtype)


def _check_tensors(reader: SafetensorsReader, specs: dict[str, TensorSpec],
                   shapes: dict[str, tuple[int, ...]]) -> None:
  wanted = {s.name for s in specs.values()}
  available = set(reader.names())
  missing = sorted(wanted - available)
  if missing:
    raise ValueError(f"HF checkpoint {reader.path} lacks {len(missing)} tensors the config "
                     f"needs, e.g. {missing[:5]}")
  extra = sorted(n for n in available - wanted
                 if not n.endswith(IGNORED_SUFFIXES) and n != "lm_head.weight")
  if extra:
    raise ValueError(f"HF checkpoint {reader.path} has {len(extra)} tensors the model has no "
                     f"place for (unsupported architecture?), e.g. {extra[:5]}")
  for path, spec in specs.items():
    stored = reader.shape(spec.name)
    expected = shapes[path][::-1] if spec.transpose else shapes[path]
    if stored != tuple(expected):
      raise ValueError(f"HF tensor {spec.name} has shape {stored}, expected {tuple(expected)} "
                       f"for {path}")


def _iter_params(path: str, cfg: ModelConfig) -> Iterator[tuple[Any, str, TensorSpec, tuple]]:
  """(reader, param path, HF tensor, param shape) for every param, after checking them all."""
  reader = SafetensorsReader(path)
  specs = tensor_specs(cfg)
  shapes = param_shapes(cfg)
  _check_tensors(reader, specs, shapes)
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
    The (unboxed) params pytree in model_cfg.param_dtype.
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
