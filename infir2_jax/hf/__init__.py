"""Hugging Face interop: HF Qwen2/Llama checkpoints in (load.py) and out (save.py), and the
mapping of config fields and tensor names between them and our model (convert.py)."""

from infir2_jax.hf.convert import (
    hf_config_from_model, model_config_from_hf, read_config, tensor_specs)
from infir2_jax.hf.load import SafetensorsReader, load_params, load_pretrained
from infir2_jax.hf.save import export_params

__all__ = ["hf_config_from_model", "model_config_from_hf", "read_config", "tensor_specs",
           "SafetensorsReader", "load_params", "load_pretrained", "export_params"]
