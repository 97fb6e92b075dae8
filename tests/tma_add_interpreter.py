"""TMA reduce-add (cp.reduce.async.bulk .add) for the Mosaic GPU interpreter, in tests only.

JAX 0.11.2's interpreter raises NotImplementedError for copy_smem_to_gmem(reduction_op=...),
so the kernel's split_reduce="tma_add" path could not run on CPU. `enabled()` patches the
interpreter's copy to do what the hardware does for "add": read the shared-memory tile, add
it elementwise (in the destination's dtype) into the global-memory window inside the array's
bounds, atomically with respect to every other add. Other copies go to the original code.

It relies on private interpreter internals (gpu_callbacks), so a JAX upgrade may break it;
the GPU test (tests/test_kernels_gpu.py) checks the same path on the hardware.
"""
import contextlib
import threading

from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as cb

_LOCK = threading.Lock()


class _AddTask(cb.AsyncCopySmemToGmemTask):
  """dst[window] += src, clipped to dst's shape like a TMA store."""

  def __call__(self, tma_thread_id: int):
    memory = cb._get_shared_memory()
    val, _, _ = memory.get_buffer_content(self.src_allocation_key, self.src_access,
                                          self.thread, logging_info=self.logging_info)
    dst_shape = tuple(memory.buffer_shape_and_dtype(self.dst_allocation_key).shape)
    clipped = cb._clip_store_to_shape(self.dst_access, val, dst_shape)
    if clipped is None:
      return
    access, val = clipped
    with _LOCK:
      cur, _, _ = memory.get_buffer_content(self.dst_allocation_key, access, self.thread,
                                            logging_info=self.logging_info)
      memory.store_buffer_content(self.dst_allocation_key, access,
                                  (cur + val.astype(cur.dtype)).astype(cur.dtype),
                                  self.thread, logging_info=self.logging_info)


def _copy_smem_to_gmem(original):
  def copy(*, token, mesh_location, thread, src_allocation_key_as_array, src_transforms,
           dst_allocation_key_as_array, dst_transforms, predicate, source_info,
           commit_group, reduction_op):
    if reduction_op is None:
      return original(
          token=token, mesh_location=mesh_location, thread=thread,
          src_allocation_key_as_array=src_allocation_key_as_array,
          src_transforms=src_transforms,
          dst_allocation_key_as_array=dst_allocation_key_as_array,
          dst_transforms=dst_transforms, predicate=predicate, source_info=source_info,
          commit_group=commit_group, reduction_op=reduction_op)
    if reduction_op != "add" or predicate is not None:
      raise NotImplementedError(f"reduction_op={reduction_op!r}, predicate={predicate!r}")
    memory = cb._get_shared_memory()
    if memory.detect_races:
      raise NotImplementedError("race detection with TMA reduce-add")
    src_key = cb.HostAllocationKey.from_array(src_allocation_key_as_array)
    dst_key = cb.HostAllocationKey.from_array(dst_allocation_key_as_array)
    import jax
    src_transforms = jax.tree.map(int, cb._remove_noop_transforms(src_transforms))
    dst_transforms = jax.tree.map(int, cb._remove_noop_transforms(dst_transforms))
    memory.execute_async_task(_AddTask(
        mesh_location=mesh_location, thread=thread,
        src_allocation_key=src_key, src_access=memory.access(src_key, src_transforms),
        dst_allocation_key=dst_key, dst_access=memory.access(dst_key, dst_transforms),
        source_info=source_info))
    return token
  return copy


@contextlib.contextmanager
def enabled():
  """Within: interpret-mode kernels may store with reduction_op="add"."""
  original = cb.copy_smem_to_gmem
  cb.copy_smem_to_gmem = cb.fail_on_exception(_copy_smem_to_gmem(original.__wrapped__))
  try:
    yield
  finally:
    cb.copy_smem_to_gmem = original
