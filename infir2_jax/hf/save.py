"""Writing HF checkpoints: bf16 (or block-scaled FP8) safetensors, config and tokenizer files.

export_params writes config.json, generation_config.json, model*.safetensors (+ index) and
the tokenizer files (tokenizer.json, tokenizer_config.json with the Qwen2.5 chat template of
data/chat.py).

With fp8=True it writes the block-scaled FP8 layout of DeepSeek-V3 / Qwen FP8 checkpoints,
which vLLM and SGLang serve and transformers loads (dequantizing on CPU):
`quantization_config` = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme":
"dynamic", "weight_block_size": [128, 128]}; every q/k/v/o/gate/up/down weight is
float8_e4m3fn [out, in] with `weight_scale_inv` float32 [ceil(out/128), ceil(in/128)].
Despite its name, weight_scale_inv is the DEQUANTIZATION multiplier: w ~= q *
weight_scale_inv per 128x128 block (DeepSeek-V3's `weight_dequant` and transformers'
Fp8Dequantize both multiply), i.e. our `scale` with scale_format "fp32" (amax / 448).
Embeddings, norms, biases and the LM head stay bf16. Quantization:
infir2_jax.precision.quantize.quantize (the shared semantics).
"""

import contextlib
import json
import logging
import os
import shutil
from typing import Any

import flax.traverse_util
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from infir2_jax.data.chat import chat_template
from infir2_jax.data.tokenizer import special_ids
from infir2_jax.hf.convert import hf_config_from_model, tensor_specs
from infir2_jax.model import ModelConfig
from infir2_jax.precision.quantize import quantize

FP8_BLOCK = (128, 128)
QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": list(FP8_BLOCK)}
_QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def hf_tensors(flat_params: dict[str, Any], cfg: ModelConfig, fp8: bool = False):
  """HF-named numpy tensors (bf16, or FP8 + weight_scale_inv) of the given flat params."""
  specs = tensor_specs(cfg)
  out = {}
  for path, value in flat_params.items():
    if path not in specs:
      raise ValueError(f"param {path} has no HF tensor for this config (tie_embeddings="
                       f"{cfg.tie_embeddings}, qkv_bias={cfg.qkv_bias})")
    spec = specs[path]
    w = np.asarray(value, np.float32)
    w = np.ascontiguousarray(w.T) if spec.transpose else w
    if fp8 and path.split("/")[-2] in _QUANTIZED and path.endswith("kernel"):
      if any(d > b and d % b for d, b in zip(w.shape, FP8_BLOCK)):
        # The format allows partial edge blocks (ceil), but vLLM and transformers'
        # dequantizer assume whole 128x128 blocks (or one block covering the whole dim).
        logging.warning("FP8 export: %s is %s, not a multiple of %s; some loaders reject "
                        "partial blocks", spec.name, w.shape, FP8_BLOCK)
      q, scale = quantize(jnp.asarray(w), FP8_BLOCK, "e4m3", "fp32")
      out[spec.name] = np.asarray(q)
      out[spec.name + "_scale_inv"] = np.asarray(scale, np.float32)   # "weight_scale_inv"
    else:
      out[spec.name] = w.astype(ml_dtypes.bfloat16)
  return out


class ShardedWriter:
  """Writes tensors into model-0000i-of-0000n.safetensors files of at most max_bytes each."""

  def __init__(self, out_dir: str, max_bytes: int = 4 << 30):
    self.out_dir, self.max_bytes = out_dir, max_bytes
    self.pending: dict[str, np.ndarray] = {}
    self.files: list[tuple[str, list[str]]] = []
    self.total = 0

  def add(self, tensors: dict[str, np.ndarray]) -> None:
    for name, t in tensors.items():
      if self.pending and sum(x.nbytes for x in self.pending.values()) + t.nbytes > self.max_bytes:
        self._flush()
      self.pending[name] = t
      self.total += t.nbytes

  def _flush(self) -> None:
    tmp = f"part-{len(self.files):05d}.safetensors"
    save_file(self.pending, os.path.join(self.out_dir, tmp), metadata={"format": "pt"})
    _readable(os.path.join(self.out_dir, tmp))
    self.files.append((tmp, list(self.pending)))
    self.pending = {}

  def close(self) -> list[str]:
    """Flushes and names the files (model.safetensors when there is one); returns them."""
    if self.pending or not self.files:
      self._flush()
    n = len(self.files)
    names = (["model.safetensors"] if n == 1
             else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)])
    weight_map = {}
    for (tmp, tensors), name in zip(self.files, names):
      os.replace(os.path.join(self.out_dir, tmp), os.path.join(self.out_dir, name))
      weight_map.update({t: name for t in tensors})
    if n > 1:
      _write_json(os.path.join(self.out_dir, "model.safetensors.index.json"),
                  {"metadata": {"total_size": self.total},
                   "weight_map": dict(sorted(weight_map.items()))})
    return names


