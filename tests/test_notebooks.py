"""colabs/*.ipynb are stored with their outputs, and CI executes every one top to bottom in
small mode on CPU (GPU cells skip themselves).

Refresh the stored outputs (small mode, as CI runs them, figures kept) after changing one:
  python tests/test_notebooks.py colabs/quickstart.ipynb [...]
"""

import glob
import os
import sys
import tempfile

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "colabs", "*.ipynb")))


def test_all_expected_notebooks_exist():
  names = {os.path.basename(p) for p in NOTEBOOKS}
  assert {"quickstart.ipynb", "numerics.ipynb", "kernels.ipynb"} <= names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebooks_are_stored_with_their_outputs(path):
  """Every code cell ran, in order, and what it printed or drew is in the file: a reader on
  GitHub sees the results without running anything (CI re-executes them below)."""
  nb = nbformat.read(path, as_version=4)
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert [c.execution_count for c in code] == list(range(1, len(code) + 1))
  assert all(c.outputs for c in code), [c.source[:60] for c in code if not c.outputs]
  assert not [o for c in code for o in c.outputs if o.output_type == "error"]
  if os.path.basename(path) in ("quickstart.ipynb", "numerics.ipynb"):
    assert any("image/png" in o.get("data", {}) for c in code for o in c.outputs)


def execute(path: str, tmp_dir: str, figures: bool = False):
  """Runs the notebook at `path` in small mode on one CPU device; returns it with outputs.

  Its runs go under tmp_dir/work, its compilation cache to tmp_dir/jax_cache. Without
  `figures` matplotlib draws to Agg (nothing is kept); with it, inline PNGs are.
  """
  env = {"INFIR2_NOTEBOOK_SMALL": "1", "XLA_FLAGS": "",  # one CPU device, not conftest's 8
         "INFIR2_COMPILATION_CACHE": os.path.join(tmp_dir, "jax_cache"),
         "INFIR2_NOTEBOOK_WORKDIR": os.path.join(tmp_dir, "work"),  # not a leaked mkdtemp
         "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)}
  os.makedirs(env["INFIR2_NOTEBOOK_WORKDIR"], exist_ok=True)
  saved = dict(os.environ)
  os.environ.update(env)
  if figures:
    os.environ.pop("MPLBACKEND", None)
  else:
    os.environ["MPLBACKEND"] = "Agg"
  try:
    nb = nbformat.read(path, as_version=4)
    # "python3" resolves to this interpreter (the venv's) in jupyter_client's kernel launcher.
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": os.path.dirname(path)}}).execute()
  finally:
    os.environ.clear()
    os.environ.update(saved)
  return nb


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs_in_small_mode(path, tmp_path):
  nb = execute(path, str(tmp_path))
  errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
            if o.get("output_type") == "error"]
  assert not errors
  if os.path.basename(path) in ("quickstart.ipynb", "numerics.ipynb"):
    assert any((tmp_path / "work").iterdir()), \
        "the notebook did not write its runs under INFIR2_NOTEBOOK_WORKDIR"


if __name__ == "__main__":
  for notebook in sys.argv[1:] or NOTEBOOKS:
    with tempfile.TemporaryDirectory() as tmp:
      executed = execute(os.path.abspath(notebook), tmp, figures=True)
    nbformat.write(executed, notebook)
    print(f"executed and saved {notebook}")
