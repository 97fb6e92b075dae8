"""Parallelism: the device mesh and its logical-axis rules, sharded state, multi-process set-up.

mesh.py          MeshConfig, make_mesh, logical_rules, batch placement per process
state.py         NamedShardings of params / optimizer state, abstract-first sharded init
fp8_alignment.py start-up check that FP8 tiles never straddle a shard boundary
distributed.py   jax.distributed set-up (flags, environment, SLURM), compilation cache
"""

from infir2_jax.parallel.mesh import (
    DEFAULT_RULES, MESH_AXES, MeshConfig, Rules, as_axes, batch_sharding, data_process_index,
    logical_rules, make_mesh, mesh_axes_of, replicated, ways)
from infir2_jax.parallel.state import (
    abstract_state, param_shardings, path_str, sharded_init, spec_table, state_shardings)
from infir2_jax.parallel.fp8_alignment import check_fp8_alignment, fp8_alignment_problems

__all__ = [
    "DEFAULT_RULES", "MESH_AXES", "MeshConfig", "Rules", "as_axes", "batch_sharding",
    "data_process_index", "logical_rules", "make_mesh", "mesh_axes_of", "replicated", "ways",
    "abstract_state", "param_shardings", "path_str", "sharded_init", "spec_table",
    "state_shardings", "check_fp8_alignment", "fp8_alignment_problems",
]