def _readable(path: str) -> None:
  """Normal file permissions (0644 under the usual umask): safetensors writes 0600."""
  umask = os.umask(0)
  os.umask(umask)
  os.chmod(path, 0o666 & ~umask)


def _write_json(path: str, obj) -> None:
  with open(path, "w") as f:
    json.dump(obj, f, indent=2)
    f.write("\n")


def write_tokenizer(out_dir: str, tokenizer, *, chat: bool, system_prompt: str,
                    max_length: int = 32768) -> dict[str, int | None]:
  """tokenizer.json + tokenizer_config.json; returns the special ids for config.json."""
  ids = special_ids(tokenizer)
  with open(os.path.join(out_dir, "tokenizer.json"), "w") as f:
    f.write(tokenizer.to_str())
  eos = ids.im_end if chat and ids.im_end is not None else ids.eos
  config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False,
            "bos_token": None, "eos_token": tokenizer.id_to_token(eos),
            "pad_token": tokenizer.id_to_token(ids.pad), "model_max_length": max_length,
            "clean_up_tokenization_spaces": False, "split_special_tokens": False}
  if ids.im_start is not None and ids.im_end is not None:
    config["chat_template"] = chat_template(system_prompt)  # renders like data.chat.render
  _write_json(os.path.join(out_dir, "tokenizer_config.json"), config)
  stops = [i for i in (ids.im_end, ids.eos) if i is not None]
  _write_json(os.path.join(out_dir, "generation_config.json"),
              {"bos_token_id": ids.eos, "eos_token_id": stops if len(stops) > 1 else stops[0],
               "pad_token_id": ids.pad, "do_sample": False})
  return {"bos_token_id": ids.eos, "eos_token_id": eos, "pad_token_id": ids.pad}


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:   # someone else's process
    return True
  return True


def clear_stale(out: str) -> list[str]:
  """Removes what killed exports to `out` left beside it; returns what it did.

  `OUT.tmp-PID` (a half-written export) of a process that is gone is deleted; of a live one
  it is an export writing now: FileExistsError. `OUT.old-PID` is the previous export,
  moved aside just before the new one was renamed in: put back when OUT is missing (the
  kill fell between the two renames), else deleted.
  """
  parent, name = os.path.split(out)
  done = []
  for entry in sorted(os.listdir(parent or ".")):
    kind, _, pid = entry[len(name):].partition("-")
    if not entry.startswith(name) or kind not in (".tmp", ".old") or not pid.isdigit():
      continue
    path = os.path.join(parent, entry)
    if int(pid) != os.getpid() and _pid_alive(int(pid)):
      if kind == ".tmp":
        raise FileExistsError(f"another export (pid {pid}) is writing {out} now ({path}): "
                              "wait for it, or choose another --out (if no such export runs, "
                              f"delete {path})")
      continue
    if kind == ".old" and not os.path.exists(out):
      os.replace(path, out)
      done.append(f"put back {out} from {path}, the export a killed export was replacing")
    else:
      shutil.rmtree(path, ignore_errors=True)
      done.append(f"removed {path}, left by a killed export (pid {pid})")
  return done


