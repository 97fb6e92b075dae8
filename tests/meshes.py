"""The 4-CPU-device mesh the per-shard tests compare one device against."""
import contextlib

import flax.linen as nn
import jax

from infir2_jax import parallel


@contextlib.contextmanager
def fsdp2_tensor2(model_cfg):
  """fsdp 2 x tensor 2 on the first 4 devices, set as the mesh with model_cfg's logical
  axis rules, for the body of the `with`."""
  mesh_cfg = parallel.MeshConfig(1, 2, 2)
  mesh = parallel.make_mesh(mesh_cfg, jax.devices()[:4])
  with jax.set_mesh(mesh), nn.logical_axis_rules(
      parallel.logical_rules(mesh_cfg, model_cfg, mesh)):
    yield mesh
