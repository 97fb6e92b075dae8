"""parallel/distributed.install_atomic_cache_writes: JAX's persistent compilation cache
never keeps a truncated entry (a killed write, a full disk, a file-size limit), and heals
one that an older write left behind."""
import os
import subprocess
import sys
import textwrap

from jax._src import lru_cache

from infir2_jax.parallel import distributed


def test_a_truncated_entry_is_replaced_and_no_temporary_file_is_left(tmp_path):
  assert distributed.install_atomic_cache_writes()
  cache = lru_cache.LRUCache(str(tmp_path), max_size=-1)
  value = os.urandom(200_000)
  (tmp_path / "jit_step-abc-cache").write_bytes(value[:65536])   # what EFBIG left
  cache.put("jit_step-abc", value)
  assert cache.get("jit_step-abc") == value
  assert sorted(os.listdir(tmp_path)) == ["jit_step-abc-cache"]


def test_unpatched_jax_keeps_the_truncated_entry(tmp_path):
  """The reason for the patch, checked against JAX itself: if this fails, JAX fixed it."""
  script = textwrap.dedent(f"""
      from jax._src import lru_cache
      cache = lru_cache.LRUCache({str(tmp_path)!r}, max_size=-1)
      open({str(tmp_path / 'k-cache')!r}, 'wb').write(b'short')
      cache.put('k', b'the whole program')
      print(cache.get('k'))""")
  out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       check=True).stdout
  assert out.strip() == "b'short'"


def test_a_write_over_the_file_size_limit_leaves_nothing(tmp_path):
  script = textwrap.dedent(f"""
      import resource, signal, os
      from jax._src import lru_cache
      from infir2_jax.parallel import distributed
      distributed.install_atomic_cache_writes()
      resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))
      signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
      cache = lru_cache.LRUCache({str(tmp_path)!r}, max_size=-1)
      try:
        cache.put('jit_step-abc', os.urandom(200_000))
      except OSError as e:
        print('raised', e.errno)
      print(sorted(os.listdir({str(tmp_path)!r})))""")
  out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       check=True, cwd=os.path.dirname(os.path.dirname(__file__))).stdout
  assert out.splitlines() == ["raised 27", "[]"], out