@contextlib.contextmanager
def _signals_raise():
  """SIGTERM raises SystemExit(143) while active (SIGINT already raises KeyboardInterrupt),
  so the `except BaseException` below removes the partial folder; main thread only."""
  import signal  # pylint: disable=g-import-not-at-top
  import threading  # pylint: disable=g-import-not-at-top
  if threading.current_thread() is not threading.main_thread():
    yield
    return

  def stop(signum, frame):
    del frame
    raise SystemExit(128 + signum)
  previous = signal.signal(signal.SIGTERM, stop)
  try:
    yield
  finally:
    signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def atomic_dir(out_dir: str, overwrite: bool = False):
  """Yields a fresh folder beside out_dir to write into; renamed to out_dir on success.

  A failure, SIGTERM or SIGINT leaves out_dir as it was (and removes the partial folder);
  what a SIGKILLed export left is cleared by the next one (clear_stale). A non-empty
  out_dir is an error unless `overwrite`, and then it is replaced as a whole, once the new
  folder is complete.
  """
  out = os.path.abspath(out_dir)
  if os.path.exists(out) and not os.path.isdir(out):
    raise NotADirectoryError(f"{out_dir} exists and is not a folder")
  if os.path.isdir(os.path.dirname(out)):
    for note in clear_stale(out):
      logging.warning("%s", note)
  if os.path.isdir(out) and os.listdir(out) and not overwrite:
    raise FileExistsError(f"{out_dir} is not empty: pass overwrite=True (--overwrite) to "
                          "replace it, or choose an empty or new folder")
  tmp = f"{out}.tmp-{os.getpid()}"
  with _signals_raise():
    os.makedirs(tmp)
    old = None
    try:
      yield tmp
      if os.path.isdir(out) and os.listdir(out):
        old = f"{out}.old-{os.getpid()}"
        os.replace(out, old)
      os.replace(tmp, out)   # onto a missing or empty folder: one rename
      if old is not None:
        shutil.rmtree(old)
    except BaseException:
      shutil.rmtree(tmp, ignore_errors=True)
      if old is not None and not os.path.exists(out):   # stopped between the two renames
        os.replace(old, out)
      raise


def export_params(param_groups, cfg: ModelConfig, out_dir: str, *, fp8: bool = False,
                  tokenizer=None, chat: bool = True, system_prompt: str = "",
                  max_shard_bytes: int = 4 << 30, overwrite: bool = False) -> list[str]:
  """Writes an HF checkpoint of params given as one pytree or an iterable of flat groups.

  Everything is written into a new folder beside out_dir, which replaces out_dir only once
  it is complete (atomic_dir): a failed export leaves an earlier one in out_dir intact.

  Args:
    param_groups: the params pytree, or an iterable of flat {"a/b/kernel": array} dicts
      (iter_checkpoint_params streams a checkpoint this way).
    cfg: the model config (architecture of config.json).
    fp8: block-scaled FP8 projections (see the module docstring).
    tokenizer: a `tokenizers.Tokenizer` to ship (None = no tokenizer files).
    chat: eos is <|im_end|> (a chat model) rather than <|endoftext|>.
    system_prompt: the chat template's default system turn.
    overwrite: replace a non-empty out_dir (else that is a FileExistsError).

  Returns:
    The safetensors file names written.
  """
  with atomic_dir(out_dir, overwrite) as tmp:
    return _export_into(param_groups, cfg, tmp, fp8=fp8, tokenizer=tokenizer, chat=chat,
                        system_prompt=system_prompt, max_shard_bytes=max_shard_bytes)


def _export_into(param_groups, cfg: ModelConfig, out_dir: str, *, fp8, tokenizer, chat,
                 system_prompt, max_shard_bytes) -> list[str]:
  if isinstance(param_groups, dict) and not any("/" in k for k in param_groups):
    param_groups = [flax.traverse_util.flatten_dict(param_groups, sep="/")]
  expected = set(tensor_specs(cfg))
  writer, seen = ShardedWriter(out_dir, max_shard_bytes), set()
  for group in param_groups:
    writer.add(hf_tensors(group, cfg, fp8))
    seen |= set(group)
  if seen != expected:
    raise ValueError(f"params do not match the model config: missing "
                     f"{sorted(expected - seen)[:5]}, unexpected {sorted(seen - expected)[:5]}")
  files = writer.close()
  extra = {}
  if tokenizer is not None:
    extra = write_tokenizer(out_dir, tokenizer, chat=chat, system_prompt=system_prompt)
  if fp8:
    extra["quantization_config"] = dict(QUANTIZATION_CONFIG)
  _write_json(os.path.join(out_dir, "config.json"), hf_config_from_model(cfg, **extra))
  return files
