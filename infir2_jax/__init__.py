"""infir2_jax: FP8 (InfiR2 recipe) training of Qwen2.5-class models in JAX/Flax."""

__version__ = "0.1.0"
