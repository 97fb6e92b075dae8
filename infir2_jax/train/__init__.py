"""Training: loss, optimizer, the pure step, the loop, checkpoints, metrics, the run directory.

`python -m infir2_jax.train` (this package's __main__) is the command line.
"""
